"""One iteration's pipeline schedule, simulated from the cost model's per-micro-batch times.

Every rank is given the slowest rank's times (the cost model's pipeline is paced by it), and runs
its forward and backward passes in the plan's schedule order: GPipe (all forwards, then all
backwards), 1F1B (warm-up forwards, then one forward one backward), or Megatron's interleaved 1F1B
over virtual stages. A pass starts when its rank is free and its input has arrived from the
neighbouring stage; the gaps are the pipeline bubble. The exposed data-parallel reduction and the
optimizer step follow the last backward."""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("forward", "backward", "recompute", "comm", "dp_comm", "optimizer")


@dataclass(frozen=True)
class Segment:
    rank: int
    kind: str  # one of KINDS
    start: float
    duration: float
    micro_batch: int = -1


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


def simulate(plan, forward: float, backward: float, recompute: float, comm: float,
             dp_comm: float, optimizer: float) -> list[Segment]:
    """Segments of one iteration. forward/backward/recompute/comm: seconds per micro-batch on one
    rank (all its chunks together); dp_comm, optimizer: seconds after the pipeline drains."""
    pp, v, m = plan.pp, plan.virtual_stages, plan.num_micro_batches
    schedule = plan.schedule if pp > 1 else "1f1b"
    f_t, b_t, r_t, c_t = forward / v, backward / v, recompute / v, comm / v
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
                parts = [("forward", f_t), ("comm", c_t / 2)] if kind == "F" else \
                    [("recompute", r_t), ("backward", b_t), ("comm", c_t / 2)]
                for name, dur in parts:
                    if dur > 0:
                        segments.append(Segment(r, name, t, dur, mb))
                        t += dur
                done[(kind, mb, stage)] = free[r] = t
                pos[r] += 1
                progressed = True
        if not progressed:  # a schedule order that deadlocks would be a bug here, not in the plan
            raise RuntimeError(f"pipeline schedule simulation stalled for {plan.describe()}")
    end = max(free)
    for r in range(pp):
        t = end
        for name, dur in (("dp_comm", dp_comm), ("optimizer", optimizer)):
            if dur > 0:
                segments.append(Segment(r, name, t, dur))
                t += dur
    return segments


def from_estimate(plan, est, forward_share: float, step_overhead_s: float) -> list[Segment]:
    """The simulation with the estimate's breakdown: the slowest rank's compute (with the host's
    launch overhead it did not hide) over the micro-batches, split into forward and backward by the
    model's FLOPs (`forward_share`); the fixed per-step overhead is drawn with the optimizer."""
    m, bd = plan.num_micro_batches, est.breakdown
    compute = (bd["compute"] + bd["overhead"] - step_overhead_s) / m
    return simulate(plan, forward=compute * forward_share, backward=compute * (1 - forward_share),
                    recompute=bd["recompute"] / m, comm=(bd["tp_comm"] + bd["ep_comm"] + bd["pp_p2p"]) / m,
                    dp_comm=bd["dp_comm"], optimizer=bd["optimizer"] + step_overhead_s)
