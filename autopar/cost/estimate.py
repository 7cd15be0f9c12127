"""One plan's estimate as a readable object: what the CLI prints and `--json` emits."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.cost.arrays import PlanArrays
from autopar.cost.coefficients import Coefficients
from autopar.cost.model import HIDDEN_PARTS, evaluate, memory_parts, time_parts
from autopar.plan import Plan


@dataclass(frozen=True)
class Estimate:
    iteration_time_s: float
    breakdown: dict[str, float]  # seconds per TIME_PARTS entry; they add up to iteration_time_s
    memory: dict[str, float]  # bytes per MEMORY_PARTS entry on the most loaded GPU
    peak_memory_bytes: float
    gpu_memory_bytes: float
    usable_memory_bytes: float  # the GPU's memory less the workload's headroom
    model_flops: float  # per iteration, recompute not counted
    hw_flops: float  # per iteration, recompute counted
    num_gpus: int
    peak_flops: float  # per GPU, in the plan's precision
    tokens_per_iteration: int
    hidden: dict = None  # seconds of tp / dp communication the runtime's overlaps hid (not in the breakdown)
    runtime: str = "torch"

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.usable_memory_bytes

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.iteration_time_s / self.num_gpus / 1e12

    @property
    def hw_tflops_per_gpu(self) -> float:
        return self.hw_flops / self.iteration_time_s / self.num_gpus / 1e12

    @property
    def mfu(self) -> float:
        return self.tflops_per_gpu * 1e12 / self.peak_flops

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_iteration / self.iteration_time_s

    def to_dict(self) -> dict:
        return {
            "iteration_time_s": self.iteration_time_s,
            "tflops_per_gpu": self.tflops_per_gpu,
            "hw_tflops_per_gpu": self.hw_tflops_per_gpu,
            "mfu": self.mfu,
            "tokens_per_s": self.tokens_per_s,
            "peak_memory_gb": self.peak_memory_bytes / 1e9,
            "gpu_memory_gb": self.gpu_memory_bytes / 1e9,
            "usable_memory_gb": self.usable_memory_bytes / 1e9,
            "fits": self.fits,
            "breakdown": dict(self.breakdown),
            "runtime": self.runtime,
            "hidden": dict(self.hidden or {}),
            "memory_gb": {k: v / 1e9 for k, v in self.memory.items()},
        }


def estimates_from(workload, pa: PlanArrays, result: dict[str, np.ndarray], index) -> list[Estimate]:
    """Estimates for selected rows of an `evaluate` result."""
    gpu = workload.cluster.gpu
    out = []
    for i in np.atleast_1d(index):
        i = int(i)
        plan_precision = pa.plan(i).precision
        out.append(Estimate(
            iteration_time_s=float(result["iteration_time"][i]),
            breakdown={p: float(result[p][i]) for p in time_parts()},
            memory={p: float(result[p][i]) for p in memory_parts()},
            peak_memory_bytes=float(result["peak_memory"][i]),
            gpu_memory_bytes=float(gpu.memory_bytes),
            usable_memory_bytes=float(workload.memory_budget),
            model_flops=float(result["model_flops"][i]),
            hw_flops=float(result["hw_flops"][i]),
            num_gpus=workload.cluster.num_gpus,
            peak_flops=float(gpu.peak_flops[plan_precision]),
            tokens_per_iteration=workload.global_batch * workload.profile.seq_len,
            hidden={p.removeprefix("hidden_"): float(result[p][i]) for p in HIDDEN_PARTS},
            runtime=workload.runtime,
        ))
    return out


def estimate(workload, plan: Plan, coeffs: Coefficients | None = None) -> Estimate:
    """The cost model's estimate for one plan (validated against the workload first)."""
    plan.validate(workload)
    pa = PlanArrays.from_plans([plan], workload.profile)
    return estimates_from(workload, pa, evaluate(workload, pa, coeffs), 0)[0]
