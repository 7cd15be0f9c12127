"""Whether an estimate lies inside the regime its coefficients were fitted in, as one line.

A GPU type's coefficients (autopar/cost/coefficients.py `GPU_CALIBRATION`) were fitted to published
rows covering some precisions, recompute modes, runtimes and parallel degrees; a plan beyond them is
extrapolated, and a GPU without public measurements is not calibrated at all. Coefficients a
cluster JSON carries from `autopar calibrate` were fitted to that cluster's own traces: their regime
is the traces', which the calibration report states, so no note is made for them.
"""

from __future__ import annotations

from autopar.cost.coefficients import gpu_calibration
from autopar.cost.estimate import estimate
from autopar.cost.vocabulary import vocabulary_note
from autopar.runtime import megatron_attention

_TRACE_FITTED = ("gemm_efficiency", "gemm_half_flops", "block_host_s")


def regime_note(workload, plan, est=None) -> str:
    """"" when the plan is inside the calibrated regime, else one line saying what is outside; with
    the plan's estimate, also when it predicts a higher MFU than any published on the GPU type (then
    the line says whether the calibration covers the plan)."""
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
    outside += [f"{axis} {getattr(plan, axis)} > {r[axis]}" for axis in ("tp", "pp", "dp")
                if getattr(plan, axis) > r[axis]]
    if cal.derived_from:
        outside.insert(0, f"GPU {cluster.gpu.name}: coefficients scaled from the {cal.derived_from} fit by "
                          "measured matmul ceilings")
    kind = "flash" if attention_fused(workload) else "unfused"
    best_mfu = cal.best_mfu.get(kind)
    if est is not None and best_mfu is not None and est.mfu > best_mfu:
        best = (f"MFU {est.mfu:.1%} above the best published on {cluster.gpu.name} with {kind} attention "
                f"({best_mfu:.1%})")
        if not outside:
            return f"note: {best}; the plan lies inside the calibrated regime of {cal.source}"
        outside.insert(0, best)
    if not outside:
        return ""
    return f"note: outside the calibrated regime ({'; '.join(outside)}) of {cal.source}: the estimate is extrapolated"


def attention_fused(workload) -> bool:
    """Whether the workload's attention runs as a fused (flash) kernel: Megatron-Core's with its
    flash_attn switch (Megatron-LM's unfused one under the megatron_softmax switch), else (torch)
    the model file's own, when it keeps no seq x seq tensor."""
    if megatron_attention(workload):
        return "flash_attn" in workload.switches
    layers = workload.profile.layers
    return all(b.attn_core_bytes == 0 for b in layers) and any(b.attn_flops > 0 for b in layers)


def selective_note(workload, plan, est=None) -> str:
    """Why selective recompute saves little or nothing when the attention is a fused (flash) kernel:
    it keeps no seq x seq tensor for selective recompute to drop ("" otherwise). Whether anything is
    saved is the cost model's answer (under Transformer Engine's fp8 the rerun drops the kernel's own
    saved output), so the line says what the plan's activations (`est`, when the caller has it) are
    against recompute none."""
    if plan.recompute != "selective" or not attention_fused(workload):
        return ""
    none = estimate(workload, plan.with_(recompute="none")).memory["activations"]
    saved = none - (est or estimate(workload, plan)).memory["activations"]
    why = "the attention runs as a fused (flash) kernel, which keeps no seq x seq tensor to drop"
    if saved <= 1e-9 * none:
        return f"note: selective recompute saves no memory here: {why}; it only reruns the attention forward"
    return (f"note: selective recompute saves only {saved / 1e9:.3g} GB of activations here: {why}; it drops "
            "the kernel's own saved output and reruns the attention forward")


def notes(workload, plan, est=None, regime: str | None = None) -> list[str]:
    """The one-line notes `autopar search`, `estimate` and `explain` print under an estimate
    (`regime`: the regime note when the caller has it already)."""
    regime = regime_note(workload, plan, est) if regime is None else regime
    return [n for n in (regime, selective_note(workload, plan, est), vocabulary_note(workload, plan)) if n]


def json_notes(workload, plan, est) -> dict:
    """The notes' fields of `--json`: the regime note on its own (`calibration_note`) and all notes."""
    regime = regime_note(workload, plan, est)
    return {"calibration_note": regime, "notes": notes(workload, plan, est, regime)}
