"""The capability registry: who runs a plan (`Target`), what the model's layout allows (`Layout`),
and one `Rule` per knob or axis saying why a value cannot run there.

A rule reads the value of its knob, the earlier knobs it names in `reads` (always among the knob's
dependencies, so the plan space can ask it knob by knob) and the target; a fact the target does not
know (no layout before a model is built, no cluster in the executor) leaves the rules that need it
silent, and whoever knows it asks again. Standard library only: the plan contract imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from autopar.errors import PlanError
from autopar.runtime import is_megatron


@dataclass(frozen=True)
class Layout:
    """The model's layout facts that decide what runs. `limits`: what autopar's torch executor
    cannot lay out for this model, {knob: why} (found once by `autopar/executor/limits.py`, carried
    in the model profile); the rest as the profiler measured them, None where not known (the
    executor builds the model but never sees a batch)."""

    name: str = "the model"
    limits: Mapping[str, str] = field(default_factory=dict)
    moe: bool = False  # routed experts (an MoE model)
    seq_len: int | None = None  # tokens per sample
    attention: bool | None = None  # attention over a sequence (a score count)
    tp_plan: bool = True  # a non-empty tensor-parallel plan
    tp_note: str = ""  # why there is none, in words
    blocks: bool = True  # repeated blocks (an nn.ModuleList) to pipeline, checkpoint and convert to fp8

    @classmethod
    def of(cls, profile) -> Layout:
        """The facts of a model profile."""
        return cls(name=profile.name, limits=dict(getattr(profile, "limits", {})), moe=profile.is_moe,
                   seq_len=profile.seq_len, attention=any(getattr(b, "attn_scores", 0) > 0 for b in profile.blocks),
                   tp_plan=profile.has_tp_plan, tp_note=profile.tp_note)


@dataclass(frozen=True)
class Device:
    """The accelerator the executor runs on (what fp8's tensor cores need)."""

    type: str  # torch device type: "cuda", "cpu", ...
    capability: tuple[int, int] | None = None  # CUDA compute capability
    name: str = ""


@dataclass(frozen=True)
class Target:
    """What a plan would run on. `runtime`: autopar.runtime's name of what runs it (`autopar run`
    always asks for "torch", autopar's executor); `layout`: the model's facts; `cluster`: the
    cluster (its GPU and links; of a mixed cluster, one Target per group: `MixedCluster.target`);
    `backend`: the executor's process-group backend; `device`: the executor's device."""

    runtime: str = "torch"
    layout: Layout | None = None
    cluster: Any = None
    backend: str | None = None
    device: Device | None = None

    @classmethod
    def of(cls, workload) -> Target:
        """A workload's target: its runtime, its model's layout, its cluster."""
        return cls(runtime=workload.runtime, layout=Layout.of(workload.profile), cluster=workload.cluster)

    @property
    def torch(self) -> bool:
        """Whether autopar's torch executor runs the plan (else Megatron-Core, which lays the model out itself)."""
        return not is_megatron(self.runtime)

    @property
    def gloo(self) -> bool | None:
        """Whether gradients are reduced over gloo (CPU processes); None: not known."""
        if self.backend is not None:
            return "nccl" not in self.backend  # "cpu:gloo,cuda:nccl" reduces GPU tensors over NCCL
        if self.cluster is not None:
            return self.cluster.node.intra == "shm"
        return None

    @property
    def backend_name(self) -> str:
        return self.backend or ("gloo" if self.gloo else "nccl")


Why = Callable[[Target, Any, dict], "str | None"]


@dataclass(frozen=True)
class Rule:
    """Why `knob` (a knob or axis name) cannot take a value on a target: `why(target, value,
    decided)` returns the reason with its fix, or None when it runs. `decided` holds the values
    of `reads`."""

    knob: str
    why: Why
    reads: tuple[str, ...] = ()


_RULES: dict[str, Rule] = {}


def declare_rule(rule: Rule) -> Rule:
    """The one capability rule of a knob or axis."""
    if rule.knob in _RULES:
        raise ValueError(f"knob {rule.knob!r} has a capability rule already; extend it")
    _RULES[rule.knob] = rule
    return rule


def undeclare_rule(knob: str) -> None:
    _RULES.pop(knob, None)


def rules() -> dict[str, Rule]:
    return dict(_RULES)


def refusal(knob: str, target: Target, value, decided: Mapping | None = None) -> str | None:
    """Why `knob` cannot take `value` on `target` given the earlier values `decided`, or None."""
    rule = _RULES.get(knob)
    if rule is None:
        return None
    decided = decided or {}
    return rule.why(target, value, {name: decided[name] for name in rule.reads if name in decided})


def allowed(knob: str, target: Target, values, decided: Mapping | None = None) -> list:
    """The values among `values` that run on `target` (a knob's choices ask this)."""
    return [v for v in values if refusal(knob, target, v, decided) is None]


def refusals(plan, target: Target) -> list[str]:
    """Every reason the plan cannot run on `target`, knob by knob (empty: it runs)."""
    values = plan.fields()
    out = []
    for rule in _RULES.values():
        if rule.knob in values:
            why = rule.why(target, values[rule.knob], {name: values[name] for name in rule.reads})
            if why:
                out.append(why)
    return out


def check(plan, target: Target) -> None:
    """Raise PlanError with the first reason the plan cannot run on `target`."""
    reasons = refusals(plan, target)
    if reasons:
        raise PlanError(reasons[0])
