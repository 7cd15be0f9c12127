"""Accuracy of predicted iteration times against measured ones, and of the picks they imply."""

from __future__ import annotations

import numpy as np


def relative_errors(predicted, measured) -> np.ndarray:
    return np.asarray(predicted, dtype=float) / np.asarray(measured, dtype=float) - 1


def mape(predicted, measured) -> float:
    """Mean absolute percentage error, as a fraction (0.08 = 8%)."""
    return float(np.mean(np.abs(relative_errors(predicted, measured))))


def max_error(predicted, measured) -> float:
    return float(np.max(np.abs(relative_errors(predicted, measured))))


def spearman(predicted, measured) -> float:
    """Spearman rank correlation (1: the prediction orders the runs exactly as measured)."""
    from scipy.stats import spearmanr  # scipy: heavy, imported on first use

    if len(predicted) < 2:
        return float("nan")
    return float(spearmanr(predicted, measured).statistic)


def worst(predicted, measured, n: int = 5) -> list[int]:
    """Indices of the n rows with the largest absolute relative error, worst first."""
    err = np.abs(relative_errors(predicted, measured))
    return [int(i) for i in np.argsort(-err, kind="stable")[:n]]


def group_picks(predicted, measured, keys) -> list[dict]:
    """Per group of runs (one model on one cluster with one batch): the run the cost model ranks
    first, and its measured time over the group's measured best (1.0: the pick is the best)."""
    predicted, measured = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    out = []
    for key in sorted(set(keys), key=str):
        rows = np.flatnonzero(np.array([k == key for k in keys]))
        pick = rows[np.argmin(predicted[rows])]
        best = rows[np.argmin(measured[rows])]
        out.append({"group": key, "runs": len(rows), "pick": int(pick), "best": int(best),
                    "pick_measured_s": float(measured[pick]), "best_measured_s": float(measured[best]),
                    "ratio": float(measured[pick] / measured[best])})
    return out


def summary(predicted, measured, keys=None) -> dict:
    out = {"rows": int(len(measured)), "mape": mape(predicted, measured), "max_error": max_error(predicted, measured),
           "spearman": spearman(predicted, measured)}
    if keys is not None:
        picks = group_picks(predicted, measured, keys)
        multi = [p for p in picks if p["runs"] > 1]
        out["groups"] = picks
        out["pick_ratio_mean"] = float(np.mean([p["ratio"] for p in multi])) if multi else float("nan")
        out["pick_ratio_max"] = float(np.max([p["ratio"] for p in multi])) if multi else float("nan")
    return out
