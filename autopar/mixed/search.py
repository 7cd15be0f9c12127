"""The search over mixed plans (issue 42): `search_mixed(mw, method)` -> the best MixedPlan found.

Three kinds of plan are weighed, and the fastest (by `estimate_mixed`) is the answer:
1. each group alone (its best homogeneous plan on all its GPUs at the whole batch: `single`), so the
   answer is never slower than the best single group (the other groups then sit idle);
2. data-parallel lanes, one per used group, each on all its group's GPUs, with uneven batch shares: a
   lane's time at a share is its group's best homogeneous plan at that share (priced exactly as that
   plan: autopar/mixed/cost.py), and the shares are solved on a grid by `shares.best_shares`;
3. one pipeline spanning every group (autopar/mixed/spanning.py).

What is exact and what is not (method "exhaustive", the oracle):
- (1) and each lane's plan at a share are the exact homogeneous search (ExhaustivePlanner) on that
  group's hardware: exact over the plan space, per-stage blocks and recompute included.
- (2) is exact over shares that are multiples of `shares.quantum` (at most GRID units of the batch), over
  every set of used groups (up to MAX_SUBSETS_GROUPS groups; beyond, the fastest k groups for each k) and
  over the width of the gradients the lanes all-reduce across groups (fp32 allowed, or every lane's in the
  16-bit training dtype: the search held at that width, where it can beat the best found), because the
  cross-lane all-reduce depends only on the groups used and that width. "Exact" inherits the homogeneous
  search's 0.5% tie band (it returns the simplest plan within it). Finer shares, or a lane on part of a
  group, are not searched. With two groups a split is skipped once one of its lanes is known to take the
  best step found (`_pair_tables`), which changes no answer.
- (3) is a heuristic: see spanning.py. A spanning lane beside data-parallel lanes is not searched.

"metis" (Metis, Um et al., ATC'24): shares (and a spanning pipeline's blocks) proportional to each group's
measured speed -- its single plan's tokens/s -- then each group's degrees and knobs by the exact
homogeneous search at its share. "rl": the policy proposes, the exact homogeneous search finishes. The
policy (the homogeneous rl planner, greedy, finished by the per-stage solver; trained on a mix a quarter of
which is such lanes: a group's GPUs at a share of a larger batch, `envs/workloads.py` `_as_lane`) plans each
group alone and at its proportional share; every share on the grid is priced by
re-batching the group's plans (`rebatched`: the same degrees and knobs, every micro-batch size, one
vectorised pricing, no policy call); the share DP picks the lanes. The exact homogeneous search of the
uniform plans (ExhaustivePlanner without the per-stage solver: `_Lanes.finish`) plans each group alone whose
policy plan is within RL_ALONE_SLACK of the fastest group's (first), then the chosen lanes at their shares and,
once, the next split over (the slowest lane one unit less, the fastest one more: `_finishing`); its best plan
and runners-up of other layouts are re-batched to the other shares, and the DP runs again (RL_FINISH_ROUNDS
rounds; its 16-bit lanes: its plans with bf16 gradients).
Where no lane plan fits, no lanes beat a group alone or the best lanes spend RL_SPANNING_SYNC of their step
in the cross-group all-reduce (`_weigh_spanning`), rl also weighs the spanning pipeline (which sends only
activations across groups): a quick walk of configurations (spanning.py: the order of the groups walked for
the best degrees only; bounded by RL_SPANNING_S), the exact split window around Metis's for the best one.
So rl calls the policy at most twice per group, the exact search a few times (not per share: the oracle
runs it for every share of every group), and prices far fewer plans than the oracle.
`single` is each method's own homogeneous planner's plan (rl: the policy's, or the exact search's where it
finished that group alone and found a faster one).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass

import numpy as np

from autopar.cost import PlanArrays, estimate, evaluate
from autopar.errors import AutoparError, NoValidPlanError, PlanError
from autopar.knobs import storage_dtype
from autopar.mixed.cost import cross_sync, estimate_mixed, sync_probe
from autopar.mixed.plan import Lane, MixedPlan, Segment
from autopar.mixed.shares import GRID, best_shares, quantum
from autopar.mixed.spanning import search_spanning
from autopar.plan import Plan
from autopar.search import get_planner
from autopar.search.exhaustive import ExhaustivePlanner

METHODS = ("exhaustive", "metis", "rl")
MAX_SUBSETS_GROUPS = 6  # up to this many groups every set of used groups is tried (2^6 - 1 sets)
RL_OPTIONS = {"beam": 1, "refine": False, "trades": False}  # the policy alone (greedy) + the per-stage finish
RL_FINISH_PLANS = 4  # rl: the exact search's best plan and runners-up (other layouts), re-batched to other shares
RL_FINISH_PER_STAGE = False  # rl: the exact finish without the per-stage solver (it doubled rl's time, no gain seen)
RL_ALONE_SLACK = 2.0  # rl: groups alone within this factor of the fastest (by the policy's plans) finished exactly
RL_FINISH_ROUNDS = 2  # rl: rounds of finishing the best lanes exactly and solving the shares again
RL_SPANNING_SYNC = 0.1  # rl: weigh the spanning pipeline where the lanes' cross-group all-reduce is this much of a step
RL_SPANNING_S = 2.0  # rl: seconds the spanning pipeline's walk of configurations may take (it keeps what it priced)


@dataclass(frozen=True)
class MixedResult:
    plan: MixedPlan
    estimate: object  # autopar.mixed.cost.MixedEstimate
    single: dict  # group name -> (Plan, Estimate) of that group alone at the whole batch, or None (no plan)
    seconds: float  # wall time of the search
    method: str
    exact: bool  # whether every part the method searches exactly was finished (no time limit hit)

    @property
    def best_single(self) -> tuple[str, Plan, object] | None:
        """(group, plan, estimate) of the fastest group alone, or None when no group holds a plan alone."""
        found = [(g, *v) for g, v in self.single.items() if v is not None]
        return min(found, key=lambda x: x[2].iteration_time_s) if found else None

    @property
    def gain(self) -> float | None:
        """Predicted tokens/s of the mixed plan over the best single group's (None: no single plan)."""
        best = self.best_single
        return None if best is None else self.estimate.tokens_per_s / best[2].tokens_per_s


class _Lanes:
    """Each group's best homogeneous plan at a share, memoised: (Plan, seconds) or None (no plan). With
    `narrow`, the best whose gradients cross the lanes in the 16-bit training dtype (the knob held there)."""

    def __init__(self, mw, method: str, deadline: float):
        self.mw, self.method, self.deadline = mw, method, deadline
        self.planner = get_planner("rl", **RL_OPTIONS) if method == "rl" else ExhaustivePlanner()
        self.memo: dict = {}
        self.proposed: dict[str, list[Plan]] = {}  # rl: the policy's plans per group, which other shares re-batch
        self.asked: set = set()  # rl: (group, share) the policy planned
        self.finished: set = set()  # rl: (group, share) the exact homogeneous search planned
        self.cut = False  # a share left unpriced for the time limit
        dtype = storage_dtype(mw.precision)
        self.narrow_dtype = None if dtype == "fp32" else dtype

    def best(self, group: str, share: int, required: bool = False, narrow: bool = False) -> tuple[Plan, float] | None:
        key = (group, share, narrow)
        if key in self.memo:
            return self.memo[key]
        if narrow:
            wide = self.best(group, share)
            if wide is not None and wide[0].grad_comm_dtype == self.narrow_dtype:
                return wide
        if not required and time.perf_counter() > self.deadline:
            self.cut = True
            return None
        workload = self.mw.on_group(group, self.mw.cluster.group(group).num_gpus, share)
        if narrow and not isinstance(self.planner, ExhaustivePlanner):
            found = self._narrowed(workload, wide)  # the policy's masks cannot hold this knob (see _narrowed)
            self.memo[key] = found
            return found
        if narrow:
            workload = dataclasses.replace(workload, fixed=(("grad_comm_dtype", self.narrow_dtype),))
        if not isinstance(self.planner, ExhaustivePlanner) and not required and self.proposed.get(group):
            found = rebatched(workload, self.proposed[group])  # the policy's plans at this share: no policy call
            self.memo[key] = found
            return found
        try:
            if isinstance(self.planner, ExhaustivePlanner):
                pa, res = self.planner.ranked(workload, 1)
                found = (pa.plan(0), float(res["iteration_time"][0]))
            else:
                found = self._propose(group, workload)
        except NoValidPlanError:
            found = None
        self.memo[key] = found
        return found

    def _propose(self, group: str, workload) -> tuple[Plan, float]:
        plan = self.planner.propose(workload, 1)[0]
        self.proposed.setdefault(group, []).append(plan)
        return plan, estimate(workload, plan).iteration_time_s

    def finish(self, group: str, share: int) -> None:
        """rl: `group`'s lane at `share` planned by the exact homogeneous search (kept where faster than what
        stood), and that plan re-batched to the other shares priced so far (kept there where faster): the
        policy proposes the groups and shares, the exact search finishes the chosen ones. Where a group alone
        or a chosen lane was the answer, the greedy policy's plan fell short (down to 0.77 of the exact search)."""
        if isinstance(self.planner, ExhaustivePlanner) or (group, share) in self.finished \
                or time.perf_counter() > self.deadline:
            return
        self.finished.add((group, share))
        workload = self.mw.on_group(group, _gpus(self.mw, group), share)
        try:
            pa, res = ExhaustivePlanner(per_stage=RL_FINISH_PER_STAGE).ranked(workload, RL_FINISH_PLANS)
        except NoValidPlanError:
            return
        plans = [pa.plan(i) for i in range(len(pa))]  # the best and its runners-up of other layouts
        self.proposed.setdefault(group, []).extend(plans)
        self._keep_if_faster(group, share, (plans[0], float(res["iteration_time"][0])))
        for other in sorted(k[1] for k in self.memo if k[0] == group and not k[2] and k[1] != share):
            found = rebatched(self.mw.on_group(group, _gpus(self.mw, group), other), plans)
            if found is not None:
                self._keep_if_faster(group, other, found)

    def ask(self, group: str, share: int) -> None:
        """rl: the policy's plan at `share`, or its plans re-batched there where faster (kept if faster than what stood)."""
        if isinstance(self.planner, ExhaustivePlanner) or time.perf_counter() > self.deadline \
                or (group, share) in self.asked:
            return
        self.asked.add((group, share))
        workload = self.mw.on_group(group, _gpus(self.mw, group), share)
        try:
            found = self._propose(group, workload)
        except NoValidPlanError:
            return
        found = min(filter(None, [found, rebatched(workload, self.proposed[group])]), key=lambda f: f[1])
        self._keep_if_faster(group, share, found)

    def _keep_if_faster(self, group: str, share: int, found: tuple[Plan, float]) -> None:
        """`found` becomes the lane's plan at `share` where it beats what stood (its 16-bit twin then re-derived)."""
        held = self.memo.get((group, share, False))
        if held is None or found[1] < held[1]:
            self.memo[(group, share, False)] = found
            self.memo.pop((group, share, True), None)

    def _narrowed(self, workload, wide) -> tuple[Plan, float] | None:
        """The rl planner's plan with its gradients reduced in the 16-bit dtype (not a search held at that
        width: the environment's lean completion of a held grad_comm_dtype fails on plans without dp)."""
        if wide is None or wide[0].dp == 1:
            return None
        try:
            plan = wide[0].with_(grad_comm_dtype=self.narrow_dtype)
            est = estimate(workload, plan)
        except PlanError:
            return None
        return (plan, est.iteration_time_s) if est.fits else None

    def table(self, group: str, units: int, q: int, ks, narrow: bool = False, below: float = math.inf) -> list[float]:
        """Lane times of `group` at k units (k in `ks` where the wide plan is faster than `below`; inf
        elsewhere), index 0 unused."""
        out = [math.inf] * (units + 1)
        for k in ks:
            wide = self.best(group, k * q)
            found = wide if not narrow or wide is None or wide[1] >= below else self.best(group, k * q, narrow=True)
            out[k] = math.inf if found is None or found[1] >= below else found[1]
        return out


def rebatched(workload, plans: list[Plan]) -> tuple[Plan, float] | None:
    """The fastest of `plans` (a group's plans at other shares) re-batched to `workload`'s global batch:
    the same degrees and knobs, every micro-batch size dividing a replica's samples (the count to match),
    one vectorised pricing; None when none is valid and fits. What rl prices most shares with."""
    out = []
    for plan in plans:
        if workload.global_batch % plan.dp:
            continue
        per = workload.global_batch // plan.dp
        for mbs in (m for m in range(1, per + 1) if per % m == 0):
            try:
                candidate = plan.with_(micro_batch_size=mbs, num_micro_batches=per // mbs)
                candidate.validate(workload)
            except PlanError:
                continue
            if candidate not in out:
                out.append(candidate)
    if not out:
        return None
    res = evaluate(workload, PlanArrays.from_plans(out, workload.profile))
    times = np.where(res["fits"], res["iteration_time"], np.inf)
    i = int(np.argmin(times))
    return (out[i], float(times[i])) if np.isfinite(times[i]) else None


def lane_of(group: str, plan: Plan) -> Lane:
    """A lane of one group: the homogeneous plan on that group's GPUs."""
    return Lane((Segment(group, plan.tp, plan.pp),), plan)


def search_mixed(mw, method: str = "exhaustive", time_limit: float | None = None,
                 every_group: bool = False) -> MixedResult:
    """The best mixed plan `method` finds for `mw` (a MixedWorkload); see the module docstring.
    `time_limit` (seconds) stops pricing new shares once spent (the result then says exact=False);
    each group alone is always priced. `every_group`: only plans that use every group (lanes over all of
    them, or the pipeline spanning them): what an elastic job whose ranks all run needs. NoValidPlanError
    when no kind of plan fits."""
    if method not in METHODS:
        raise AutoparError(f"unknown mixed search method {method!r}; choose one of {', '.join(METHODS)}")
    started = time.perf_counter()
    deadline = math.inf if time_limit is None else started + time_limit
    lanes = _Lanes(mw, method, deadline)
    names, batch = mw.cluster.group_names, mw.global_batch
    q = quantum(batch, GRID)
    units = batch // q
    single = {}
    if method == "rl":
        alone = {g: lanes.best(g, batch, required=True) for g in names}
        fastest = min((v[1] for v in alone.values() if v), default=math.inf)
        for g in names:  # each group alone that could be the fastest, finished by the exact homogeneous search
            if alone[g] and alone[g][1] <= RL_ALONE_SLACK * fastest:
                lanes.finish(g, batch)
    for g in names:
        found = lanes.best(g, batch, required=True)
        single[g] = None if found is None else (found[0], estimate(mw.on_group(g, _gpus(mw, g), batch), found[0]))
    candidates = [MixedPlan((lane_of(g, v[0]),)) for g, v in single.items() if v is not None and not every_group]
    speed = {g: v[1].tokens_per_s for g, v in single.items() if v is not None}
    subsets = (lambda: [tuple(names)]) if every_group else (lambda: _subsets(names, speed))  # noqa: E731
    near = _proportional(speed, names, units)
    if method != "metis":  # rl re-batches its policy's plans to every share (no policy call: cheap)
        ks = {g: range(1, units + 1) for g in names}
        for g in names if method == "rl" and len(speed) > 1 else ():  # and its plans at the proportional shares
            lanes.ask(g, near[g] * q)
    else:
        ks = {g: [near[g]] for g in names}
    if method == "exhaustive" and len(names) == 2:  # the proportional shares first: a bound that prunes pairs
        first = {g: lanes.table(g, units, q, [near[g]]) for g in names}
        candidates += [mp for _, mp in _lane_plans(lanes, first, [names], units, q)]  # the bound's own plan: the
        _, upper = _fastest(mw, candidates)  # pruning below drops splits that only tie it (it once dropped it)
        floor = cross_sync(mw, [sync_probe(mw, g, lanes.narrow_dtype or "fp32") for g in names])
        wide = _pair_tables(lanes, names, units, q, single,
                            math.inf if upper is None else upper.iteration_time_s - floor)
    else:
        wide = {g: lanes.table(g, units, q, ks[g]) for g in names}
    found = [mp for _, mp in _lane_plans(lanes, wide, subsets(), units, q)]
    for round_ in range(RL_FINISH_ROUNDS if method == "rl" else 0):  # the best lanes finished exactly, the DP again
        best, _ = _fastest(mw, found)
        todo = [] if best is None else _finishing(lanes, best, q, neighbours=round_ == 0)
        if not todo:
            break
        for g, share in todo:
            lanes.finish(g, share)
        wide = {g: lanes.table(g, units, q, ks[g]) for g in names}
        found = [mp for _, mp in _lane_plans(lanes, wide, subsets(), units, q)]
    candidates += found
    spanning = None
    if method != "rl":
        spanning = search_spanning(mw, speed, exact=method == "exhaustive", deadline=deadline)
    elif every_group or _weigh_spanning(*_fastest(mw, candidates)):  # rl: see the docstring
        spanning = search_spanning(mw, speed, exact=True, top=1, deadline=deadline, quick=True,
                                   walk_deadline=time.perf_counter() + RL_SPANNING_S)
    if spanning is not None:
        candidates.append(MixedPlan((spanning,)))
    best, best_est = _fastest(mw, candidates)
    if lanes.narrow_dtype is not None:  # lanes whose gradients cross in 16 bits: a cheaper cross-lane all-reduce
        for used in subsets():
            bound = (math.inf if best_est is None else best_est.iteration_time_s) - cross_sync(
                mw, [sync_probe(mw, g, lanes.narrow_dtype) for g in used])
            if best_shares([wide[g] for g in used], units)[0] >= bound:
                continue  # a held knob never makes a lane faster: these lanes cannot beat the best
            narrow = {g: lanes.table(g, units, q, [k for k in ks[g] if wide[g][k] < bound], narrow=True, below=bound)
                      for g in used}
            found = [mp for _, mp in _lane_plans(lanes, narrow, [used], units, q, narrow=True)]
            best, best_est = _fastest(mw, found, best, best_est)
    if best is None and every_group:
        raise NoValidPlanError(f"{mw.profile.name} fits no plan on {mw.cluster.name} that uses every group: no "
                               f"data-parallel lanes over all of them and no pipeline across them fit in memory; "
                               f"use fewer groups, more GPUs, or a smaller global batch")
    if best is None:
        raise NoValidPlanError(f"{mw.profile.name} fits no plan on {mw.cluster.name}: no group alone, no "
                               f"data-parallel lanes and no pipeline across the groups fit in memory; use more "
                               f"GPUs, GPUs with more memory, or a smaller global batch")
    ended = time.perf_counter()
    return MixedResult(best, best_est, single, ended - started, method, not lanes.cut and ended <= deadline)


def _weigh_spanning(best, best_est) -> bool:
    """rl: whether the spanning pipeline is worth its walk: no plan fits, no data-parallel lanes beat a group
    alone, or the best lanes spend RL_SPANNING_SYNC or more of their step in the cross-group all-reduce, which
    a pipeline across the groups does without (it sends activations; 0.79 of the exact search without it)."""
    return best is None or len(best.lanes) == 1 \
        or best_est.cross_sync_s >= RL_SPANNING_SYNC * best_est.iteration_time_s


def _finishing(lanes: _Lanes, best: MixedPlan, q: int, neighbours: bool) -> list[tuple[str, int]]:
    """rl: the (group, share) the exact search finishes for the best lanes: each lane's own share, and with
    `neighbours` the next split over: the slowest lane one unit less, the fastest one unit more (a share the
    re-batched plans price poorly may hold a better layout: 0.95 of the exact search without it)."""
    shares = [(lane.segments[0].group, lane.share) for lane in best.lanes]
    if neighbours and len(shares) > 1:
        times = [lanes.memo.get((g, k, False), (None, math.inf))[1] for g, k in shares]
        slow, fast = max(range(len(shares)), key=times.__getitem__), min(range(len(shares)), key=times.__getitem__)
        if shares[slow][1] > q and slow != fast:
            shares += [(shares[slow][0], shares[slow][1] - q), (shares[fast][0], shares[fast][1] + q)]
    return [gk for gk in shares if gk not in lanes.finished]


def _gpus(mw, group: str) -> int:
    return mw.cluster.group(group).num_gpus


def _proportional(speed: dict, names, units: int) -> dict[str, int]:
    """Units per group proportional to its speed (largest remainder, each group >= 1 unit where the
    units allow); a group without a single plan gets the mean speed of the others (or 1)."""
    mean = sum(speed.values()) / len(speed) if speed else 1.0
    s = [speed.get(g, mean) for g in names]
    raw = [units * x / sum(s) for x in s]
    out = [max(1, int(r)) for r in raw]
    while sum(out) < units:
        i = max(range(len(out)), key=lambda i: raw[i] - out[i])
        out[i] += 1
    while sum(out) > units and max(out) > 1:
        i = max(range(len(out)), key=lambda i: out[i] - raw[i] if out[i] > 1 else -math.inf)
        out[i] -= 1
    return dict(zip(names, out))


def _subsets(names, speed: dict):
    """The sets of used groups (two or more) the lanes are solved for: all of them up to
    MAX_SUBSETS_GROUPS groups, else the fastest k groups for each k."""
    if len(names) <= MAX_SUBSETS_GROUPS:
        for r in range(2, len(names) + 1):
            yield from itertools.combinations(names, r)
        return
    ranked = sorted(names, key=lambda g: -speed.get(g, 0.0))
    for r in range(2, len(names) + 1):
        yield tuple(g for g in names if g in ranked[:r])


def _pair_tables(lanes: _Lanes, names, units: int, q: int, single: dict, upper: float) -> dict[str, list[float]]:
    """The two groups' lane times on the grid, leaving out what cannot help: a split (k, units - k) whose
    lane priced first (the one the singles predict slower) takes `upper` or more cannot beat the best plan
    found (the step is at least its slowest lane plus the least cross-lane all-reduce), so its other lane is
    not priced. Exact: every split that could win is priced whole."""
    out = {g: [math.inf] * (units + 1) for g in names}

    def guess(g, k):
        return math.inf if single[g] is None else single[g][1].iteration_time_s * k / units

    for k in range(1, units):
        pair = sorted([(names[0], k), (names[1], units - k)], key=lambda gk: -guess(*gk))
        for g, units_g in pair:
            found = lanes.best(g, units_g * q)
            out[g][units_g] = math.inf if found is None else found[1]
            if out[g][units_g] >= upper:
                break
    return out


def _lane_plans(lanes: _Lanes, tables: dict, subsets, units: int, q: int, narrow: bool = False):
    """For each set of used groups, (slowest lane, the lanes) with the shares minimising the slowest lane."""
    out = []
    for used in subsets:
        slowest, split = best_shares([tables[g] for g in used], units)
        if math.isfinite(slowest):
            plans = [lanes.best(g, k * q, narrow=narrow)[0] for g, k in zip(used, split)]
            out.append((slowest, MixedPlan(tuple(lane_of(g, p) for g, p in zip(used, plans)))))
    return out


def _fastest(mw, plans, best=None, best_est=None):
    """The fastest of `plans` that fits (by `estimate_mixed`), or (best, best_est) when none beats them."""
    for mp in plans:
        est = estimate_mixed(mw, mp)
        if est.fits and (best_est is None or est.iteration_time_s < best_est.iteration_time_s):
            best, best_est = mp, est
    return best, best_est
