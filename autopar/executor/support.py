"""Which plans autopar's executor can run, and why not the others: it asks `autopar.capability`
(the torch runtime's rules) with what it knows, and nothing else decides.

`apply` asks twice before any process group exists: with its backend and the model's layout as it
builds it on the meta device (`facts.model_layout`), then with the device it got. `autopar run` asks with
the backend before launching and `preflight` with the layout, so every rank's refusal is refused
once, in one line, before torchrun starts. The plan space asks the same rules (knob by knob), so no
planner proposes a plan that cannot run; every plan the space holds is run on 4 gloo ranks by
tests/test_executor_plans.py. Standard library only (the trace collector imports it).
"""

from __future__ import annotations

from autopar.capability import Device, Layout, Target, check, refusals
from autopar.plan import Plan


def has_nccl(backend: str) -> bool:
    """Whether a process-group backend string reaches GPUs through NCCL ("nccl", "cpu:gloo,cuda:nccl")."""
    return "nccl" in backend


def target(backend: str | None = None, layout: Layout | None = None, device: Device | None = None) -> Target:
    """The executor as a capability target: the torch runtime, with what is known of the run."""
    return Target(runtime="torch", layout=layout, backend=backend, device=device)


def refusal(plan: Plan, backend: str, layout: Layout | None = None, device: Device | None = None) -> str | None:
    """Why the executor cannot run `plan` on `backend` ("nccl", "gloo", ...), or None when it can
    (as far as the layout and device, when given, tell)."""
    reasons = refusals(plan, target(backend, layout, device))
    return reasons[0] if reasons else None


def check_supported(plan: Plan, backend: str | None, layout: Layout | None = None, device: Device | None = None) -> None:
    """Raise PlanError with the reason when the executor cannot run `plan`."""
    check(plan, target(backend, layout, device))
