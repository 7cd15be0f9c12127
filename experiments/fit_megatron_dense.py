"""Megatron-Core's dense DGX-H100 rows, each predicted by a fit that did not see its model family
(issue 40, acceptance 3): NeMo 24.07 FP8 and Megatron-Bridge 25.11's Llama 3 FP8-CS rows
(`autopar/search/published_megatron.py`).

One coefficient is fitted, and only to these rows: the large-GEMM fp8 speedup over bf16
(`autopar/cost/precision.py` FP8_GEMM_SPEEDUP, bounded to [1, 2]: fp8's peak is twice bf16's). For each
family (GPT-3, Llama 2, Llama 3, Nemotron; the Bridge rows are Llama 3) the value minimising the
median |error| over the other families' rows predicts the family's rows. Host time is the uncalibrated
default (`Coefficients.launch_s` by GPU generation). Prints each row's held-out error, the median and
max |error|, and the least-squares slope of the signed error against log10(parameters), in points per
decade.

    python experiments/fit_megatron_dense.py
"""

from __future__ import annotations

import statistics
from functools import cache
from unittest import mock

import numpy as np

from autopar import axes
from autopar.cost import precision
from autopar.search import published_megatron
from autopar.search.published import best

SPEEDUPS = np.round(np.arange(1.0, 2.0001, 0.02), 2)  # the physical range of the fp8 speedup
candidates = cache(published_megatron.candidates)  # profiled and laid out once per row


def rows() -> list:
    """The rows this checkout can plan (cp rows need the context-parallel axis)."""
    return [r for r in published_megatron.ROWS if r.cp == 1 or "cp" in axes.AXES]


def predict(rs, speedup: float) -> dict:
    """Predicted tokens/s per GPU per row at fp8 speedup `speedup`."""
    out = {}
    with mock.patch.multiple(precision, DEFAULT_FP8_GEMM_SPEEDUP=speedup, FP8_GEMM_SPEEDUP={}):
        for r in rs:
            w, plans = candidates(r)
            _, est = best(w, plans)
            out[r] = est.tokens_per_s / w.world_size
    return out


def errors(rs, speedup: float) -> dict:
    predicted = predict(rs, speedup)
    return {r: predicted[r] / r.tokens_per_s_per_gpu - 1 for r in rs}


def grid(rs) -> dict:
    """Every row's error at every speedup of the grid, priced once (each fold picks from it)."""
    return {float(s): errors(rs, float(s)) for s in SPEEDUPS}


def fit(rs, table: dict) -> float:
    """The speedup minimising the median |error| over `rs` (then the max), on the grid over its range."""
    scores = []
    for s, e in table.items():
        e = [abs(e[r]) for r in rs]
        scores.append((statistics.median(e), max(e), s))
    return min(scores)[2]


def leave_one_family_out(rs) -> tuple[dict, dict]:
    """Per family: the speedup fitted on the other families; per row: its error under that fit."""
    table = grid(rs)
    fitted, err = {}, {}
    for family in sorted({r.family for r in rs}):
        fitted[family] = fit([r for r in rs if r.family != family], table)
        err.update({r: table[fitted[family]][r] for r in rs if r.family == family})
    return fitted, err


def slope(err: dict) -> float:
    """Least-squares slope of the signed error (points) against log10(parameters)."""
    x = np.log10([published_megatron.parameters(r) for r in err])
    y = 100 * np.array(list(err.values()))
    return float(np.polyfit(x, y, 1)[0])


def figures() -> dict:
    """Everything the report prints: per-row held-out errors, per-family fits, median, max, slope."""
    rs = rows()
    fitted, err = leave_one_family_out(rs)
    values = [abs(v) for v in err.values()]
    return {"fitted": fitted, "errors": err, "median": statistics.median(values), "max": max(values),
            "slope": slope(err)}


def main() -> None:
    f = figures()
    for family, s in f["fitted"].items():
        print(f"fitted without {family}: fp8_gemm_speedup {s:.2f}")
    print(f"{'row':<28}{'family':<10}{'params':>8}{'gpus':>6}{'published':>11}{'held-out error':>16}")
    for r, e in f["errors"].items():
        label = getattr(r, "label", None) or f"NeMo {r.model}"
        print(f"{label:<28}{r.family:<10}{published_megatron.parameters(r) / 1e9:>7.1f}B{r.gpus:>6}"
              f"{r.tokens_per_s_per_gpu:>11,.0f}{e:>16.1%}")
    print(f"rows {len(f['errors'])}: median |error| {f['median']:.1%}, max {f['max']:.1%}; slope of the error "
          f"against log10(parameters) {f['slope']:+.2f} points per decade")


if __name__ == "__main__":
    main()
