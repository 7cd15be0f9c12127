"""Re-planning a mixed plan for a new mix of GPUs (issue 42): a group lost or gained nodes, a group
left or joined. `replan_mixed(old, mw)` answers, as the homogeneous re-planner does
(`autopar.search.replan`), with a `ReplanDecision`: the plan to continue under, "kept" or "replanned".

The new plan is `search_mixed` on the new mix at the old plan's global batch (by default the rl method:
0.6 s median on bench_mixed_rl's held-out workloads, 3-4 s on acceptance 1's 24-32 GPU Llama 3 8B clusters,
bounded by `time_limit`, 8 s, past which no new share is priced nor finished by the exact search (one
already started runs to its end); each group alone is always planned); where one group is left, its plan
alone (a homogeneous plan). The old plan is kept when it still runs on the new mix
(every group its lanes name is there with the GPUs they take, validated and within memory) and its
predicted step is within `tolerance` (ElasticSpec's, 5%) of the new plan's: a gain smaller than the
cost model's error is not worth leaving a plan that ran. `autopar search --cluster NEW --replan-from
old.json` prints the decision; `autopar run mixed.json --elastic --node-group GROUP` re-plans through
`MixReplanner` whenever torchrun restarts its workers on another mix (docs/heterogeneous.md).
"""

from __future__ import annotations

import json
import time
from collections import Counter

from autopar.capability.mixed import mixed_refusals
from autopar.cluster.mixed import MixedCluster, load_any_cluster, mixed_cluster
from autopar.cost import estimate
from autopar.errors import PlanError
from autopar.executor.mixed_layout import Mix, rank_labels
from autopar.executor.options import ElasticSpec
from autopar.executor.support import target
from autopar.knobs import storage_dtype
from autopar.mixed.cost import estimate_mixed
from autopar.mixed.plan import MixedPlan
from autopar.mixed.search import RL_OPTIONS, MixedResult, search_mixed
from autopar.mixed.workload import MixedWorkload
from autopar.profile import profile_model
from autopar.replan import ReplanDecision, mix_text
from autopar.search import get_planner
from autopar.search.exhaustive import ExhaustivePlanner
from autopar.workload import Workload

TIME_LIMIT_S = 8.0  # the search stops pricing new shares past this (acceptance 2: a re-plan within 10 s)
TOLERANCE = ElasticSpec.replan_tolerance


def old_step(old: MixedPlan, mw) -> tuple[float | None, str]:
    """The old plan's predicted seconds per step on the new mix, or None and why it no longer runs there."""
    try:
        est = estimate_mixed(mw, old)
    except PlanError as e:
        return None, str(e)
    return (est.iteration_time_s, "") if est.fits else (None, "a group's GPUs would run out of memory")


def replan_mixed(old: MixedPlan, mw, method: str = "rl", tolerance: float = TOLERANCE, time_limit: float = TIME_LIMIT_S,
                 every_group: bool = False) -> tuple[ReplanDecision, MixedResult | None]:
    """The plan to continue `old` under on `mw`, the new mix at the old plan's global batch (a
    MixedWorkload; a Workload where one group is left: a homogeneous plan, found by the method's own
    planner of one group, and no MixedResult). `every_group`: only plans using every group of `mw` (the old
    one kept only if it does). NoValidPlanError when the new mix holds no plan there."""
    if mw.global_batch != old.global_batch:
        raise PlanError(f"the new mix trains {mw.global_batch} samples per step but the plan {old.global_batch}; "
                        f"re-planning keeps the plan's global batch")
    started = time.perf_counter()
    if not isinstance(mw, MixedWorkload):
        planner = get_planner("rl", **RL_OPTIONS) if method == "rl" else ExhaustivePlanner()
        new = planner.propose(mw, 1)[0]
        before, why = _alone(old, mw)
        after, result = estimate(mw, new).iteration_time_s, None
        kept = old.lanes[0].plan
    else:
        result = search_mixed(mw, method, time_limit=time_limit, every_group=every_group)
        new, after = result.plan, result.estimate.iteration_time_s
        before, why = old_step(old, mw)
        if every_group and set(old.groups) != set(mw.cluster.group_names):
            before, why = None, f"it leaves {', '.join(g for g in mw.cluster.group_names if g not in old.groups)} idle"
        kept = old
    if before is not None and before <= after * (1 + tolerance):
        plan, decision = kept, "kept"
        reason = (f"the plan still runs on {mw.cluster.name}: {before:.3f} s per step, within {tolerance:.0%} of the "
                  f"new best {after:.3f} s")
    else:
        plan, decision = new, "replanned"
        reason = (f"the plan no longer runs on {mw.cluster.name}: {why}" if before is None else
                  f"the plan takes {before:.3f} s per step on {mw.cluster.name}, the new best {after:.3f} s "
                  f"({before / after:.2f}x)")
    return ReplanDecision(plan, decision, reason, time.perf_counter() - started, before, after), result


def _alone(old: MixedPlan, w) -> tuple[float | None, str]:
    """The old plan's seconds per step on one group (`w`), where it is one lane on that group alone."""
    groups = ", ".join(old.groups)
    if len(old.lanes) > 1 or old.lanes[0].spans or old.lanes[0].segments[0].group != w.cluster.name:
        return None, f"its lanes use the groups {groups}; {w.cluster.name} is left alone"
    try:
        old.lanes[0].plan.validate(w)
        est = estimate(w, old.lanes[0].plan)
    except PlanError as e:
        return None, str(e)
    return (est.iteration_time_s, "") if est.fits else (None, "its GPUs would run out of memory")


def mix_workload(profile, original: MixedCluster, mix: Mix, global_batch: int, fp8: bool = False):
    """What the running ranks are, to the planner: each group of `original` (its hardware, the link
    between groups) with the nodes its ranks make (`mix.node_ranks` ranks a node), in `original`'s
    order; a Workload where one group is left."""
    ranks = mix.ranks()
    for name in ranks:
        if name not in original.group_names:
            raise PlanError(f"a node declared group {name!r}, which {original.name} does not have; give "
                            f"--node-group one of {', '.join(original.group_names)}")
    names = [name for name in original.group_names if name in ranks]
    groups = []
    for name in names:
        per_node = mix.node_ranks(name)
        whole = ranks[name] % per_node == 0
        groups.append(original.group(name).with_nodes(ranks[name] // per_node if whole else 1,
                                                      per_node if whole else ranks[name]))
    if len(groups) == 1:
        return Workload(profile, groups[0], global_batch, fp8=fp8)
    return MixedWorkload(profile, mixed_cluster(groups, names, original.link), global_batch, fp8=fp8)


class MixReplanner:
    """`replan(old, mix) -> ReplanDecision` of an elastic mixed job (`autopar.executor.elastic`): the
    plan to continue `old` (a MixedPlan) under on the ranks `mix` declares, on the groups of the job's
    `--cluster`. Only plans that use every group running are weighed (`search_mixed`'s every_group: the
    job cannot drop a running group's ranks, and a group alone is often the fastest for a small model).
    Refused in one line: no such plan fits, a plan the executor cannot run, or one that still leaves ranks
    idle."""

    def __init__(self, model, model_args: dict, cluster: str, backend: str | None = None,
                 tolerance: float = TOLERANCE, method: str = "rl"):
        self.model, self.model_args, self.cluster, self.backend = model, model_args, cluster, backend
        self.tolerance, self.method = tolerance, method

    def __call__(self, old: MixedPlan, mix: Mix) -> ReplanDecision:
        started = time.perf_counter()
        precision = old.lanes[0].plan.precision
        profile = profile_model(self.model, self.model_args, dtype=storage_dtype(precision))
        original = load_any_cluster(self.cluster)
        if not isinstance(original, MixedCluster):
            raise PlanError(f"--cluster {self.cluster} is one group; an elastic mixed job needs the mixed cluster "
                            f"its plan was made for")
        workload = mix_workload(profile, original, mix, old.global_batch, fp8=precision == "fp8")
        decision, _ = replan_mixed(old, workload, self.method, self.tolerance, TIME_LIMIT_S, every_group=True)
        plan = decision.plan
        uses = Counter(lb.group for lb in rank_labels(plan)) if isinstance(plan, MixedPlan) else \
            Counter({next(iter(mix.ranks())): plan.world_size})  # one group left
        idle = Counter(mix.groups) - uses
        if idle:
            raise PlanError(f"the plan for {mix.describe()} ranks ({plan.describe()}) leaves {mix_text(dict(idle))} "
                            f"rank(s) idle, and autopar run runs every rank; stop those nodes, or re-plan with "
                            f"`autopar search --replan-from` and start the job again")
        refused = mixed_refusals(plan, target(self.backend)) if isinstance(plan, MixedPlan) else []
        if refused:
            raise PlanError(f"the plan for {mix.describe()} ranks is one the executor cannot run: {refused[0]}")
        # the planning time includes the profile (cached after the first call)
        return ReplanDecision(plan, decision.decision, decision.reason, time.perf_counter() - started,
                              decision.predicted_old_s, decision.predicted_new_s)


def from_worker_args(args) -> MixReplanner:
    """The replan function of an `autopar run mixed.json --elastic` worker (its `ElasticSpec.replanner`)."""
    spec = args.options.elastic
    return MixReplanner(args.model, json.loads(args.model_args), spec.cluster, args.options.backend,
                        spec.replan_tolerance)
