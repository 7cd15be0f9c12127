"""One iteration's pipeline schedule, simulated from the cost model's per-micro-batch times.

Every rank is given the slowest rank's times (the cost model's pipeline is paced by it), and runs
its forward and backward passes in the plan's schedule order: GPipe (all forwards, then all
backwards), 1F1B (warm-up forwards, then one forward one backward), or Megatron's interleaved 1F1B
over virtual stages. A pass starts when its rank is free and its input has arrived from the
neighbouring stage; the gaps are the pipeline bubble. The exposed data-parallel reduction, the
optimizer step and every term the cost model adds to the iteration outside the pipeline follow the
last backward.

The segments are the estimate's own time parts (`autopar.cost.model.time_parts`: the core model's
and those of declared axes and knobs), so every part of the breakdown is drawn and a part declared
later is drawn without an edit here."""

from __future__ import annotations

from dataclasses import dataclass

from autopar.capability import ZERO_BUBBLE
from autopar.errors import PlanError

FLOPS = "flops"  # in IN_PASSES: split between the passes as the model's FLOPs are
# The core model's parts that run inside each micro-batch's passes (cost/model.py `_pipeline`), in the
# order drawn within a pass, with the share of each in the forward pass (the rest runs in the backward).
# Any other part (the data-parallel reduction, the optimizer, an axis's or knob's own term such as cp's
# K/V exchange) is added after the pipeline, as the cost model adds it to the iteration.
IN_PASSES = {"recompute": 0.0, "compute": FLOPS, "tp_comm": 0.5, "ep_comm": 0.5, "overhead": FLOPS, "pp_p2p": 0.5}
IDLE = "pp_bubble"  # the part the schedule's gaps are: simulated, not drawn as segments
STEP = "overhead"  # the part that also holds the fixed per-step cost (drawn after the optimizer)
FORWARD, BACKWARD, AFTER = "forward", "backward", "after"  # a segment's phase


@dataclass(frozen=True)
class Segment:
    rank: int
    kind: str  # a time part of the estimate (compute, tp_comm, dp_comm, cp, ...)
    start: float
    duration: float
    micro_batch: int = -1
    phase: str = AFTER  # FORWARD, BACKWARD or AFTER (once the pipeline has drained)


def _order(rank: int, pp: int, m: int, v: int, schedule: str) -> list[tuple[str, int, int]]:
    """(F or B, micro-batch, chunk) in the order rank runs them."""
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // pp) % v
        return (k // (pp * v)) * pp + k % pp, (v - 1 - chunk if backward else chunk)

    if schedule == "gpipe":
        warm = total
    elif v == 1:
        warm = min(pp - rank - 1, m)
    else:
        warm = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    out, f, b = [], 0, 0
    for _ in range(warm):
        out.append(("F", *unit(f, False)))
        f += 1
    while b < total:
        if f < total:
            out.append(("F", *unit(f, False)))
            f += 1
        out.append(("B", *unit(b, True)))
        b += 1
    return out


def simulate(plan, forward: dict[str, float], backward: dict[str, float], after: dict[str, float]) -> list[Segment]:
    """Segments of one iteration. forward / backward: seconds per micro-batch on one rank (all its
    chunks together) of each part in that pass, in drawing order; after: seconds of each part once
    the pipeline has drained, in order."""
    pp, v, m = plan.pp, plan.virtual_stages, plan.num_micro_batches
    schedule = plan.schedule if pp > 1 else "1f1b"
    if schedule in ZERO_BUBBLE:  # their W passes and V placement are not simulated here
        raise PlanError(f"the timeline draws the gpipe, 1f1b and interleaved schedules, not {schedule} (its time and "
                        "memory are in the estimate); plot the plan with schedule 1f1b or interleaved to compare")
    passes = {"F": [(k, s / v) for k, s in forward.items()], "B": [(k, s / v) for k, s in backward.items()]}
    orders = [_order(r, pp, m, v, schedule) for r in range(pp)]
    done: dict[tuple[str, int, int], float] = {}  # (F|B, micro-batch, stage) -> finish time
    free, pos, segments = [0.0] * pp, [0] * pp, []
    last = pp * v - 1
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, mb, chunk = orders[r][pos[r]]
                stage = chunk * pp + r
                dep = ("F", mb, stage - 1) if kind == "F" else (("B", mb, stage + 1) if stage < last else
                                                                  ("F", mb, stage))
                if kind == "F" and stage == 0:
                    ready = 0.0
                elif dep in done:
                    ready = done[dep]
                else:
                    break
                t = max(free[r], ready)
                for name, dur in passes[kind]:
                    if dur > 0:
                        segments.append(Segment(r, name, t, dur, mb, FORWARD if kind == "F" else BACKWARD))
                        t += dur
                done[(kind, mb, stage)] = free[r] = t
                pos[r] += 1
                progressed = True
        if not progressed:  # a schedule order that deadlocks would be a bug here, not in the plan
            raise RuntimeError(f"pipeline schedule simulation stalled for {plan.describe()}")
    end = max(free)
    for r in range(pp):
        t = end
        for name, dur in after.items():
            if dur > 0:
                segments.append(Segment(r, name, t, dur))
                t += dur
    return segments


def split_breakdown(breakdown: dict[str, float], num_micro_batches: int, forward_share: float,
                    step_overhead_s: float) -> tuple[dict[str, float], dict[str, float], dict[str, float]]:
    """(forward, backward, after) seconds per part: the parts of IN_PASSES over the micro-batches,
    split between the passes (FLOPS: by the model's `forward_share`); the fixed per-step overhead and
    every other part but the bubble after the pipeline, in the breakdown's order."""
    forward, backward, after = {}, {}, {}
    for part, seconds in breakdown.items():
        if part == IDLE:
            continue
        if part not in IN_PASSES:
            after[part] = seconds
            continue
        step = min(step_overhead_s, seconds) if part == STEP else 0.0
        per_mb = (seconds - step) / num_micro_batches
        share = forward_share if IN_PASSES[part] == FLOPS else IN_PASSES[part]
        forward[part], backward[part] = per_mb * share, per_mb * (1 - share)
        if step:
            after[part] = step
    return ({p: forward[p] for p in IN_PASSES if p in forward}, {p: backward[p] for p in IN_PASSES if p in backward},
            after)


def from_estimate(plan, est, forward_share: float, step_overhead_s: float) -> list[Segment]:
    """The simulation with the estimate's breakdown: every part of the slowest rank's micro-batches
    over them (compute and the host's launch overhead it did not hide split into forward and
    backward by the model's FLOPs, `forward_share`), the rest after the pipeline drains."""
    return simulate(plan, *split_breakdown(est.breakdown, plan.num_micro_batches, forward_share, step_overhead_s))
