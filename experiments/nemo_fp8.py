"""NeMo 24.07 DGX-H100 FP8 rows against the cost model (issue 11's acceptance; docs/hardware.md).

Each row is predicted with runtime megatron, fp8 (Transformer Engine, per-tensor scaling), the
published degrees and the 24.07 recipe's recompute mode and gradient dtype, within the GPU's whole
memory (autopar/search/published.py `nemo_candidates`); nothing is fitted per row.
`--fit` refits the one fp8 coefficient, the large-GEMM fp8 speedup over bf16
(autopar/cost/precision.py `FP8_GEMM_SPEEDUP`), leaving each model family out in turn: the value
fitted on the other three families predicts the left-out one, and the figures printed for a row are
those of the fit that did not see its family.

    python experiments/nemo_fp8.py [--fit]
"""

from __future__ import annotations

import argparse
import statistics
from functools import cache
from unittest import mock

import numpy as np

from autopar import axes
from autopar.cost import precision
from autopar.search.published import NEMO_FAMILIES, NEMO_FP8, best, nemo_candidates

SPEEDUPS = np.round(np.arange(1.0, 2.0001, 0.02), 2)  # the physical range of the fp8 speedup
candidates = cache(nemo_candidates)  # profiled and enumerated once per row


def runnable_rows():
    """The rows this checkout can plan: CP rows need the context-parallel axis."""
    return [r for r in NEMO_FP8 if r.cp == 1 or "cp" in axes.AXES]


def predict(rows, speedup: float | None = None) -> dict:
    """Predicted tokens/s per GPU per row (at `speedup`, else the shipped coefficient)."""
    out = {}
    patch = {} if speedup is None else {"DEFAULT_FP8_GEMM_SPEEDUP": speedup,
                                        "FP8_GEMM_SPEEDUP": {}}
    with mock.patch.multiple(precision, **patch) if patch else _null():
        for r in rows:
            w, plans = candidates(r)
            _, est = best(w, plans)
            out[r] = est.tokens_per_s / w.world_size
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def errors(rows, predicted: dict) -> dict:
    return {r: predicted[r] / r.tokens_per_s_per_gpu - 1 for r in rows}


def fit(rows) -> float:
    """The speedup minimising the median absolute error over `rows` (a grid over its range)."""
    scores = []
    for s in SPEEDUPS:
        e = errors(rows, predict(rows, float(s)))
        scores.append((statistics.median(abs(v) for v in e.values()), max(abs(v) for v in e.values()), s))
    return float(min(scores)[2])


def leave_one_family_out(rows) -> tuple[dict, dict]:
    """Per family: the speedup fitted on the others; per row: its error under its family's fit."""
    fitted, err = {}, {}
    for family in NEMO_FAMILIES.values():
        held = [r for r in rows if r.family == family]
        if not held:
            continue
        fitted[family] = fit([r for r in rows if r.family != family])
        err.update(errors(held, predict(held, fitted[family])))
    return fitted, err


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="refit the fp8 speedup, leaving each family out")
    args = ap.parse_args()
    rows = runnable_rows()
    skipped = [r.model for r in NEMO_FP8 if r not in rows]
    if args.fit:
        fitted, err = leave_one_family_out(rows)
        for family, s in fitted.items():
            print(f"fitted without {family}: fp8_gemm_speedup {s:.2f}")
        print(f"fitted on all rows: {fit(rows):.2f}")
    else:
        err = errors(rows, predict(rows))
    print(f"{'model':<15}{'gpus':>5}{'tp':>4}{'pp':>4}{'cp':>4}{'published':>11}{'error':>8}")
    for r in rows:
        print(f"{r.model:<15}{r.gpus:>5}{r.tp:>4}{r.pp:>4}{r.cp:>4}{r.tokens_per_s_per_gpu:>11,.0f}{err[r]:>8.1%}")
    values = [abs(v) for v in err.values()]
    print(f"rows {len(values)}: median |error| {statistics.median(values):.1%}, max {max(values):.1%}")
    if skipped:
        print(f"not planned (no cp axis in this checkout): {', '.join(skipped)}")


if __name__ == "__main__":
    main()
