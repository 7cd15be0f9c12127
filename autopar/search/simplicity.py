"""Which of several equally fast plans a planner returns: the simplest.

Plans whose predicted times lie within TIE of the fastest are ties for the cost model, which is
not that accurate; among them every planner prefers the plan with the fewest knobs away from
their defaults (the Plan's field defaults; no tensor or pipeline parallelism), then, knob by knob
in the Plan's field order, the value closest to the default: DDP before ZeRO-1 before ZeRO-3, no
offload, no recompute before selective before full. Less machinery is less to go wrong in a run.
"""

from __future__ import annotations

import math

import numpy as np

from autopar.errors import PlanError
from autopar.plan import REQUIRED, Plan, plan_fields
from autopar.search.space import holds

TIE = 5e-3  # plans within 0.5% are equally fast for the cost model
IMPLIED_DEFAULTS = {"tp": 1, "pp": 1}  # no model parallelism: the plain data-parallel plan


def defaults() -> dict:
    """Every field but those a plan must give (dp, micro-batching), at its default, in field order."""
    return {name: IMPLIED_DEFAULTS.get(name, default) for name, default in Plan.defaults().items()
            if name in IMPLIED_DEFAULTS or name not in REQUIRED}


def _choices(name: str) -> tuple | None:
    return next((f.values for f in plan_fields() if f.name == name and f.values and isinstance(f.values[0], str)),
                None)


def _distance(name: str, value, default) -> float:
    if value == default:
        return 0.0
    if isinstance(value, bool):
        return 1.0
    if isinstance(value, (int, float)):
        return abs(math.log2(value / default)) if default else float(value)
    values = _choices(name)
    return 1.0 + values.index(value) if values else 1.0


def simplicity_key(plan: Plan) -> tuple:
    """Smaller is simpler: (knobs away from their default, each knob's distance in field order)."""
    distances = tuple(_distance(name, getattr(plan, name), default) for name, default in defaults().items())
    return (sum(d > 0 for d in distances), distances)


def tie_buckets(times) -> np.ndarray:
    """Plans in the same bucket are within TIE of each other (bucket 0: within TIE of the best)."""
    times = np.asarray(times, dtype=float)
    return np.floor(np.log(times / times.min()) / np.log1p(TIE)).astype(np.int64)


def bucket_end(best: float, time: float) -> float:
    """The time where `time`'s tie bucket ends (`tie_buckets` with `best` the fastest), a hair beyond it: a
    plan that rounds into the bucket at its edge is before it."""
    bucket = np.floor(np.log(time / best) / np.log1p(TIE))
    return float(best * (1 + TIE) ** (bucket + 1)) * (1 + 1e-9)


def simplest_first(plans: list[Plan], times) -> list[int]:
    """Indices of `plans`, fastest tie bucket first, the simplest plan first within a bucket."""
    buckets = tie_buckets(times)
    return sorted(range(len(plans)), key=lambda i: (buckets[i], simplicity_key(plans[i]), float(times[i])))


def simpler_variants(workload, plan: Plan) -> list[Plan]:
    """Valid plans with one of `plan`'s knobs, or all of them, back at the default (degrees and
    micro-batching kept): a sampler that found `plan` may never have tried these, and among ties
    one of them is the answer."""

    off = {name: default for name, default in defaults().items()
           if name not in IMPLIED_DEFAULTS and name != "precision" and getattr(plan, name) != default}
    out = []
    for change in [{name: default} for name, default in off.items()] + ([off] if len(off) > 1 else []):
        change = dict(change)
        if change.get("zero", 3) < 2:
            change["offload_optimizer"] = False  # offload needs ZeRO 2 or 3
        if change.get("recompute") == "none":
            change["recompute_blocks"] = 0
        if "schedule" in change or "virtual_stages" in change:
            change.update(schedule=defaults()["schedule"], virtual_stages=1, layer_split=())
        try:
            variant = plan.with_(**change)
            variant.validate(workload)
        except PlanError:
            continue
        if variant != plan and variant not in out and holds(workload, variant):  # not a held knob
            out.append(variant)
    return out

