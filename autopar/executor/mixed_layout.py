"""Where each rank of a mixed plan runs, and what it trains: its group, lane, segment, pipeline
stage and tp rank, and its samples of the global batch. No torch: the launcher and the checks
before launch read it too.

Ranks are numbered lane by lane and, in a lane, segment by segment, so each group's ranks are
contiguous: on NCCL a launcher that fills nodes in rank order keeps each node's ranks on one GPU
type (unverified: no mixed machine). The executor runs two kinds of mixed plan
(`autopar.capability.mixed` refuses the others before launch):

* data-parallel lanes: every lane one segment, every lane the same plan but for dp,
  micro_batch_size and num_micro_batches (one layout). They run as ONE homogeneous plan whose dp
  holds every lane's replicas, dp outermost (`executed_plan`), so a lane's replicas are contiguous
  ranks; each rank trains its lane's micro-batches, and its loss is weighted by its samples
  (`loss_weight`) so that the averaged gradients equal one process's on the global batch;
* one lane spanning segments (dp 1): its pipeline stages in order, each stage's tp ranks contiguous.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from autopar.errors import PlanError
from autopar.mixed.plan import Lane, MixedPlan, Segment, consecutive, is_mixed_plan_dict
from autopar.plan import Plan
from autopar.replan import mix_text


def is_mixed_plan_file(path) -> bool:
    """Whether the JSON document at `path` is a mixed plan (False for anything else, unreadable included:
    whoever loads it then says what is wrong)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return is_mixed_plan_dict(doc)


@dataclass(frozen=True)
class RankLabel:
    """One rank's place in a mixed plan."""

    rank: int
    group: str
    lane: int
    segment: int  # index in its lane's segments
    stage: int  # pipeline stage in its lane
    tp_rank: int
    replica: int  # data-parallel replica in its lane

    def __str__(self) -> str:
        return (f"rank {self.rank}: group {self.group}, lane {self.lane}, segment {self.segment}, "
                f"stage {self.stage}, tp rank {self.tp_rank}, replica {self.replica}")

    def to_dict(self) -> dict:
        return asdict(self)


def data_parallel(mixed_plan) -> bool:
    """Whether every lane is one segment: the lanes are data-parallel replicas of one another."""
    return not any(lane.spans for lane in mixed_plan.lanes)


def total_replicas(mixed_plan) -> int:
    return sum(lane.plan.dp for lane in mixed_plan.lanes)


def executed_plan(mixed_plan, lane: int) -> Plan:
    """The homogeneous plan a rank of data-parallel lane `lane` applies: the lane's plan with dp
    counting every lane's replicas, dp outermost in the mesh (each lane's ranks contiguous)."""
    plan = mixed_plan.lanes[lane].plan
    order = ("dp",) + tuple(a for a in plan.mesh_order if a != "dp")
    return plan.with_(dp=total_replicas(mixed_plan), mesh_order=order)


def world_size(mixed_plan) -> int:
    """The ranks a mixed plan runs on: one per GPU it holds (`MixedPlan.world_size`)."""
    return mixed_plan.world_size


def check_world(mixed_plan, world: int, given: str) -> None:
    """Refuse `world` ranks (`given` says where the number comes from) for a plan of another size."""
    ranks = world_size(mixed_plan)
    if world != ranks:
        raise PlanError(f"the mixed plan runs on {ranks} ranks but {given} = {world}; launch {ranks} processes "
                        f"(--nproc-per-node {ranks})")


def stage_ranks(lane, first: int = 0) -> list[list[int]]:
    """The ranks of each pipeline stage of a spanning lane (dp 1), segment by segment from rank `first`."""
    out, rank = [], first
    for seg in lane.segments:
        for _ in range(seg.stages):
            out.append(list(range(rank, rank + seg.tp)))
            rank += seg.tp
    return out


def rank_labels(mixed_plan) -> list[RankLabel]:
    """Every rank's label, by rank."""
    labels: list[RankLabel] = []
    if data_parallel(mixed_plan):
        replica = 0
        for i, lane in enumerate(mixed_plan.lanes):
            plan = executed_plan(mixed_plan, i)
            strides, per_replica = plan.strides(), plan.world_size // plan.dp
            for r in range(lane.plan.dp * per_replica):
                rank = replica * per_replica + r
                labels.append(RankLabel(rank, lane.segments[0].group, i, 0, (rank // strides["pp"]) % plan.pp,
                                        (rank // strides["tp"]) % plan.tp, rank // per_replica - replica))
            replica += lane.plan.dp
        return labels
    for i, lane in enumerate(mixed_plan.lanes):
        stages = stage_ranks(lane, len(labels))
        segment_of = [s for s, seg in enumerate(lane.segments) for _ in range(seg.stages)]
        for stage, ranks in enumerate(stages):
            seg = lane.segments[segment_of[stage]]
            labels.extend(RankLabel(rank, seg.group, i, segment_of[stage], stage, t, 0) for t, rank in enumerate(ranks))
    return labels


def lane_samples(mixed_plan) -> list[range]:
    """Each lane's samples of the global batch: consecutive shares in lane order."""
    return consecutive([lane.share for lane in mixed_plan.lanes])


def rank_samples(mixed_plan, label: RankLabel) -> range:
    """The samples of the global batch a rank trains: its lane's share, split over the lane's replicas as
    `DistributedSampler` splits a batch (sample i to replica i mod dp)."""
    share = lane_samples(mixed_plan)[label.lane]
    return share[label.replica::mixed_plan.lanes[label.lane].plan.dp]


def loss_weight(mixed_plan, label: RankLabel) -> float:
    """What a data-parallel rank multiplies its mean loss by so that the gradients data parallelism
    averages over all D replicas equal one process's on the global batch G: D x (its samples) / G.
    (The mean of w_r x grad_r over r is the sum of samples_r / G x grad_r: each sample counts once.)"""
    samples = len(rank_samples(mixed_plan, label))
    return total_replicas(mixed_plan) * samples / sum(lane.share for lane in mixed_plan.lanes)


# -- an elastic job of a mixed plan (`autopar.executor.elastic`): the ranks' declared groups ----------------
@dataclass(frozen=True)
class Mix:
    """The running ranks of an elastic job of a mixed plan: the group each rank declared (its node's
    `--node-group`), by rank, and how many ranks its node runs (LOCAL_WORLD_SIZE)."""

    groups: tuple[str, ...]
    per_node: tuple[int, ...]

    def ranks(self) -> dict[str, int]:
        """Ranks per group, in order of first rank."""
        return dict(Counter(self.groups))

    def node_ranks(self, group: str) -> int:
        """The ranks one node of `group` runs (its first rank's node)."""
        return self.per_node[self.groups.index(group)]

    def describe(self) -> str:
        return mix_text(self.ranks())


def one_lane(plan: Plan, group: str) -> MixedPlan:
    """A homogeneous plan on one group, as a mixed plan of one lane (what a re-plan starts from)."""
    return MixedPlan((Lane((Segment(group, plan.tp, plan.pp),), plan),))


def plan_ranks(needed: list[str] | tuple[str, ...], declared: list[str] | tuple[str, ...]) -> list[int]:
    """The rank each running rank takes so that plan rank r runs on a rank of group `needed[r]`:
    `declared[w]` is running rank w's group. Ranks of one group keep their order (a node's ranks stay
    contiguous). PlanError when the groups' counts differ."""
    if Counter(needed) != Counter(declared):
        have, want = mix_text(dict(Counter(declared))), mix_text(dict(Counter(needed)))
        raise PlanError(f"the plan runs on {want} but the ranks running are {have}; give each node its group "
                        f"with --node-group")
    free: dict[str, list[int]] = {}
    for rank, group in enumerate(needed):
        free.setdefault(group, []).append(rank)
    return [free[group].pop(0) for group in declared]
