"""What autopar's torch executor runs of a mixed plan (issue 42): the knob rules of every lane (each
segment at its own tp), and the rules of lanes and segments, declared once here. `autopar run`
asks them before launching, the executor again on every rank (`autopar.executor.mixed`). A mixed
plan is duck-typed (`autopar.mixed.plan`: lanes of segments over a Plan): the plan contract imports
this package, so this module imports no plan. Standard library only.

The executor runs (autopar/executor/mixed.py says how): data-parallel lanes of one layout (every lane
one segment, the same plan but for dp and micro-batching), or one lane whose pipeline spans segments
(dp 1, no cp, ep, ZeRO or sequence parallelism, fp32 or bf16).
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.capability.core import Target, refusals
from autopar.errors import PlanError

SPANNING_SCHEDULES = ("1f1b", "gpipe")  # what a pipeline across groups runs (the cost model prices these)
LAYOUT_FREE = ("dp", "micro_batch_size", "num_micro_batches")  # what lanes of one layout may differ in
SPANNING_PRECISIONS = ("fp32", "bf16")  # fp16's loss scaler and fp8's conversion are not wired across segments

def lane_problem(lane) -> str | None:
    """What makes a lane no plan at all: its plan's pp and tp are its segments' (pp the sum of their stages,
    tp the first one's), and a pipeline across groups runs only the schedules priced for it."""
    stages = sum(s.stages for s in lane.segments)
    if lane.plan.pp != stages:
        return (f"the lane's plan has pp={lane.plan.pp} but its segments hold {stages} stages; "
                f"set pp to the sum of the segments' stages")
    if lane.plan.tp != lane.segments[0].tp:
        return (f"the lane's plan has tp={lane.plan.tp} but its first segment tp={lane.segments[0].tp}; "
                f"the plan's tp is its first segment's")
    if len(lane.segments) > 1 and (lane.plan.schedule not in SPANNING_SCHEDULES or lane.plan.virtual_stages > 1):
        return (f"schedule {lane.plan.schedule} (virtual_stages {lane.plan.virtual_stages}) on a lane spanning "
                f"{len(lane.segments)} segments; a pipeline across groups runs {' or '.join(SPANNING_SCHEDULES)} "
                f"with virtual_stages 1")
    return None


def segment_tp_problem(segment, gpus_per_node: int) -> str | None:
    """A segment's tensor-parallel group stays within one node of its group."""
    if segment.tp > gpus_per_node or gpus_per_node % segment.tp:
        return (f"tp={segment.tp} on group {segment.group} of {gpus_per_node} GPUs per node; use a tp dividing "
                f"{gpus_per_node}")
    return None


def one_precision_problem(precisions: list[str], asked: str | None) -> str | None:
    """A mixed plan trains in one precision, the one the command names if it names one."""
    if len(precisions) > 1 or asked not in (None, precisions[0]):
        return (f"the mixed plan's lanes train in {', '.join(precisions)}"
                + (f" but --precision is {asked}" if asked else "") + "; every lane and the command must use one "
                "precision")
    return None


MixedWhy = Callable[[Target, object], "str | None"]


def _layout(plan) -> dict:
    """The fields lanes of one layout share; the mesh order without dp (the executor puts dp outermost)."""
    out = {k: v for k, v in plan.fields().items() if k not in LAYOUT_FREE}
    out["mesh_order"] = tuple(a for a in out["mesh_order"] if a != "dp")
    return out


def _spanning(mixed_plan) -> list[int]:
    return [i for i, lane in enumerate(mixed_plan.lanes) if len(lane.segments) > 1]


def _one_kind(target: Target, mixed_plan) -> str | None:
    """Either data-parallel lanes (one segment each) or one lane spanning segments, alone."""
    spanning = _spanning(mixed_plan)
    if spanning and len(mixed_plan.lanes) > 1:
        return (f"lane {spanning[0] + 1} spans {len(mixed_plan.lanes[spanning[0]].segments)} segments beside "
                f"{len(mixed_plan.lanes) - 1} other lane(s): the executor runs a lane spanning groups only alone "
                f"(its stages' gradients cannot be averaged with lanes of other layouts); use one spanning lane, or "
                f"lanes of one segment each")
    return None


def _one_layout(target: Target, mixed_plan) -> str | None:
    """Data-parallel lanes average their gradients parameter by parameter: the same sharding everywhere."""
    if _spanning(mixed_plan):
        return None
    first = mixed_plan.lanes[0].plan
    for i, lane in enumerate(mixed_plan.lanes[1:], 2):
        mine, theirs = _layout(first), _layout(lane.plan)
        differ = [k for k in mine if mine[k] != theirs[k]]
        if differ:
            k = differ[0]
            return (f"lanes of different layouts: lane 1 has {k}={mine[k]!r}, lane {i} {k}={theirs[k]!r}; the "
                    f"executor averages data-parallel lanes' gradients parameter by parameter, so lanes may differ "
                    f"only in {', '.join(LAYOUT_FREE)}")
    return None


def _sharded_micro_batches(target: Target, mixed_plan) -> str | None:
    """FSDP2 reduce-scatters after every micro-batch's backward: every rank must run as many."""
    if _spanning(mixed_plan):
        return None
    counts = {lane.plan.num_micro_batches for lane in mixed_plan.lanes}
    if mixed_plan.lanes[0].plan.zero >= 2 and len(counts) > 1:
        return (f"ZeRO-{mixed_plan.lanes[0].plan.zero} with lanes of {' and '.join(map(str, sorted(counts)))} "
                f"micro-batches: FSDP2 reduce-scatters after each micro-batch on every rank; give the lanes one "
                f"num_micro_batches (shares by micro_batch_size or dp) or use zero 0 or 1")
    return None


def _spanning_lane(target: Target, mixed_plan) -> str | None:
    """A lane across segments runs its own schedule over P2P boundaries: one replica, plain stages."""
    for i in _spanning(mixed_plan):
        plan = mixed_plan.lanes[i].plan
        unsupported = [(plan.dp != 1, f"dp={plan.dp}", "dp 1 (replicas of a spanning pipeline are not reduced yet)"),
                       (plan.cp != 1, f"cp={plan.cp}", "cp 1"), (plan.ep != 1, f"ep={plan.ep}", "ep 1"),
                       (plan.zero != 0, f"zero={plan.zero}", "zero 0 (ZeRO shards over dp, and the lane runs dp 1)"),
                       (plan.sequence_parallel, "sequence parallelism",
                        "sequence_parallel false (the stream crosses a boundary whole)"),
                       (plan.precision not in SPANNING_PRECISIONS, f"precision {plan.precision}",
                        f"precision {' or '.join(SPANNING_PRECISIONS)}")]
        for bad, what, fix in unsupported:
            if bad:
                return f"lane {i + 1} spans segments with {what}: the executor runs such a lane with {fix}"
    return None


MIXED_RULES: tuple[MixedWhy, ...] = (_one_kind, _one_layout, _sharded_micro_batches, _spanning_lane)


def mixed_refusals(mixed_plan, target: Target) -> list[str]:
    """Every reason the executor cannot run the mixed plan on `target`: the rules of lanes and segments,
    then each lane's knob rules (a spanning lane's at each segment's tp)."""
    out = [why for rule in MIXED_RULES if (why := rule(target, mixed_plan))]
    for i, lane in enumerate(mixed_plan.lanes, 1):
        for seg in lane.segments:
            plan = lane.plan if seg.tp == lane.plan.tp else lane.plan.with_(tp=seg.tp)
            where = f"lane {i}" if len(lane.segments) == 1 else f"lane {i}, segment on {seg.group}"
            out += [f"{where}: {why}" for why in refusals(plan, target)]
    return out


def check_mixed(mixed_plan, target: Target) -> None:
    """Raise PlanError with the first reason the executor cannot run the mixed plan."""
    reasons = mixed_refusals(mixed_plan, target)
    if reasons:
        raise PlanError(reasons[0])
