"""Re-planning for a new world size: the planner side of elastic runs.

`autopar run --elastic` names `autopar.search.replan:from_worker_args` to its workers
(the `replanner` of their `ElasticSpec`); rank 0 of a worker group that finds the world size changed calls the
`Replanner` it makes. The executor never imports this module by name.

Batch rule: the global batch is kept when the new world has a plan for it (the planner may
change dp, the micro-batch size and count, tp or pp to keep it); otherwise the nearest global
batch that has a plan is used (the smaller on a tie), and the re-plan record says so
(`global_batch_before` / `global_batch_after`).

When not to re-plan: the old plan still fits when only its dp degree has to change: dp scaled
to the new world, the same micro-batch size, the micro-batch count that keeps the global batch,
valid and within memory. If its predicted step time is within `tolerance` of the planner's best
for the new world, it is kept (decision "kept"): a gain smaller than the cost model's error is
not worth leaving a plan that ran.

What a re-plan keeps: the knobs the plan file lists under `fixed` (`search --fix`) and any knob whose
value differs from the one `search` chose (recorded under `searched`: the user edited it in
plan.json), each at the plan's value (`Plan.kept`); the planner searches the new world with them
held (`Workload.fixed`), and the new plan lists them as `fixed`, so later re-plans keep them too.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

from autopar.cluster import detect, load_cluster
from autopar.cost import estimate
from autopar.errors import AutoparError, PlanError
from autopar.executor.options import ElasticSpec
from autopar.knobs import knob
from autopar.plan import Plan
from autopar.profile import profile_model
from autopar.replan import ReplanDecision
from autopar.search import get_planner
from autopar.workload import Workload

DEFAULT_TOLERANCE = ElasticSpec.replan_tolerance  # keep the old plan when predicted at most this much slower


def batches_near(batch: int) -> Iterator[int]:
    """`batch`, then the others by distance from it, the smaller first, up to 2 x batch."""
    yield batch
    for d in range(1, batch + 1):
        if batch - d >= 1:
            yield batch - d
        yield batch + d


def rescaled(plan: Plan, world: int, global_batch: int) -> Plan | None:
    """`plan` with only dp (and the micro-batch count) changed to run `world` ranks at
    `global_batch`; None when no such plan exists."""
    other = plan.world_size // plan.dp
    if world % other or global_batch % (world // other * plan.micro_batch_size):
        return None
    dp = world // other
    try:
        return plan.with_(dp=dp, num_micro_batches=global_batch // (dp * plan.micro_batch_size))
    except PlanError:
        return None


class Replanner:
    """`replan(old_plan, world_size) -> ReplanDecision` for one model on one kind of cluster.

    `cluster`: a preset or cluster file (None: this machine, as `autopar run` detects it);
    scaled to `world_size` with `gpus_per_node` per node. Everything heavy happens at the first
    call, on rank 0 only. `method`: the exact search by default, which proves its plan the optimum within 1.5x
    of the rl planner's time or faster (README: "Per-stage plans, the rl planner's time, and why the exact
    search is the default")."""

    def __init__(self, model, model_args: dict, cluster: str | None = None, gpus_per_node: int = 1,
                 tolerance: float = DEFAULT_TOLERANCE, method: str = "exhaustive"):
        if not 0 <= tolerance < 1:
            raise AutoparError(f"the re-plan tolerance must be in [0, 1), got {tolerance}")
        self.model, self.model_args, self.cluster_spec = model, model_args, cluster
        self.gpus_per_node, self.tolerance, self.method = gpus_per_node, tolerance, method

    def cluster(self, world: int):
        per_node = self.gpus_per_node if world % self.gpus_per_node == 0 else world
        if self.cluster_spec:
            return load_cluster(self.cluster_spec, nodes=world // per_node, gpus_per_node=per_node)
        return detect().with_nodes(world // per_node, per_node)

    def __call__(self, old: Plan, world: int) -> ReplanDecision:
        started = time.perf_counter()
        profile = profile_model(self.model, self.model_args, dtype=old.precision)
        cluster = self.cluster(world)
        planner = get_planner(self.method)
        kept = old.kept()  # held by `search --fix`, or edited by hand in plan.json: the re-plan keeps them
        fixed = tuple((name, knob(name).value_of(old)) for name in kept)
        problems = []
        for batch in batches_near(old.global_batch):
            workload = Workload(profile=profile, cluster=cluster, global_batch=batch, fixed=fixed)
            try:
                best = planner.propose(workload, 1)[0]
                break
            except AutoparError as e:
                problems.append(str(e))
        else:
            keeping = f" keeping {', '.join(f'{n}={v}' for n, v in fixed)}" if fixed else ""
            raise AutoparError(f"no plan for {world} ranks{keeping} at any global batch up to "
                               f"{2 * old.global_batch}: {problems[0]}")
        new_s = estimate(workload, best).iteration_time_s
        old_s = self._predict(workload, rescaled(old, world, batch))
        moved = f" (global batch {old.global_batch} does not divide over {world} ranks: using {batch})" \
            if batch != old.global_batch else ""
        if old_s is not None and old_s <= new_s * (1 + self.tolerance):
            plan, decision = rescaled(old, world, batch), "kept"
            reason = (f"the old plan with dp={plan.dp} is predicted {old_s * 1e3:.2f} ms/step, {old_s / new_s - 1:+.0%} "
                      f"against the new best {best.describe()} ({new_s * 1e3:.2f} ms): within the "
                      f"{self.tolerance:.0%} tolerance{moved}")
        else:
            plan, decision = best.recorded(fixed=kept), "replanned"  # later re-plans keep them too
            why = ("the old plan does not fit when only dp changes" if old_s is None else
                   f"the old plan with dp rescaled is predicted {old_s * 1e3:.2f} ms/step, "
                   f"{old_s / new_s - 1:.0%} slower")
            reason = f"{self.method} planner: {best.describe()} at {new_s * 1e3:.2f} ms/step; {why}{moved}"
        if kept:
            reason += f"; kept {', '.join(kept)} as the plan has them"
        return ReplanDecision(plan, decision, reason, time.perf_counter() - started, old_s, new_s)

    @staticmethod
    def _predict(workload, plan: Plan | None) -> float | None:
        if plan is None:
            return None
        try:
            est = estimate(workload, plan)
        except PlanError:
            return None
        return est.iteration_time_s if est.fits else None


def from_worker_args(args) -> Replanner:
    """The replan function of an `autopar run --elastic` worker (its `ElasticSpec.replanner`)."""
    spec = args.options.elastic
    return Replanner(args.model, json.loads(args.model_args), spec.cluster,
                     int(os.environ.get("LOCAL_WORLD_SIZE", "1")), spec.replan_tolerance)
