"""Export a plan to the frameworks users already train with: Megatron-LM, DeepSpeed, torchtitan
and HF accelerate. Each exporter writes what its framework reads (command-line arguments, a JSON
or YAML config) and names, in one line, the plan's knobs that framework cannot express, so a plan
is never silently weakened on the way out.

Each exporter declares, in one place, what it does with every knob and axis of the registries
(`autopar.knobs`, `autopar.axes`): `MAPS`, the names its output expresses, and `UNEXPRESSED`, a rule
per name it cannot express (fully, or at some values) returning the line that says so, or None.
`coverage_gaps` names what an exporter does neither with (tests/test_export_registry.py holds every
exporter to none); a knob declared later and not yet handled is still named in the unexpressed line
whenever a plan moves it from its default."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from autopar.errors import AutoparError
from autopar.knobs import knobs, stage_full_blocks
from autopar.plan import Plan

Rule = Callable[[Plan], "str | None"]  # the plan -> "knob=value: why" where the framework cannot express it

FRAMEWORKS = ("megatron", "deepspeed", "torchtitan", "accelerate")  # each in autopar/export/<name>.py


@dataclass(frozen=True)
class Export:
    framework: str
    text: str  # the file to write: arguments, JSON or YAML
    unexpressed: tuple[str, ...]  # "knob=value: why" for each knob the framework cannot express

    def unexpressed_line(self) -> str:
        if not self.unexpressed:
            return f"{self.framework} expresses every knob of this plan"
        return f"{self.framework} cannot express: " + "; ".join(self.unexpressed)


def exporter(framework: str):
    """The module of one export target."""
    if framework not in FRAMEWORKS:
        raise AutoparError(f"unknown export target '{framework}'; choose one of {list(FRAMEWORKS)}")
    return importlib.import_module(f"autopar.export.{framework}")


def export_plan(plan: Plan, framework: str) -> Export:
    out = exporter(framework).export(plan)
    unhandled = tuple(f"{name}={_text(getattr(plan, name))}: the {framework} exporter does not handle it yet"
                      for name in coverage_gaps(framework) if getattr(plan, name) != default_of(name))
    return Export(out.framework, out.text, out.unexpressed + unhandled) if unhandled else out


def plan_knobs() -> tuple[str, ...]:
    """What an exporter must handle: every knob (the axes and folded axes among them, as their degrees)
    and every Plan field no knob holds (the layer split)."""
    names = tuple(k.name for k in knobs())
    held = {f.name for k in knobs() for f in k.fields}
    return names + tuple(f for f in Plan.defaults() if f not in held)


def coverage_gaps(framework: str) -> tuple[str, ...]:
    """The knobs and axes one exporter neither maps (`MAPS`) nor lists (`UNEXPRESSED`)."""
    module = exporter(framework)
    return tuple(n for n in plan_knobs() if n not in module.MAPS and n not in module.UNEXPRESSED)


def listed(rules: dict[str, Rule], plan: Plan) -> list[str]:
    """The lines of the rules that apply to this plan, in declaration order."""
    return [line for rule in rules.values() if (line := rule(plan))]


def _text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def grad_elements(plan: Plan) -> int:
    """The plan's gradient bucket in elements of its reduction dtype: how Megatron and DeepSpeed
    size buckets (autopar sizes them in MB, as torch DDP does)."""
    return int(plan.bucket_mb * 2**20) // (4 if plan.grad_comm_dtype == "fp32" else 2)


def covering_recompute(plan: Plan) -> tuple[str, int]:
    """A per-stage plan's recompute as the one setting a framework gives every stage: ("full", the
    most blocks a stage recomputes fully) if any stage does, else ("selective", 0) if any stage
    recomputes selectively, else ("none", 0). Never saves less memory than a stage asks for."""
    full = max(map(stage_full_blocks, plan.stage_recompute), default=0)
    if full:
        return "full", full
    return ("selective" if "selective" in plan.stage_recompute else "none"), 0


def default_of(name: str):
    """The Plan field's default: a knob at its default needs no flag in any framework."""
    return Plan.defaults()[name]


__all__ = ["FRAMEWORKS", "Export", "coverage_gaps", "export_plan", "plan_knobs"]
