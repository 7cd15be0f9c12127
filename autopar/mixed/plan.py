"""A mixed plan: lanes of data-parallel replicas, each a pipeline whose stages may span GPU groups.

A `Lane` is one homogeneous `Plan` (its knobs: dp, pp, micro-batching, layer split, recompute,
ZeRO, precision, schedule, ...) whose pp stages are laid out, in pipeline order, as `Segment`s:
`stages` consecutive stages on one group at that group's tensor-parallel degree. A lane's share
of the global batch is its plan's dp x micro_batch_size x num_micro_batches; the lanes' shares add
up to the global batch, and gradients are weighted by samples, so the update is the homogeneous
one. JSON: {"mixed_plan_version": 1, "lanes": [{"segments": [{"group", "tp", "stages"}, ...],
"plan": <a Plan's JSON>}, ...]} (docs/hardware.md, "Mixed clusters"). Reading one runs no code.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

from autopar.atomic import write_text_atomic
from autopar.capability.mixed import lane_problem, segment_tp_problem
from autopar.errors import PlanError
from autopar.plan import Plan
from autopar.schema import MAX_GPUS, load_document, loads, read_file

MIXED_PLAN_VERSION = 1


def _count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_GPUS:
        raise PlanError(f"{what} must be a positive integer, got {value!r}")
    return value


def consecutive(sizes: list[int]) -> list[range]:
    """Ranges of these sizes laid end to end from 0: a lane's stages by segment, the lanes' samples of a batch."""
    ends = list(itertools.accumulate(sizes))
    return [range(end - n, end) for n, end in zip(sizes, ends)]


@dataclass(frozen=True)
class Segment:
    """`stages` consecutive pipeline stages of one replica, on group `group`, at tensor-parallel degree `tp`."""

    group: str
    tp: int
    stages: int

    def __post_init__(self):
        if not isinstance(self.group, str) or not self.group:
            raise PlanError(f"a segment's group must be a group's name, got {self.group!r}")
        _count(self.tp, f"segment {self.group}: tp")
        _count(self.stages, f"segment {self.group}: stages")

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "tp": self.tp, "stages": self.stages}


@dataclass(frozen=True)
class Lane:
    """dp replicas of one pipeline (`plan`), its stages laid out over groups by `segments`."""

    segments: tuple[Segment, ...]
    plan: Plan

    def __post_init__(self):
        object.__setattr__(self, "segments", tuple(self.segments))
        if not self.segments or not all(isinstance(s, Segment) for s in self.segments):
            raise PlanError("a lane needs at least one segment {\"group\", \"tp\", \"stages\"}")
        if not isinstance(self.plan, Plan):
            raise PlanError(f"a lane's plan must be a Plan, got {type(self.plan).__name__}")
        if problem := lane_problem(self):
            raise PlanError(problem)

    @property
    def share(self) -> int:
        """Samples per step this lane trains."""
        return self.plan.dp * self.plan.micro_batch_size * self.plan.num_micro_batches

    @property
    def spans(self) -> bool:
        return len(self.segments) > 1

    @property
    def groups(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(s.group for s in self.segments))

    def _others(self) -> int:
        """Ranks per (dp, tp, pp) position: the product of the plan's other axes (cp)."""
        return self.plan.world_size // (self.plan.dp * self.plan.tp * self.plan.pp)

    def segment_gpus(self, segment: Segment) -> int:
        return self.plan.dp * segment.tp * segment.stages * self._others()

    def gpus(self, group: str | None = None) -> int:
        """GPUs this lane holds on `group` (all groups: None)."""
        return sum(self.segment_gpus(s) for s in self.segments if group is None or s.group == group)

    def segment_plan(self, segment: Segment) -> Plan:
        """The lane's plan at the segment's tensor-parallel degree: what the segment is priced with."""
        if segment.tp == self.plan.tp:
            return self.plan
        try:
            return self.plan.with_(tp=segment.tp)
        except PlanError as e:
            raise PlanError(f"segment on {segment.group} at tp={segment.tp}: {e}") from None

    def stage_ranges(self) -> list[range]:
        """The pipeline stages (ranks) each segment holds, in order."""
        return consecutive([s.stages for s in self.segments])

    def describe(self) -> str:
        where = " | ".join(f"{s.group} tp{s.tp} x{s.stages}" for s in self.segments)
        return f"[{where}] {self.plan.describe()}"

    def to_dict(self) -> dict[str, Any]:
        return {"segments": [s.to_dict() for s in self.segments], "plan": self.plan.to_dict()}


@dataclass(frozen=True)
class MixedPlan:
    """The lanes that together train one global batch on a mixed cluster."""

    lanes: tuple[Lane, ...]

    def __post_init__(self):
        object.__setattr__(self, "lanes", tuple(self.lanes))
        if not self.lanes or not all(isinstance(lane, Lane) for lane in self.lanes):
            raise PlanError("a mixed plan needs at least one lane {\"segments\": [...], \"plan\": {...}}")

    @property
    def global_batch(self) -> int:
        return sum(lane.share for lane in self.lanes)

    def gpus(self, group: str | None = None) -> int:
        return sum(lane.gpus(group) for lane in self.lanes)

    @property
    def world_size(self) -> int:
        """The ranks it runs on (one per GPU), as a homogeneous Plan's."""
        return self.gpus()

    @property
    def groups(self) -> tuple[str, ...]:
        """The groups the plan uses, in order of first use."""
        return tuple(dict.fromkeys(g for lane in self.lanes for g in lane.groups))

    def validate(self, mw) -> None:
        """Raise PlanError (one line: what is wrong, how to fix it) unless the plan fits `mw`, a MixedWorkload."""
        for i, lane in enumerate(self.lanes, 1):
            try:
                _check_groups(lane, mw)
            except PlanError as e:
                raise PlanError(f"lane {i}: {e}") from None
        for name in mw.cluster.group_names:
            have, used = mw.cluster.group(name).num_gpus, self.gpus(name)
            if used > have:
                raise PlanError(f"the plan puts {used} GPUs on group {name}, which has {have}; use fewer replicas, "
                                f"stages or a smaller tp there")
        if self.global_batch != mw.global_batch:
            shares = " + ".join(str(lane.share) for lane in self.lanes)
            raise PlanError(f"the lanes' shares {shares} = {self.global_batch} but the global batch is "
                            f"{mw.global_batch}; make the lanes' dp x micro_batch_size x num_micro_batches add up")
        for i, lane in enumerate(self.lanes, 1):
            try:
                check_lane(lane, mw)
            except PlanError as e:
                raise PlanError(f"lane {i}: {e}") from None

    # -- JSON ------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"mixed_plan_version": MIXED_PLAN_VERSION, "lanes": [lane.to_dict() for lane in self.lanes]}

    def to_json(self, path=None) -> str:
        """The JSON text; with `path`, also written there atomically."""
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            write_text_atomic(path, text + "\n")
        return text

    def describe(self) -> str:
        return "; ".join(f"lane {i} ({lane.share} samples): {lane.describe()}" for i, lane in enumerate(self.lanes, 1))

    @classmethod
    def from_dict(cls, d: Any) -> MixedPlan:
        _keys(d, "mixed plan", ("mixed_plan_version", "lanes"))
        if d["mixed_plan_version"] != MIXED_PLAN_VERSION:
            raise PlanError(f"mixed_plan_version is {d['mixed_plan_version']!r}, this autopar reads "
                            f"{MIXED_PLAN_VERSION}; re-create the plan with `autopar search --cluster A:n,B:m`")
        if not isinstance(d["lanes"], list) or not d["lanes"]:
            raise PlanError("mixed plan key 'lanes' must be a non-empty list of lanes")
        lanes = []
        for i, lane in enumerate(d["lanes"], 1):
            try:
                _keys(lane, "lane", ("segments", "plan"))
                if not isinstance(lane["segments"], list):
                    raise PlanError("'segments' must be a list of {\"group\", \"tp\", \"stages\"}")
                segments = []
                for s in lane["segments"]:
                    _keys(s, "segment", ("group", "tp", "stages"))
                    segments.append(Segment(s["group"], s["tp"], s["stages"]))
                lanes.append(Lane(tuple(segments), Plan.from_dict(lane["plan"])))
            except PlanError as e:
                raise PlanError(f"lanes[{i - 1}]: {e}") from None
        return cls(tuple(lanes))

    @classmethod
    def from_json(cls, text: str | bytes) -> MixedPlan:
        return cls.from_dict(loads(text, "mixed plan", PlanError))

    @classmethod
    def load(cls, path) -> MixedPlan:
        return load_document(path, "mixed plan", cls.from_dict, PlanError)

    def save(self, path) -> None:
        self.to_json(path)


def is_mixed_plan_dict(d: Any) -> bool:
    """Whether a plan document is a mixed plan (it carries mixed_plan_version)."""
    return isinstance(d, dict) and "mixed_plan_version" in d


def load_if_mixed(path) -> MixedPlan | None:
    """The mixed plan in a plan file, or None when the file holds another plan (a homogeneous one)."""
    try:
        d = loads(read_file(path, "plan file", PlanError), "plan", PlanError)
        return MixedPlan.from_dict(d) if is_mixed_plan_dict(d) else None
    except PlanError as e:
        raise PlanError(e.args[0] if str(path) in e.args[0] else f"{path}: {e}") from None


def _keys(d: Any, what: str, required: tuple[str, ...]) -> None:
    if not isinstance(d, dict):
        raise PlanError(f"a {what} must be a JSON object, got {type(d).__name__}")
    unknown = sorted(set(d) - set(required))
    if unknown:
        raise PlanError(f"unknown {what} key(s) {unknown}; valid keys are {list(required)}")
    missing = [k for k in required if k not in d]
    if missing:
        raise PlanError(f"{what} is missing key(s) {missing}")


def _check_groups(lane: Lane, mw) -> None:
    """Its groups exist, hold its tp degrees within a node, and hold its GPUs."""
    names = mw.cluster.group_names
    for s in lane.segments:
        if s.group not in names:
            raise PlanError(f"unknown group {s.group!r}; the cluster's groups are {', '.join(names)}")
        if problem := segment_tp_problem(s, mw.cluster.group(s.group).gpus_per_node):
            raise PlanError(problem)
    for name in lane.groups:
        have, used = mw.cluster.group(name).num_gpus, lane.gpus(name)
        if used > have:
            raise PlanError(f"the lane puts {used} GPUs on group {name}, which has {have}; use fewer replicas, "
                            f"stages or a smaller tp there")


def check_lane(lane: Lane, mw) -> None:
    """One lane alone against the mixed workload (PlanError, one line). A lane on one group is the
    homogeneous plan on that group's part (Plan.validate, exactly); a lane across groups passes every
    check of Plan.validate but the world size and batch (`Plan.validate_parts`: a segment holds only its own
    stages' ranks) on each segment's group, at that segment's tp, prefixed with the group."""
    _check_groups(lane, mw)
    if not lane.spans:
        s = lane.segments[0]
        lane.plan.validate(mw.on_group(s.group, lane.gpus(), lane.share))
        return
    for s in lane.segments:
        plan = lane.segment_plan(s)
        try:
            plan.validate_parts(mw.spanning(s.group, plan.world_size, lane.share))
        except PlanError as e:
            raise PlanError(f"group {s.group}: {e}") from None
