"""A workload: what is trained (model profile), where (cluster), and with which batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autopar.errors import AutoparError
from autopar.knobs import fp8_problem
from autopar.runtime import resolve_runtime

if TYPE_CHECKING:
    from autopar.cluster import Cluster
    from autopar.profile.model_profile import ModelProfile


# Fraction of each GPU's memory a plan leaves free: PyTorch's caching allocator rounds and
# fragments blocks, so a plan that fills 77 of 79 GiB on paper runs out of memory in practice.
DEFAULT_MEMORY_HEADROOM = 0.10


class JobFigures:
    """What a workload, homogeneous or mixed, says of its job alone: GPUs, precision, tokens a step."""

    @property
    def world_size(self) -> int:
        return self.cluster.num_gpus

    @property
    def precision(self) -> str:
        return "fp8" if self.fp8 else self.profile.dtype

    @property
    def tokens_per_batch(self) -> int:
        return self.global_batch * self.profile.seq_len


@dataclass(frozen=True)
class Workload(JobFigures):
    profile: ModelProfile
    cluster: Cluster
    global_batch: int
    optimizer: str = "adam"  # adam keeps two fp32 moments per parameter
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM
    runtime: str = "torch"  # what runs the plan (autopar.runtime.RUNTIMES; a named Megatron one is stored as
    # megatron and its switches): it schedules the overlaps
    switches: tuple[str, ...] = ()  # Megatron-Core switches on (autopar.runtime.MEGATRON_SWITCHES)
    # mixture of experts: tokens on the busiest expert-parallel rank over the mean (1.0: force-balanced,
    # as published MoE benchmarks run); ignored for a dense model
    expert_imbalance: float = 1.0
    fp8: bool = False  # GEMMs in fp8 on top of the profile's bf16 (precision "fp8")
    # knobs held at one value ((knob name, value) pairs, `search --fix`): the plan space offers only
    # that value (autopar/search/space.py), so every planner and the RL masks see it
    fixed: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self):
        runtime, switches = resolve_runtime(self.runtime, self.switches)  # megatron-core: megatron + its switches
        object.__setattr__(self, "runtime", runtime)
        object.__setattr__(self, "switches", switches)
        if not 1.0 <= self.expert_imbalance <= 1e3:
            raise AutoparError(f"expert_imbalance {self.expert_imbalance} must be at least 1.0 (1.0: force-balanced)")
        if self.fp8:
            if self.profile.dtype != "bf16":
                raise AutoparError(f"fp8 training keeps bf16 weights and activations; the model was profiled in "
                                   f"{self.profile.dtype}: profile it in bf16")
            problem = fp8_problem("fp8", self.cluster.gpu)
            if problem:
                raise AutoparError(problem)

    @property
    def memory_budget(self) -> float:
        """Bytes a plan may use per GPU: the GPU's memory less the headroom."""
        return self.cluster.gpu.memory_bytes * (1 - self.memory_headroom)

    def describe(self) -> str:
        runtime = "" if self.runtime == "torch" else f", runtime {self.runtime}" + "".join(
            f" +{o}" for o in self.switches)
        return (f"{self.profile.name} on {self.cluster.describe()}, global batch {self.global_batch}, "
                f"seq {self.profile.seq_len}{runtime}")
