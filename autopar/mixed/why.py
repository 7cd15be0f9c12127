"""The Why table of a mixed plan: a row per lane segment (and per idle group) with its group, GPUs,
layout, batch share, time per micro-batch and memory, and a sentence saying why it got what it got,
from the figures of `autopar.mixed.cost` (no other pricing):

- a lane's share: the lanes run side by side and the step ends with the slowest, so a lane's share of
  the batch should match its share of the lanes' speed (samples/s); the sentence gives both and how
  early the lane's step ends;
- a segment of a lane spanning groups: its blocks per stage against its GPUs' peak, its time per
  micro-batch against the lane's slowest segment (the pipeline's pace), and what its sends across a
  group boundary cost on the inter-group link;
- an idle group: what a lane there would add to the step in cross-lane gradient all-reduce alone (and,
  where the caller knows it, what the group trains alone).
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from autopar.mixed.cost import LaneEstimate, MixedEstimate, cross_sync, sync_probe


@dataclass(frozen=True)
class WhyRow:
    lane: str  # "1", "2", ... or "-" for an idle group
    group: str
    gpus: int
    layout: str  # tp x stages
    blocks: str
    share: str  # samples per step of the lane
    per_mb_ms: str  # the segment's slowest rank, forward + backward of one micro-batch
    memory: str  # peak / usable GB
    why: str


def _ms(seconds: float) -> str:
    """Milliseconds to 0.1, or to two significant digits below 1 (a tiny model's all-reduce is 0.028, not 0.0)."""
    ms = seconds * 1e3
    return f"{ms:,.1f}" if ms >= 1 or ms == 0 else f"{ms:.2g}"


def _layout(s) -> str:
    return f"tp{s.tp} x{s.stages}"


def _share_reason(mw, est: MixedEstimate, lane: LaneEstimate) -> str:
    batch = mw.global_batch
    if len(est.lanes) == 1:
        return f"the only lane: all {batch} samples, {lane.iteration_time_s * 1e3:,.1f} ms per step"
    speed = lane.samples_per_s / sum(other.samples_per_s for other in est.lanes)
    slowest = max(other.iteration_time_s for other in est.lanes)
    end = ("it is the slowest lane: the step ends with it" if lane.iteration_time_s == slowest else
           f"its step ends {1 - lane.iteration_time_s / slowest:.1%} before the slowest lane's")
    return (f"share {lane.share}/{batch} ({lane.share / batch:.0%}) against {speed:.0%} of the lanes' speed "
            f"({lane.samples_per_s:,.1f} samples/s): {end}")


def _segment_reason(mw, lane: LaneEstimate, i: int) -> str:
    s = lane.segments[i]
    gpu = mw.cluster.group(s.group).gpu
    slowest = max(other.per_mb_s for other in lane.segments)
    pace = ("the pipeline's slowest" if s.per_mb_s == slowest else
            f"{1 - s.per_mb_s / slowest:.0%} under the slowest segment's {_ms(slowest)} ms")
    text = (f"{s.blocks} blocks over {s.stages} {'stages' if s.stages > 1 else 'stage'} ({s.blocks / s.stages:.3g} "
            f"per stage) on {gpu.name} "
            f"({s.peak_flops / 1e12:,.0f} TFLOP/s peak): {_ms(s.per_mb_s)} ms per micro-batch, {pace}")
    if s.send_s > 0:
        text += f"; {_ms(s.send_s)} ms of it is the slower send across the group boundary"
    return text


def _idle_reason(mw, est: MixedEstimate, group: str, alone: dict | None) -> str:
    n = mw.cluster.group(group).num_gpus
    probe = sync_probe(mw, group, est.lanes[0].lane.plan.grad_comm_dtype)  # the lanes' gradient width
    lanes = [lane.lane for lane in est.lanes] + [probe]
    extra = cross_sync(mw, lanes) - est.cross_sync_s  # what one more lane adds to the all-reduce the plan has
    link = mw.cluster.link
    text = (f"idle: a lane on its {n} GPUs would add {_ms(extra)} ms of cross-lane gradient all-reduce per step "
            f"({extra / est.iteration_time_s:.0%} of this step) over the {link.bandwidth / 1e9:.3g} GB/s "
            f"{link.kind} link")
    if alone and alone.get(group):
        text += f"; alone it trains {alone[group]:,.0f} tokens/s against this plan's {est.tokens_per_s:,.0f}"
    return text


def why_rows(mw, est: MixedEstimate, alone: dict[str, float] | None = None) -> list[WhyRow]:
    """The rows, lane by lane, then the idle groups. `alone`: tokens/s of each group alone, where known
    (the mixed search's best single-group plans)."""
    rows = []
    for li, lane in enumerate(est.lanes, 1):
        share_text = _share_reason(mw, est, lane)
        for si, s in enumerate(lane.segments):
            why = share_text if si == 0 else ""
            if lane.lane.spans:
                why = (why + "; " if why else "") + _segment_reason(mw, lane, si)
            rows.append(WhyRow(str(li), s.group, s.gpus, _layout(s), str(s.blocks),
                               str(lane.share) if si == 0 else "", _ms(s.per_mb_s),
                               f"{s.peak_memory_bytes / 1e9:.1f}/{s.usable_memory_bytes / 1e9:.1f}"
                               + ("" if s.fits else " DOES NOT FIT"), why))
    for group in est.idle:
        rows.append(WhyRow("-", group, mw.cluster.group(group).num_gpus, "-", "-", "0", "-", "-",
                           _idle_reason(mw, est, group, alone)))
    return rows


def summary(est: MixedEstimate) -> str:
    """The estimate in one line."""
    fits = "fits" if est.fits else "DOES NOT FIT"
    return (f"iteration {_ms(est.iteration_time_s)} ms (slowest lane {_ms(est.iteration_time_s - est.cross_sync_s)} "
            f"+ cross-lane all-reduce {_ms(est.cross_sync_s)}); {est.tokens_per_s:,.0f} tokens/s; MFU {est.mfu:.1%} "
            f"of {est.num_gpus} GPUs' peak; memory {fits}")


def why_table(mw, est: MixedEstimate, alone: dict[str, float] | None = None) -> tuple[Table, list[str]]:
    """The table (a row per segment and idle group) and its "why" sentences, one line each, named by lane
    and group: printed below the table, where a narrow terminal does not wrap them to a word a line."""
    t = Table(title="Why (mixed plan)", title_justify="left")
    for col in ("lane", "group", "GPUs", "layout", "blocks", "share", "ms/mb", "memory GB"):
        t.add_column(col, justify="left" if col in ("lane", "group", "layout") else "right")
    lines = []
    for r in why_rows(mw, est, alone):
        t.add_row(r.lane, r.group, str(r.gpus), r.layout, r.blocks, r.share, r.per_mb_ms, r.memory)
        if r.why:
            lines.append(f"{'lane ' + r.lane if r.lane != '-' else 'idle'} {r.group}: {r.why}")
    return t, lines
