"""Fit the cost model's coefficients to measured iteration times: robust least squares on log time.

The residual of a row is log(predicted) - log(measured), so every row weighs by its relative
error whatever its scale (a 50 ms and a 50 s run count alike), and `soft_l1` loss keeps a few
odd rows (a straggler, a mis-logged run) from pulling the fit. Each coefficient has bounds that
keep it physical: efficiencies in (0, 1] (a link never beats its datasheet rate, a GEMM never
beats peak), overheads and latencies non-negative. Scale-free coefficients (FLOPs at which GEMM
efficiency halves, latency scale, overheads) are fitted in log space.

Only coefficients the data can tell apart are fitted: a link kind's efficiency only when some
row communicates over that kind, data-parallel overlap only when some row has dp > 1, and so on;
the others keep their starting value (the cluster's coefficients, else the defaults).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np

from autopar.cost.coefficients import FITTED_BOUNDS, Coefficients, gpu_calibration
from autopar.errors import AutoparError

ROWS_PER_PARAMETER = 2  # a fit needs at least this many rows per fitted coefficient


@dataclass(frozen=True)
class Param:
    """A fitted coefficient: its name in Coefficients ("link_efficiency.nvlink" for a dict entry),
    bounds, whether it is fitted in log space, and the floor used in log space for a value of 0."""

    name: str
    lo: float
    hi: float
    log: bool = False
    help: str = ""
    start: float | None = None  # where the fit starts when the coefficient is outside (lo, hi), e.g. 0


PARAMS = {p.name: p for p in (
    Param("gemm_efficiency", 0.2, 1.0, help="fraction of peak FLOP/s a large GEMM reaches"),
    Param("gemm_half_flops", 1e6, 1e13, log=True, help="per-GPU forward FLOPs of a block at which efficiency halves"),
    Param("hbm_efficiency", 0.1, 1.0, help="fraction of HBM bandwidth streaming kernels reach"),
    # a fused kernel still reads its inputs and writes its outputs: the GPU types' physical floor
    Param("elementwise_traffic", FITTED_BOUNDS["elementwise_traffic"][0], 4.0, log=True,
          help="HBM bytes per profiled elementwise byte"),
    Param("latency_scale", 0.05, 100.0, log=True, help="multiplies the per-hop latency of collectives"),
    Param("dp_overlap", 0.0, 1.0, help="fraction of backward compute hiding data-parallel communication"),
    Param("step_overhead_s", 1e-5, 30.0, log=True, help="fixed seconds per iteration", start=1e-3),
    Param("collective_latency_s", 1e-7, 1e-2, log=True, help="fixed seconds per collective call", start=1e-5),
    Param("block_host_s", 1e-7, 1e-1, log=True, help="host seconds per layer per pass (launches, Python)",
          start=1e-4),
    Param("host_overlap", 1.0, 32.0, log=True, help="p of the p-norm of host and GPU time per micro-batch"),
    Param("optimizer_bytes_per_param", 8.0, 1024.0, log=True,
          help="memory traffic of the optimizer step per parameter (fused Adam: 32 bytes)"),
    Param("selective_host_s", 1e-7, 1e-1, log=True, start=1e-4,
          help="extra host seconds per block per micro-batch under selective recompute (checkpoint dispatch)"),
    Param("tp_host_s", 1e-7, 1e-1, log=True, help="extra host seconds per layer per pass under TP (DTensor dispatch)",
          start=1e-4),
)}
LINK_BOUNDS = (0.02, 1.0)


def param(name: str) -> Param:
    if name in PARAMS:
        return PARAMS[name]
    if name.startswith("link_efficiency."):
        return Param(name, *LINK_BOUNDS, help=f"fraction of the {name.split('.', 1)[1]} link rate reached")
    known = sorted(PARAMS) + ["link_efficiency.<kind>"]
    raise AutoparError(f"unknown coefficient {name!r}; fittable: {', '.join(known)}")


def _bounded(p: Param, dataset) -> Param:
    """`p` with the GEMM efficiency kept below the measured maximum achievable matmul FLOP/s of the
    rows' GPU type (`GpuCalibration.gemm_ceiling`, docs/hardware.md): no GEMM beats it."""
    if dataset.base_cluster is None:
        return p
    return dataclasses.replace(p, hi=gpu_calibration(dataset.base_cluster.gpu.name).upper_bound(p.name, p.hi))


def get_value(c: Coefficients, name: str) -> float:
    if name.startswith("link_efficiency."):
        return float(c.link(name.split(".", 1)[1]))
    return float(getattr(c, name))


def with_values(c: Coefficients, names, values) -> Coefficients:
    """`c` with the named coefficients replaced."""
    plain, links = {}, dict(c.link_efficiency)
    for name, value in zip(names, values):
        if name.startswith("link_efficiency."):
            links[name.split(".", 1)[1]] = float(value)
        else:
            plain[name] = float(value)
    return dataclasses.replace(c, link_efficiency=links, **plain)


def onto(coefficients: dict, values: dict) -> dict:
    """A cluster's `coefficients` (its JSON dict) with `values` (names as `param` spells them,
    link_efficiency.<kind> included) written over it, and nothing else: whatever was not fitted or
    measured keeps coming from the GPU type's fit (Coefficients.for_cluster) wherever the cluster is
    used, under each runtime."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in coefficients.items()}
    for name, value in values.items():
        if name.startswith("link_efficiency."):
            out.setdefault("link_efficiency", {})[name.split(".", 1)[1]] = float(value)
        else:
            out[name] = value
    return out


def _encode(p: Param, value: float) -> float:
    if p.start is not None and not p.lo < value < p.hi:
        value = p.start
    value = min(max(value, p.lo), p.hi)
    return float(np.log(value)) if p.log else float(value)


def _decode(p: Param, z: np.ndarray) -> np.ndarray:
    return np.exp(z) if p.log else z


@dataclass
class FitResult:
    coefficients: Coefficients
    names: list[str]
    values: list[float]
    at_bound: list[str]  # fitted coefficients that ended on a bound
    rows: int
    evaluations: int
    cost: float

    def fitted(self) -> dict[str, float]:
        return dict(zip(self.names, self.values))


CEILING_SPAN = 10.0  # fit the GEMM-efficiency ceiling only with blocks this many half-points big


MIN_PARAMETERS = 3  # fewer rows than ROWS_PER_PARAMETER x this: too few to calibrate
# The order in which coefficients are given up when there are too few rows for all of them: what
# explains most of a step comes first (the compute rate, fixed costs, the links).
PRIORITY = ("gemm_efficiency", "step_overhead_s", "block_host_s", "tp_host_s", "selective_host_s",
            "link_efficiency", "optimizer_bytes_per_param", "collective_latency_s", "gemm_half_flops",
            "elementwise_traffic", "host_overlap", "latency_scale", "dp_overlap")


def default_parameters(dataset, start: Coefficients | None = None, fixed=(), rows: int | None = None) -> list[str]:
    """The coefficients these rows can identify, less `fixed`, most important first, and no more
    than `rows` rows support (ROWS_PER_PARAMETER each, at least MIN_PARAMETERS):

    - the GEMM-efficiency ceiling (`gemm_efficiency`) only when some traced layer (pipeline
      block) reaches CEILING_SPAN x `gemm_half_flops` per GPU: below that the ceiling trades off
      against the half point (the asymptote of a saturating curve is not identified by points
      well below it) and keeps its starting value, which for the presets is the fit to
      Megatron-LM's large-GEMM runs; `gemm_half_flops` then takes its place in the order;
    - a link kind's efficiency only when some row communicates over it, with latency_scale and
      collective_latency_s;
    - dp_overlap only when some row reduces gradients in more than one bucket;
    - tp_host_s only when some row runs tensor parallelism, selective_host_s only when some row
      recomputes selectively;
    - optimizer_bytes_per_param only when some rows shard the optimizer step and others do not (the
      step is otherwise too small a part of every row to tell from the compute);
    - never hbm_efficiency: elementwise time depends on elementwise_traffic / hbm_efficiency only,
      so the pair is degenerate but for the optimizer step, too small a part of a step to tell
      (give it in --params to fit it anyway).
    """
    start = start or Coefficients()
    names = ["gemm_half_flops", "elementwise_traffic", "block_host_s", "host_overlap", "step_overhead_s"]
    ceiling = dataset.max_block_flops() >= CEILING_SPAN * start.gemm_half_flops
    if ceiling:
        names.append("gemm_efficiency")
    kinds = sorted(k for k in dataset.link_kinds() if k != "none")
    names += [f"link_efficiency.{k}" for k in kinds]
    if kinds:
        names += ["latency_scale", "collective_latency_s"]
    if dataset.max_buckets() > 1:
        names.append("dp_overlap")
    if dataset.tensor_parallel():
        names.append("tp_host_s")
    if dataset.selective():
        names.append("selective_host_s")
    if dataset.sharded_optimizer():
        names.append("optimizer_bytes_per_param")
    order = list(PRIORITY) if ceiling else ["gemm_half_flops", *(p for p in PRIORITY if p != "gemm_half_flops")]
    names = sorted((n for n in names if n not in set(fixed)), key=lambda n: order.index(n.split(".")[0]))
    if rows is not None:
        names = names[:max(MIN_PARAMETERS, rows // ROWS_PER_PARAMETER)]
    return names


def needed_rows(n_params: int) -> int:
    return ROWS_PER_PARAMETER * n_params


def fit(dataset, start: Coefficients | None = None, names: list[str] | None = None, loss: str = "soft_l1",
        f_scale: float = 0.05, max_nfev: int | None = None) -> FitResult:
    """Least-squares fit of `names` (default: what the data identifies) to the data set's rows,
    starting from `start` (default: the defaults)."""
    from scipy.optimize import least_squares  # scipy: heavy, imported on first use

    start = start or Coefficients()
    names = list(names) if names is not None else default_parameters(dataset, start, rows=len(dataset))
    params = [_bounded(param(n), dataset) for n in names]
    need = needed_rows(len(params))
    if len(dataset) < need:
        raise AutoparError(f"too few measured rows to calibrate: {len(dataset)} usable row(s), but fitting "
                           f"{len(params)} coefficients needs at least {need} ({ROWS_PER_PARAMETER} per coefficient); "
                           f"collect more traces (autopar traces collect) or fit fewer coefficients")
    log_measured = np.log(dataset.measured)
    lo = np.array([np.log(p.lo) if p.log else p.lo for p in params])
    hi = np.array([np.log(p.hi) if p.log else p.hi for p in params])
    x0 = np.array([_encode(p, get_value(start, p.name)) for p in params])
    x0 = np.clip(x0, lo + 1e-9 * (hi - lo), hi - 1e-9 * (hi - lo))
    evaluations = 0

    def coefficients(z):
        return with_values(start, names, [_decode(p, zi) for p, zi in zip(params, z)])

    def residuals(z):
        nonlocal evaluations
        evaluations += 1
        pred = dataset.predict(coefficients(z))
        return np.log(np.maximum(pred, 1e-12)) - log_measured

    res = least_squares(residuals, x0, bounds=(lo, hi), loss=loss, f_scale=f_scale, x_scale="jac",
                        diff_step=1e-4, ftol=1e-6, xtol=1e-6, gtol=1e-6, max_nfev=max_nfev or 40 * (len(params) + 1))
    values = [float(_decode(p, z)) for p, z in zip(params, res.x)]
    span = hi - lo
    at_bound = [n for n, z, a, b, s in zip(names, res.x, lo, hi, span) if z - a < 1e-6 * s or b - z < 1e-6 * s]
    return FitResult(coefficients(res.x), names, values, at_bound, len(dataset), evaluations, float(res.cost))


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one), at least 1."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _fit_task(task) -> FitResult:
    dataset, start, names = task
    return fit(dataset, start, names)


def _finished(tasks: list, jobs: int):
    """(index, FitResult) of each task as it ends: in order in this process, or from `jobs` spawned
    worker processes (the parent may hold torch's threads, which fork does not copy safely)."""
    if jobs == 1 or len(tasks) < 2:
        yield from ((i, _fit_task(task)) for i, task in enumerate(tasks))
        return
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {pool.submit(_fit_task, task): i for i, task in enumerate(tasks)}
        for future in as_completed(futures):
            yield futures[future], future.result()
    except BaseException:  # a failed fit or Ctrl-C: the queued fits are dropped, not run to the end
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()


def fit_all(tasks, jobs: int = 1, done=None) -> list[FitResult]:
    """`fit(dataset, start, names)` for each task, in task order. The fits of a cross-validation are
    independent and each is seconds to minutes of single-threaded evaluations, so with jobs > 1 they
    run side by side (`_finished`); the results are the serial ones. `done(i, result)` is called as
    each ends."""
    tasks = list(tasks)
    if jobs < 1:
        raise AutoparError(f"--jobs must be at least 1, got {jobs}")
    results = [None] * len(tasks)
    for i, result in _finished(tasks, jobs):
        results[i] = result
        if done:
            done(i, result)
    return results
