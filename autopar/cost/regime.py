"""Whether an estimate lies inside the regime its coefficients were fitted in, as one line.

A GPU type's coefficients (autopar/cost/coefficients.py `GPU_CALIBRATION`) were fitted to published
rows covering some precisions, recompute modes, runtimes and parallel degrees; a plan beyond them is
extrapolated, and a GPU without public measurements is not calibrated at all. Coefficients a
cluster JSON carries from `autopar calibrate` were fitted to that cluster's own traces, whose regime
the calibration report states but the cluster JSON does not record: no regime note is made for
them, but a predicted MFU above the best published for that GPU, runtime and precision
(autopar/cost/published_mfu.py) is flagged whatever calibration the cluster carries. A CPU
cluster's figures are nominal until `autopar profile-cluster` has measured this machine
(autopar/cluster/measured.py): every estimate on it says so.
"""

from __future__ import annotations

from autopar.cluster.measured import is_cpu, measured_here
from autopar.cost.coefficients import gpu_calibration
from autopar.cost.estimate import estimate
from autopar.cost.published_mfu import best_published
from autopar.cost.vocabulary import vocabulary_note
from autopar.cost import torch_runtime
from autopar.runtime import megatron_attention

_TRACE_FITTED = ("gemm_efficiency", "gemm_half_flops", "block_host_s")
CPU_ROUGH_NOTE = ("note: rough estimate: the cpu preset's figures are nominal (50 GFLOP/s, 5 GB/s per process), "
                  "not this machine's, and can be many-fold off (the tiny GPT in bf16 ran 70x slower) until "
                  "`autopar profile-cluster` has measured this machine's matmul and all-reduce (cached; "
                  "--cluster cpu then uses them)")


def regime_note(workload, plan, est=None) -> str:
    """"" when the plan is inside the calibrated regime, else one line saying what is outside; with
    the plan's estimate, also when it predicts a higher MFU than any published on the GPU type for
    that runtime and precision (then the line says whether the calibration covers the plan). On a
    CPU cluster: the rough-estimate line unless the cluster carries this machine's measurement."""
    cluster = workload.cluster
    if is_cpu(cluster):
        return "" if measured_here(cluster) else CPU_ROUGH_NOTE
    best, published = _above_published(workload, plan, est)
    if any(k in cluster.coefficients for k in _TRACE_FITTED):
        return (f"note: {best}; the cluster's calibration (fitted to its own traces) does not record that it "
                f"covered such a plan{published}") if best else ""
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
        torch_fit = torch_runtime.fitted(cluster.gpu.name) if workload.runtime == "torch" else {}
        outside.append(f"runtime {workload.runtime}" + (f", its {', '.join(torch_fit)} fitted to torch-native rows"
                                                        if torch_fit else ""))
    outside += [f"{axis} {getattr(plan, axis)} > {r[axis]}" for axis in ("tp", "pp", "dp")
                if getattr(plan, axis) > r[axis]]
    if cal.derived_from:
        outside.insert(0, f"GPU {cluster.gpu.name}: coefficients scaled from the {cal.derived_from} fit by "
                          "measured matmul ceilings")
    if best:
        if not outside:
            return f"note: {best}; the plan lies inside the calibrated regime of {cal.source}{published}"
        outside.insert(0, best)
    if not outside:
        return ""
    return (f"note: outside the calibrated regime ({'; '.join(outside)}) of {cal.source}: the estimate is "
            f"extrapolated{published}")


def _above_published(workload, plan, est) -> tuple[str, str]:
    """("MFU x above the best published ... (y)", "; best published: its runtime, precision, source")
    when the estimate beats the best published MFU for its GPU, runtime, precision and attention
    kernel; ("", "") otherwise or without an estimate."""
    if est is None:
        return "", ""
    gpu = workload.cluster.gpu.name
    kind = "flash" if attention_fused(workload) else "unfused"
    row = best_published(gpu, workload.runtime, plan.precision, kind)
    if row is None or est.mfu <= row.mfu:
        return "", ""
    return (f"MFU {est.mfu:.1%} above the best published on {gpu} with {kind} attention ({row.mfu:.1%})",
            f"; best published: {row.runtime}, {'/'.join(row.precisions)}, {row.source}")


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
    if plan.recompute != "selective" or not attention_fused(workload) or "op_sac" in workload.switches:
        return ""  # torchtitan's per-op checkpoint reruns matmuls, not the attention (cost/op_sac.py)
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
