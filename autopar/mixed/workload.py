"""The mixed twin of `autopar.workload.Workload`: one job over a cluster of several GPU groups.

A mixed plan is priced by pricing homogeneous plans on each group's hardware (docs/hardware.md,
"Mixed clusters"), so the one thing this type adds is `on_group`: the homogeneous workload a lane
or a segment of a lane is priced on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from autopar.errors import AutoparError, PlanError
from autopar.knobs import fp8_problem
from autopar.runtime import resolve_runtime
from autopar.workload import DEFAULT_MEMORY_HEADROOM, JobFigures, Workload

if TYPE_CHECKING:
    from autopar.cluster.mixed import MixedCluster
    from autopar.profile.model_profile import ModelProfile


@dataclass(frozen=True)
class MixedWorkload(JobFigures):
    """What is trained (profile), on which groups (a MixedCluster), with which global batch; the
    other fields mean what they mean on a Workload and hold for every group."""

    profile: ModelProfile
    cluster: MixedCluster
    global_batch: int
    optimizer: str = "adam"
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM
    runtime: str = "torch"
    switches: tuple[str, ...] = ()
    expert_imbalance: float = 1.0
    fp8: bool = False

    def __post_init__(self):
        runtime, switches = resolve_runtime(self.runtime, self.switches)
        object.__setattr__(self, "runtime", runtime)
        object.__setattr__(self, "switches", switches)
        if isinstance(self.global_batch, bool) or not isinstance(self.global_batch, int) or self.global_batch < 1:
            raise AutoparError(f"global batch must be a positive integer, got {self.global_batch!r}")
        if self.fp8:  # every group runs the one precision: name the group that cannot
            for name, group in zip(self.cluster.group_names, self.cluster.groups):
                problem = fp8_problem("fp8", group.gpu)
                if problem:
                    raise AutoparError(f"group {name}: {problem}")

    @property
    def group_names(self) -> tuple[str, ...]:
        return self.cluster.group_names

    def on_group(self, group: str, gpus: int, global_batch: int) -> Workload:
        """The homogeneous workload a part of a mixed plan is priced on: `group`'s hardware (its GPU,
        node layout, links and coefficients) sized to `gpus` GPUs -- whole nodes where `gpus` is at
        least a node, else one node of `gpus` -- training `global_batch` samples per step."""
        cluster = self.cluster.group(group)
        per_node = cluster.gpus_per_node
        if gpus < 1 or (gpus > per_node and gpus % per_node):
            raise PlanError(f"{gpus} GPUs of group {group} are not whole nodes of {per_node}; use a multiple "
                            f"of {per_node} or at most {per_node}")
        sized = cluster.with_nodes(gpus // per_node) if gpus >= per_node else cluster.with_nodes(1, gpus)
        return self._workload(sized, global_batch)

    def spanning(self, group: str, gpus: int, global_batch: int) -> Workload:
        """`group`'s hardware at `gpus` GPUs rounded up to whole nodes: where a segment of a lane
        is priced (the lane's plan, all its stages, laid out as if on that group alone)."""
        cluster = self.cluster.group(group)
        per_node = cluster.gpus_per_node
        if gpus <= per_node:
            return self.on_group(group, gpus, global_batch)
        return self._workload(cluster.with_nodes(math.ceil(gpus / per_node)), global_batch)

    def _workload(self, cluster, global_batch: int) -> Workload:
        return Workload(self.profile, cluster, global_batch, optimizer=self.optimizer,
                        memory_headroom=self.memory_headroom, runtime=self.runtime, switches=self.switches,
                        expert_imbalance=self.expert_imbalance, fp8=self.fp8)

    def describe(self) -> str:
        runtime = "" if self.runtime == "torch" else f", runtime {self.runtime}"
        return (f"{self.profile.name} on {self.cluster.name} ({self.cluster.num_gpus} GPUs), global batch "
                f"{self.global_batch}, seq {self.profile.seq_len}{runtime}")
