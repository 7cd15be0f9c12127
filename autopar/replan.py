"""Re-plan records of elastic runs: what changed, what was decided, and what it cost (a contract:
the executor, the replanner and the traces share it).

One record per worker-group start that found the world size (a mixed job: the ranks per group)
changed since the last checkpoint (`autopar.executor.elastic`). The elastic run's trace record carries them under
`measured["replans"]`, so a trace shows every plan the job ran under and why it moved.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from autopar.errors import AutoparError

DECISIONS = ("replanned", "kept")  # kept: the old plan, dp rescaled, was within the tolerance of the new best


@dataclass(frozen=True)
class ReplanDecision:
    """What the planner side answers for a new world size: the plan to continue under and why."""

    plan: Any  # autopar.plan.Plan
    decision: str  # one of DECISIONS
    reason: str
    planning_s: float = 0.0
    predicted_old_s: float | None = None  # the old plan, rescaled to the new world (None: it does not fit)
    predicted_new_s: float | None = None  # the planner's best for the new world


@dataclass(frozen=True)
class ReplanRecord:
    """One re-plan of an elastic run. `steps_lost`: steps trained after the checkpoint resumed
    from, redone under the new plan; `downtime_s`: from the last step of the old world to the
    first step of the new one can start (detection, rendezvous, worker start, planning, load)."""

    world_before: int
    world_after: int
    old_plan: dict[str, Any]
    new_plan: dict[str, Any]
    decision: str
    reason: str
    resumed_step: int
    steps_lost: int
    global_batch_before: int
    global_batch_after: int
    planning_s: float
    checkpoint_load_s: float
    downtime_s: float | None = None
    predicted_old_s: float | None = None
    predicted_new_s: float | None = None
    mix_before: dict[str, int] | None = None  # a mixed job's ranks per group (`--node-group`), before and after
    mix_after: dict[str, int] | None = None

    def __post_init__(self):
        if self.decision not in DECISIONS:
            raise AutoparError(f"re-plan decision must be one of {list(DECISIONS)}, got {self.decision!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> ReplanRecord:
        names = [f.name for f in fields(cls)]
        if not isinstance(d, dict) or set(d) - set(names):
            raise AutoparError(f"a re-plan record is a JSON object with the fields {names}")
        return cls(**d)

    def describe(self) -> str:
        batch = (f", global batch {self.global_batch_before} -> {self.global_batch_after}"
                 if self.global_batch_after != self.global_batch_before else "")
        ranks = f"{self.world_before} -> {self.world_after} ranks"
        if self.mix_after is not None:
            ranks = f"{mix_text(self.mix_before)} -> {mix_text(self.mix_after)} ranks"
        return (f"{ranks} at step {self.resumed_step}: {self.decision} "
                f"({self.reason}){batch}; {self.steps_lost} step(s) redone, planning {self.planning_s:.2f} s, "
                f"checkpoint load {self.checkpoint_load_s:.2f} s")


def mix_text(mix: dict[str, int] | None) -> str:
    """Ranks per group, as a re-plan record and its errors say them: "2 dgx-a100-80g + 1 dgx-h100"."""
    return " + ".join(f"{n} {group}" for group, n in mix.items()) if mix else "?"
