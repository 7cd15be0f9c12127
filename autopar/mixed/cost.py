"""The cost of a mixed plan, composed of the homogeneous cost model (no second one).

- A lane on one group is its homogeneous plan on that group's part (`MixedWorkload.on_group`): priced
  by `autopar.cost.estimate`'s own path, to the last bit.
- A lane spanning groups (1F1B or GPipe, one stage per rank): each segment evaluates the lane's plan,
  at the segment's tp, on its group's hardware (`evaluate(..., ranks=True)` over every pipeline rank,
  `SplitTable.per_rank`), and keeps the figures of the ranks it holds: per micro-batch time, data-parallel
  tail (exposed gradient collectives and optimizer step), peak memory against ITS group's budget. They
  combine as `cost/model.py`'s objective does: sum of the micro-batch times + (m - 1) x the slowest, + the
  largest tail + the constants (the largest of the segments'). A send across a group boundary (forward
  from the segment's last rank, backward from the next one's first) is priced on the cluster's `link`
  instead of the group's own pipeline link: the difference is added to those ranks' micro-batch time.
- Across lanes: the step is the slowest lane + the cross-lane gradient all-reduce (`cross_sync`).

What is approximate, and says so: a spanning lane's tied-embedding all-reduce between its ends stays
priced on the first segment's hardware; a boundary send's extra time is not hidden under the host's
launches (a slight over-estimate where the host paces a rank). docs/hardware.md, "Mixed clusters".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.cost import Coefficients, Estimate, PlanArrays, estimates_from, evaluate
from autopar.cost.arrays import RankTable, SplitTable
from autopar.errors import PlanError
from autopar.knobs import DTYPE_BYTES
from autopar.mixed.plan import Lane, MixedPlan, Segment, check_lane
from autopar.plan import Plan
from autopar.runtime import is_megatron


@dataclass(frozen=True)
class SegmentEstimate:
    group: str
    gpus: int
    tp: int
    stages: int
    blocks: int  # transformer blocks its stages hold
    ranks: tuple[int, ...]  # the pipeline ranks it holds
    per_mb_s: float  # its slowest rank's forward + backward of one micro-batch (cross-group send included)
    send_s: float  # of which the extra seconds of sends across a group boundary
    peak_memory_bytes: float
    usable_memory_bytes: float  # its group's GPU memory less the headroom
    peak_flops: float  # per GPU of its group, in the plan's precision

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.usable_memory_bytes


@dataclass(frozen=True)
class LaneEstimate:
    lane: Lane
    iteration_time_s: float  # the lane alone: its pipeline, its own data-parallel tail, constants
    segments: tuple[SegmentEstimate, ...]
    model_flops: float  # per step, of its share
    estimate: Estimate | None = None  # a lane on one group: the homogeneous estimate it is

    @property
    def share(self) -> int:
        return self.lane.share

    @property
    def fits(self) -> bool:
        return all(s.fits for s in self.segments)

    @property
    def samples_per_s(self) -> float:
        return self.share / self.iteration_time_s


@dataclass(frozen=True)
class MixedEstimate:
    iteration_time_s: float  # slowest lane + cross_sync_s
    lanes: tuple[LaneEstimate, ...]
    cross_sync_s: float  # the lanes' gradient all-reduce over the inter-group link (0 with one lane)
    model_flops: float  # per step
    tokens_per_iteration: int
    peak_flops: float  # the sum over the used GPUs of each one's peak in the plan's precision
    num_gpus: int  # used
    idle: tuple[str, ...]  # groups the plan leaves idle

    @property
    def fits(self) -> bool:
        return all(lane.fits for lane in self.lanes)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_iteration / self.iteration_time_s

    @property
    def mfu(self) -> float:
        """Model FLOP/s over the used GPUs' summed peak (a homogeneous plan's `Estimate.mfu` on one group)."""
        return self.model_flops / self.iteration_time_s / self.peak_flops

    @property
    def tflops_per_gpu(self) -> float:
        return self.model_flops / self.iteration_time_s / self.num_gpus / 1e12

    def memory(self) -> dict[str, tuple[float, float]]:
        """Per used group: (the largest peak of its GPUs, its budget), bytes."""
        out: dict[str, tuple[float, float]] = {}
        for lane in self.lanes:
            for s in lane.segments:
                peak = max(out.get(s.group, (0.0, 0.0))[0], s.peak_memory_bytes)
                out[s.group] = (peak, s.usable_memory_bytes)
        return out

    def to_dict(self) -> dict:
        return {
            "iteration_time_s": self.iteration_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "fits": self.fits, "cross_sync_s": self.cross_sync_s, "num_gpus": self.num_gpus, "idle": list(self.idle),
            "memory_gb": {g: {"peak": p / 1e9, "usable": u / 1e9} for g, (p, u) in self.memory().items()},
            "lanes": [{"share": lane.share, "iteration_time_s": lane.iteration_time_s, "fits": lane.fits,
                       "plan": lane.lane.plan.describe(),
                       "segments": [{"group": s.group, "gpus": s.gpus, "tp": s.tp, "stages": s.stages,
                                     "blocks": s.blocks, "per_micro_batch_s": s.per_mb_s, "send_s": s.send_s,
                                     "peak_memory_gb": s.peak_memory_bytes / 1e9,
                                     "usable_memory_gb": s.usable_memory_bytes / 1e9}
                                    for s in lane.segments]}
                      for lane in self.lanes],
        }


def _coefficients(workload) -> Coefficients:
    """The group's own calibrated coefficients, as `evaluate` builds them."""
    return Coefficients.for_cluster(workload.cluster, workload.runtime)


def price_lane(mw, lane: Lane, checked: bool = False) -> LaneEstimate:
    """One lane's cost on its groups (`checked`: the lane was validated already)."""
    if not checked:
        check_lane(lane, mw)
    if not lane.spans:
        return _one_group(mw, lane)
    return _spanning(mw, lane)


def _one_group(mw, lane: Lane) -> LaneEstimate:
    """Exactly `autopar.cost.estimate(mw.on_group(...), lane.plan)`, with the per-rank figures beside it."""
    s = lane.segments[0]
    workload = mw.on_group(s.group, lane.gpus(), lane.share)
    pa = PlanArrays.from_plans([lane.plan], mw.profile)
    res = evaluate(workload, pa, _coefficients(workload), ranks=True)
    est = estimates_from(workload, pa, res, 0)[0]
    mult = res["rank_mult"][0] > 0
    seg = SegmentEstimate(s.group, lane.gpus(), s.tp, s.stages, mw.profile.num_layers, tuple(range(s.stages)),
                          float(res["rank_per_mb"][0][mult].max()), 0.0, est.peak_memory_bytes,
                          est.usable_memory_bytes, est.peak_flops)
    return LaneEstimate(lane, est.iteration_time_s, (seg,), est.model_flops, est)


def _boundary_bytes(mw, plan) -> float:
    """Bytes of one micro-batch's boundary activations a pipeline rank sends (`cost/model.py` `_per_rank`'s
    p2p_bytes: the hidden states, 1/tp of them under Megatron's scatter or sequence parallelism)."""
    profile = mw.profile
    samples = plan.micro_batch_size / getattr(plan, "cp", 1)
    scale = DTYPE_BYTES[plan.precision] / DTYPE_BYTES[profile.dtype]
    split = plan.tp if (is_megatron(mw.runtime) or plan.sequence_parallel) else 1
    return samples * scale * profile.blocks[0].out_bytes / split


def _spanning(mw, lane: Lane) -> LaneEstimate:
    plan, profile = lane.plan, mw.profile
    pp, m = plan.pp, plan.num_micro_batches
    per_mb, tail, memory, budget = (np.zeros(pp) for _ in range(4))
    const, flops, segments = 0.0, 0.0, []
    send = np.zeros(pp)
    link = mw.cluster.link
    table = SplitTable(profile)
    ranges = lane.stage_ranges()
    for i, (s, ranks) in enumerate(zip(lane.segments, ranges)):
        seg_plan = lane.segment_plan(s)
        workload = mw.spanning(s.group, seg_plan.world_size, lane.share)
        c = _coefficients(workload)
        counts, full, sel = table.per_rank(pp, seg_plan.split_for(profile.num_layers), seg_plan.stage_recompute,
                                           seg_plan.schedule)
        base = PlanArrays.from_plans([seg_plan], profile)
        pa = PlanArrays({**base.columns, "split": np.zeros(1, dtype=np.int64)},
                        RankTable(np.arange(pp, dtype=float)[None, :], counts[None], full[None], sel[None]))
        res = evaluate(workload, pa, c, ranks=True)
        r = np.arange(ranks.start, ranks.stop)
        per_mb[r], tail[r], memory[r] = res["rank_per_mb"][0, r], res["rank_tail"][0, r], res["rank_memory"][0, r]
        budget[r] = workload.memory_budget
        const = max(const, float(np.max(res["rank_const"])))
        flops = float(res["model_flops"][0])
        # the boundary sends: forward out of this segment's last rank, backward out of its first rank
        own = workload.cluster.p2p(seg_plan.dims.strides()["pp"])
        nbytes = _boundary_bytes(mw, seg_plan)
        extra = (nbytes / (link.bandwidth * c.link(link.kind)) - nbytes / (own.bandwidth * c.link(own.kind))
                 + (link.latency - own.latency) * c.latency_scale)
        if i + 1 < len(lane.segments) and lane.segments[i + 1].group != s.group:
            send[ranks.stop - 1] += extra
        if i > 0 and lane.segments[i - 1].group != s.group:
            send[ranks.start] += extra
    per_mb = per_mb + send
    iteration = float(per_mb.sum() + (m - 1) * per_mb.max() + tail.max() + const)
    for s, ranks in zip(lane.segments, ranges):
        r = np.arange(ranks.start, ranks.stop)
        group = mw.cluster.group(s.group)
        blocks = sum(lane.plan.split_for(profile.num_layers)[ranks.start:ranks.stop])
        segments.append(SegmentEstimate(s.group, lane.segment_gpus(s), s.tp, s.stages, blocks, tuple(r.tolist()),
                                        float(per_mb[r].max()), float(send[r].max()), float(memory[r].max()),
                                        float(budget[r][0]), float(group.gpu.peak_flops[plan.precision])))
    return LaneEstimate(lane, iteration, tuple(segments), flops)


def sync_probe(mw, group: str, dtype: str) -> Lane:
    """A lane on all of `group`'s GPUs whose gradients cross in `dtype`: what `cross_sync` reads of a
    lane (the search's bounds and the Why table's idle groups price one)."""
    n = mw.cluster.group(group).num_gpus
    return Lane((Segment(group, 1, 1),), Plan(dp=n, tp=1, pp=1, micro_batch_size=1, num_micro_batches=1,
                                               grad_comm_dtype=dtype))


def cross_sync(mw, lanes) -> float:
    """Seconds of the lanes' gradient all-reduce, after each lane reduced inside itself: the model's
    gradients, carried in parallel by the GPUs of the smallest lane, each at the inter-group link's
    per-GPU rate (the used groups' least efficiency on its kind), a ring over the L lanes:
    2 (L - 1) / L x bytes / (n_min x bw) + 2 (L - 1) x latency. Exposed: it starts when the slowest
    lane's own reduction ends. Weighting the gradients by samples costs nothing more."""
    lanes = list(lanes)
    n = len(lanes)
    if n < 2:
        return 0.0
    link = mw.cluster.link
    coeffs = [_coefficients(mw.on_group(g, 1, 1)) for g in dict.fromkeys(g for lane in lanes for g in lane.groups)]
    bw = link.bandwidth * min(c.link(link.kind) for c in coeffs)
    latency = link.latency * max(c.latency_scale for c in coeffs)
    nbytes = mw.profile.params * max(DTYPE_BYTES[lane.plan.grad_comm_dtype] for lane in lanes)
    carriers = min(lane.gpus() for lane in lanes)
    return 2 * (n - 1) / n * nbytes / (carriers * bw) + 2 * (n - 1) * latency


def estimate_mixed(mw, mp: MixedPlan) -> MixedEstimate:
    """The cost model's estimate of a mixed plan (validated against the mixed workload first)."""
    mp.validate(mw)
    lanes = tuple(price_lane(mw, lane, checked=True) for lane in mp.lanes)
    sync = cross_sync(mw, mp.lanes)
    peak = sum(s.gpus * s.peak_flops for lane in lanes for s in lane.segments)
    used = set(mp.groups)
    return MixedEstimate(
        iteration_time_s=max(lane.iteration_time_s for lane in lanes) + sync, lanes=lanes, cross_sync_s=sync,
        model_flops=sum(lane.model_flops for lane in lanes), tokens_per_iteration=mw.tokens_per_batch,
        peak_flops=peak, num_gpus=mp.gpus(), idle=tuple(g for g in mw.cluster.group_names if g not in used))


def lane_time(mw, lane: Lane, share: int | None = None) -> float:
    """Seconds per step of one lane alone (inf where a rank exceeds its group's memory): what the
    mixed searches weigh. PlanError where the lane does not fit its groups (`check_lane`)."""
    if share is not None and share != lane.share:
        raise PlanError(f"the lane trains {lane.share} samples per step (dp x micro_batch_size x "
                        f"num_micro_batches), not {share}")
    est = price_lane(mw, lane)
    return est.iteration_time_s if est.fits else float("inf")
