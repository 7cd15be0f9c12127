"""Whether an estimate lies inside the regime its coefficients were fitted in, as one line.

A GPU type's coefficients (autopar/cost/coefficients.py `GPU_CALIBRATION`) were fitted to published
rows covering some precisions, recompute modes, runtimes and parallel degrees; a plan beyond them is
extrapolated, and a GPU without public measurements is not calibrated at all. Coefficients a
cluster JSON carries from `autopar calibrate` were fitted to that cluster's own traces: their regime
is the traces', which the calibration report states, so no note is made for them.
"""

from __future__ import annotations

from autopar.cost.coefficients import gpu_calibration

_TRACE_FITTED = ("gemm_efficiency", "gemm_half_flops", "block_host_s")


def regime_note(workload, plan) -> str:
    """"" when the plan is inside the calibrated regime, else one line saying what is outside."""
    cluster = workload.cluster
    if any(k in cluster.coefficients for k in _TRACE_FITTED):
        return ""
    cal = gpu_calibration(cluster.gpu.name)
    if not cal.calibrated:
        return (f"note: {cluster.gpu.name} is uncalibrated (no public measurements behind its efficiencies, "
                "see docs/hardware.md): generic coefficients; calibrate with `autopar calibrate`")
    r = cal.regime
    outside = []
    if plan.precision not in r["precision"]:
        outside.append(f"precision {plan.precision}")
    if plan.recompute not in r["recompute"]:
        outside.append(f"recompute {plan.recompute}")
    if workload.runtime not in r["runtime"]:
        outside.append(f"runtime {workload.runtime}")
    outside += [f"{axis} {getattr(plan, axis)} > {r[axis]}" for axis in ("tp", "pp", "dp") if getattr(plan, axis) > r[axis]]
    if cal.derived_from:
        outside.insert(0, f"GPU {cluster.gpu.name}: coefficients scaled from the {cal.derived_from} fit by "
                          "measured matmul ceilings")
    if not outside:
        return ""
    return f"note: outside the calibrated regime ({'; '.join(outside)}) of {cal.source}: the estimate is extrapolated"
