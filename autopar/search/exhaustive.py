"""The oracle: every plan of the space through the vectorised cost model, in chunks, and then the
per-stage plans (issue 41): the best uniform outer plans finished by the exact per-stage solver
(autopar/search/stages.py), each skipped when a valid lower bound says it cannot beat the best found."""

from __future__ import annotations

import dataclasses

import numpy as np

from autopar import axes
from autopar.cost import Coefficients, PlanArrays, evaluate
from autopar.errors import NoValidPlanError
from autopar.plan import Plan
from autopar.search.base import Planner
from autopar.errors import PlanError
from autopar.search import stages
from autopar.search.simplicity import TIE, simplest_first, tie_buckets
from autopar.search.pricing import PricedSpace, kth_distinct, structure_fields
from autopar.search.space import degree_choices, enumerate_plans

CHUNK = 1 << 17
SOLVE_BATCH = 16  # outer plans per call of the per-stage solver
MAX_OUTER = 512  # outer plans the per-stage solver finishes at most per search (`exact` says if that cut it short)
PROMISING = 16  # of those at most, the outer plans of the fastest uniform plans that fit (`_promising`)


def distinct(pa: PlanArrays, order, k: int, fields: list[str] | None = None, accept=None,
             seen: set | None = None) -> list[int]:
    """The first k rows in `order` whose structure (`fields`, default `structure_fields()`) no
    earlier row nor `seen` has, among those `accept(row)` takes (default: all)."""
    names = fields or structure_fields()
    chosen, seen = [], set() if seen is None else seen
    for i in order:
        if len(chosen) >= k:
            break
        key = tuple(float(pa.columns[f][i]) for f in names)
        if key not in seen and (accept is None or accept(int(i))):
            seen.add(key)
            chosen.append(int(i))
    return chosen


class ExhaustivePlanner(Planner):
    name = "exhaustive"

    def __init__(self, coeffs: Coefficients | None = None, per_stage: bool = True, prune: bool = True):
        super().__init__()
        self.coeffs = coeffs
        self.per_stage = per_stage  # finish the outer plans with the per-stage solver
        self.prune = prune  # price a plan with recompute only where its floor says it could matter (`pricing`)
        self.plans = 0  # plans in the space of the last ranked() (`evaluations` of them priced)
        self.solved = 0  # outer plans the per-stage solver finished in the last ranked()
        self.exact = True  # whether it finished every outer plan its lower bound could not rule out

    def propose(self, workload, k: int = 1) -> list[Plan]:
        pa, _ = self.ranked(workload, k)
        return [pa.plan(i) for i in range(len(pa))]

    def ranked(self, workload, k: int) -> tuple[PlanArrays, dict[str, np.ndarray]]:
        """The k best plans that fit, with their cost-model results, best first. Plans within
        0.5% (simplicity.TIE) of each other count as ties, broken towards the simplest plan, and a plan that
        differs from a better one only in a data-parallel detail (ZeRO, buckets, gradient
        dtype, offload, mesh order) is left out, so the runners-up are real alternatives."""
        space = enumerate_plans(workload)
        if len(space) == 0:
            raise no_plan_error(workload)
        per_stage = self.per_stage and "recompute" not in dict(getattr(workload, "fixed", ()))
        priced = PricedSpace(workload, space, self.coeffs, CHUNK, k, keep=max(64, 32 * k), ranks=per_stage,
                             promising=PROMISING if per_stage else 0, outers=4 * PROMISING, prune=self.prune)
        self.evaluations, self.plans = priced.count, len(space)
        rows, fitting = priced.shortlist()
        fastest = float(priced.time[priced.fits].min(initial=np.inf))
        least_memory = float(np.nanmin(priced.memory))
        outer, bounds = [np.zeros(0, dtype=np.int64)], [np.zeros(0)]
        if per_stage:  # the plans without recompute stand for their outer plans (recompute is the solver's)
            for plain, ranked in priced.ranked:
                # the per-stage target is below the fastest uniform plan: an outer plan bounded above it never runs
                bound = stages.lower_bound(space.take(plain), ranked, workload.memory_budget, below=fastest)
                keep = bound < fastest
                outer.append(plain[keep])
                bounds.append(bound[keep])
        self.solved, self.exact = 0, True
        if len(rows) == 0:
            staged = self._per_stage(workload, space, priced, [], outer, bounds, fitting, np.inf) if per_stage else None
            if staged is None:
                raise memory_error(workload, least_memory)
            best = PlanArrays.from_plans([staged], workload.profile)
            return best, evaluate(workload, best, self.coeffs)
        shortlist = space.take(rows)
        times = evaluate(workload, shortlist, self.coeffs)["iteration_time"]
        # only the tie buckets down to the k-th distinct structure can hold the answer: those become Plans
        i = kth_distinct(shortlist.columns, times, k)
        buckets = tie_buckets(times)
        band = np.flatnonzero(buckets <= (buckets.max() if i is None else buckets[i]))
        plans = [shortlist.plan(int(j)) for j in band]
        order = [band[j] for j in simplest_first(plans, times[band])]
        best = shortlist.take(np.array(distinct(shortlist, order, k)))
        results = evaluate(workload, best, self.coeffs)
        staged = None
        if per_stage:  # worth a place only beyond the tie band of the best uniform plan (which is simpler)
            first = [shortlist.plan(int(j)) for j in distinct(shortlist, order, SOLVE_BATCH)]
            staged = self._per_stage(workload, space, priced, first, outer, bounds, fitting,
                                     float(results["iteration_time"][0]) * (1 - TIE))
        if staged is not None:
            best = PlanArrays.from_plans([staged] + [best.plan(i) for i in range(min(k - 1, len(best)))],
                                         workload.profile)
            results = evaluate(workload, best, self.coeffs)
        return best, results

    def _per_stage(self, workload, space: PlanArrays, priced: PricedSpace, first: list, outer: list, bounds: list,
                   fitting: np.ndarray, target: float) -> Plan | None:
        """The best per-stage plan faster than `target`, or None. The outer plans of the best uniform plans
        (`first`) come first; then, batch by batch, up to PROMISING outer plans of the fastest uniform plans
        that fit (`fitting`: an outer plan whose uniform plan is fast is often fastest per stage, whatever its
        bound) beside the rows of `space` without recompute in order of their lower bounds
        (`stages.lower_bound`), until the next bound cannot beat the best found, which is exact (a skipped
        plan's optimum is at least its bound), or until MAX_OUTER outer plans (`exact` False)."""
        outer, bounds = np.concatenate(outer), np.concatenate(bounds)
        order = np.argsort(bounds, kind="stable")
        outer, bounds = outer[order], bounds[order]
        promising = self._promising(workload, space, priced, fitting)
        best, best_time, seen, skeletons = None, target, set(), {}
        queue = [stages.outer_of(p) for p in first]
        position = 0
        while True:
            while promising and len(queue) < SOLVE_BATCH // 2:  # half a batch of them
                plan, bound = promising.pop(0)
                if bound < best_time and plan not in seen and plan not in queue:
                    queue.append(plan)
            while len(queue) < SOLVE_BATCH and position < len(outer) and bounds[position] < best_time:
                queue.append(space.plan(int(outer[position])))
                position += 1
            batch = [p for p in dict.fromkeys(stages.outer_of(p) for p in queue)
                     if p not in seen and stages.worth_solving(p, workload.profile)]
            queue = []
            if not batch:
                if position >= len(outer) or bounds[position] >= best_time:
                    break
                continue
            if self.solved >= MAX_OUTER:
                self.exact = False
                break
            if len(batch) > MAX_OUTER - self.solved:
                batch, self.exact = batch[:MAX_OUTER - self.solved], False
            seen.update(batch)
            for found in stages.solve(workload, batch, self.coeffs, target=best_time, skeletons=skeletons):
                self.solved += 1
                if found is None or not found.fits or found.iteration_time >= best_time:
                    continue
                try:
                    found.plan.validate(workload)  # what the runtime runs (capability rules)
                except PlanError:
                    continue
                best, best_time = found.plan, found.iteration_time
        return best

    def _promising(self, workload, space: PlanArrays, priced: PricedSpace, fitting: np.ndarray
                   ) -> list[tuple[Plan, float]]:
        """The distinct outer plans (worth solving) of the fastest uniform plans that fit, fastest first, at
        most PROMISING, each with its lower bound."""
        plans = [stages.outer_of(space.plan(i)) for i in priced.promising_rows(fitting)]
        if not plans:
            return []
        return list(zip(plans, stages.outer_bounds(workload, plans, self.coeffs).tolist()))


def no_plan_error(workload) -> NoValidPlanError:
    """Explain why the space is empty: the batch admits no data-parallel degree, or the GPU count
    cannot be split into tensor x pipeline degrees the model allows."""
    n, batch = workload.world_size, workload.global_batch
    held = getattr(workload, "fixed", ())
    if held and degree_choices(dataclasses.replace(workload, fixed=())):  # `--fix` emptied it
        return NoValidPlanError(f"no plan for global batch {batch} on {n} GPUs has "
                                + ", ".join(f"{name}={value}" for name, value in held))
    if not degree_choices(workload):

        dp = axes.derived_axis()  # the degrees the other axes allow, whatever the batch
        dps = sorted({d[dp] for d in axes.feasible_degrees(workload, unchecked=(dp,))})
        return NoValidPlanError(
            f"global batch {batch} is not divisible by any data-parallel degree possible on {n} GPUs "
            f"(dp must be one of {dps}); use a global batch that is a multiple of {dps[0]}")
    return NoValidPlanError(f"no plan for global batch {batch} on {n} GPUs")


def memory_error(workload, least_bytes: float) -> NoValidPlanError:
    gpu = workload.cluster.gpu
    need_gpus = int(np.ceil(workload.world_size * least_bytes / workload.memory_budget))
    return NoValidPlanError(
        f"{workload.profile.name} fits no plan on {workload.world_size} x {gpu.name}: the leanest plan needs "
        f"{least_bytes / 1e9:.1f} GB per GPU but {workload.memory_budget / 1e9:.1f} GB of a GPU's "
        f"{gpu.memory_bytes / 1e9:.0f} GB are usable (memory headroom {workload.memory_headroom:.0%}); use about "
        f"{need_gpus} or more GPUs, GPUs with more memory, or a smaller global batch")
