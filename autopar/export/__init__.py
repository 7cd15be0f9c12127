"""Export a plan to the frameworks users already train with: Megatron-LM, DeepSpeed, torchtitan
and HF accelerate. Each exporter writes what its framework reads (command-line arguments, a JSON
or YAML config) and names, in one line, the plan's knobs that framework cannot express, so a plan
is never silently weakened on the way out."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from autopar.errors import AutoparError
from autopar.plan import Plan

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


def export_plan(plan: Plan, framework: str) -> Export:
    if framework not in FRAMEWORKS:
        raise AutoparError(f"unknown export target '{framework}'; choose one of {list(FRAMEWORKS)}")
    return importlib.import_module(f"autopar.export.{framework}").export(plan)


def grad_elements(plan: Plan) -> int:
    """The plan's gradient bucket in elements of its reduction dtype: how Megatron and DeepSpeed
    size buckets (autopar sizes them in MB, as torch DDP does)."""
    return int(plan.bucket_mb * 2**20) // (4 if plan.grad_comm_dtype == "fp32" else 2)


def default_of(name: str):
    """The Plan field's default: a knob at its default needs no flag in any framework."""
    return Plan.defaults()[name]


__all__ = ["FRAMEWORKS", "Export", "export_plan"]
