"""The torch runtime's fit to torch-native rows (`data/published/torch_native_shared.csv`), and its
held-out validation (experiments/fit_torch_runtime.py prints both; cost/torch_runtime.py ships the values).

Per GPU type, at most four coefficients of `cost.torch_runtime.BOUNDS`, each only where that type's
rows can set it (`identified`): `gemm_efficiency` always, `fp8_gemm_speedup` with tensorwise or MXFP8
rows, `fp8_rowwise_speedup` with rowwise rows, `async_tp_overlap` with async-TP rows (compile's factors
keep their documented defaults). A coefficient a fit has no row for keeps its prior, the value before this
fit: the Megatron-derived GEMM efficiency, the GPU type's fp8 speedup, rowwise as tensorwise, async TP
hiding under all of a pass's GEMMs. Least squares on log(predicted / published), inside the bounds (the
GEMM efficiency below the GPU's measured MAMF ceiling).

Held out: each row is predicted by a fit that did not see its table; where the row has a feature that
only one table of its GPU type has (async TP, rowwise or MXFP8 float8, or the GPU type itself when it
has a single table: torchao's H100 and B200 rows), by a fit that did not see the row.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from autopar.cost.arrays import PlanArrays
from autopar.cost.coefficients import Coefficients, gpu_calibration
from autopar.cost.model import evaluate
from autopar.cost.precision import fp8_gemm_speedup
from autopar.cost.torch_runtime import BOUNDS, MAX_FITTED
from autopar.search import published_torch as pt

FITTED = ("gemm_efficiency", "fp8_gemm_speedup", "fp8_rowwise_speedup", "async_tp_overlap")


@dataclasses.dataclass(frozen=True)
class Case:
    row: pt.TorchNativeRow
    workload: object
    arrays: PlanArrays
    gpu: str  # the GPU type's spec name

    @property
    def features(self) -> tuple[str, ...]:
        """The fit's coefficients this row moves."""
        return pt.features(self.row)


@functools.cache
def cases() -> tuple[Case, ...]:
    """Every expressible row, its workload and plan built once (a fit evaluates them hundreds of times)."""
    out = []
    for row in pt.ROWS:
        if pt.expressible(row):
            continue
        w = pt.torch_workload(row)
        plan = pt.torch_plan(row, w)
        # what autopar.capability allows (a row compiled under tp or pp: all but compile, as the report prices it)
        (plan.with_(compile=False) if pt.compiled_beyond_executor(row) else plan).validate(w)
        out.append(Case(row, w, PlanArrays.from_plans([plan], w.profile), w.cluster.gpu.name))
    return tuple(out)


def prior(case: Case) -> Coefficients:
    """The coefficients before the torch-runtime fit: the torch runtime's, the fitted names at their priors."""
    base = Coefficients.for_cluster(case.workload.cluster, "torch")
    defaults = Coefficients()
    values = {n: getattr(defaults, n) for n in BOUNDS}
    values["gemm_efficiency"] = gpu_calibration(case.gpu).fitted.get("gemm_efficiency", defaults.gemm_efficiency)
    return dataclasses.replace(base, **values)


def predict(case: Case, values: dict[str, float]) -> float:
    """Tokens/s per GPU under the prior with `values` in place."""
    c = dataclasses.replace(prior(case), **values)
    it = float(evaluate(case.workload, case.arrays, c)["iteration_time"][0])
    return case.workload.global_batch * case.workload.profile.seq_len / it / case.row.gpus


def bounds(gpu: str, name: str) -> tuple[float, float]:
    lo, hi = BOUNDS[name]
    return lo, gpu_calibration(gpu).upper_bound(name, hi)


def identified(name: str, rows: list[Case]) -> bool:
    """Whether `rows` can set `name`: the GEMM efficiency always; another coefficient where at least two
    rows move it (one alone would be matched exactly, its error zero by construction) and one does not
    (the contrast that tells it from the GEMM efficiency)."""
    moved = sum(name in c.features for c in rows)
    return name == "gemm_efficiency" or (moved >= 2 and moved < len(rows))


def fit(rows: list[Case]) -> dict[str, float]:
    """The fitted coefficients of one GPU type's rows: those the rows move, least squares in log error."""
    from scipy.optimize import least_squares  # heavy optional package (autopar.layers.LAZY_PACKAGES)
    gpu = rows[0].gpu
    names = [n for n in FITTED if identified(n, rows)][:MAX_FITTED]
    start = prior(rows[0])
    x0, lo, hi = [], [], []
    for n in names:
        a, b = bounds(gpu, n)
        v = getattr(start, n) or prior_fp8(rows[0])
        x0.append(min(max(v, a + 1e-6), b - 1e-6)), lo.append(a), hi.append(b)

    def residuals(x):
        values = dict(zip(names, x))
        return [np.log(predict(c, values) / c.row.tokens_per_s_per_gpu) for c in rows]

    result = least_squares(residuals, x0, bounds=(lo, hi), diff_step=1e-3, xtol=1e-6, ftol=1e-8)
    return {n: round(float(v), 4) for n, v in zip(names, result.x)}


def prior_fp8(case: Case) -> float:
    """A zero prior's meaning: the GPU type's fp8 speedup (cost/precision.py); rowwise as tensorwise."""
    return fp8_gemm_speedup(case.workload.cluster.gpu)


def by_gpu() -> dict[str, list[Case]]:
    out: dict[str, list[Case]] = {}
    for c in cases():
        out.setdefault(c.gpu, []).append(c)
    return out


def fold(case: Case, rows: list[Case]) -> str:
    """What the fit that predicts `case` leaves out: its row where it has a feature only one table of
    its GPU type has (or its GPU type has one table), else its table."""
    tables = {c.row.source for c in rows}
    for name in case.features[1:]:
        if len({c.row.source for c in rows if name in c.features}) == 1:
            return "row"
    return "row" if len(tables) == 1 else "table"


def held_out() -> list[tuple[Case, str, dict[str, float], float]]:
    """(case, what was left out, the fit without it, held-out tokens/s per GPU) for every row."""
    out = []
    for gpu, rows in by_gpu().items():
        for case in rows:
            kind = fold(case, rows)
            seen = [c for c in rows if (c is not case if kind == "row" else c.row.source != case.row.source)]
            values = fit(seen)
            out.append((case, kind, values, predict(case, values)))
    return out


def shipped_fit() -> dict[str, dict[str, float]]:
    """Each GPU type's fit on all its rows: what cost/torch_runtime.py ships."""
    return {gpu: fit(rows) for gpu, rows in by_gpu().items()}
