"""Local refinement of decoded plans: coordinate descent over the decisions, with the cost model.

A policy that is right about most knobs and slightly off about one (a micro-batch one notch too
large, the second-best recompute count) loses a few percent; the cost model finds that notch
cheaply. From a plan, one round evaluates every plan that differs from it in one decision (each
value the space allows for that knob, given the knobs before it), keeping the later decisions
where they are still valid and re-opening those that the change made invalid (a new tensor
degree changes dp, so the micro-batch is chosen again); the fastest fitting neighbour replaces
the plan when it is faster, and rounds repeat until none is; then a round of pairs of changes
(a micro-batch with the recompute it allows), and single changes again after a pair helped,
until neither helps or the evaluation budget is spent.
Every plan walked is counted, so the planner's reported evaluations stay honest.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from autopar.cost import PlanArrays, evaluate
from autopar.envs.knobs import PlanSpace
from autopar.search import space as walker

MAX_ROUNDS = 12  # rounds per start; in practice a few reach a local optimum
BUDGET = 30_000  # cost-model evaluations per start, at most (a round of single changes is a few hundred)
GAIN = 1e-6  # a neighbour must be faster by more than this share to move


@dataclass(frozen=True)
class Refined:
    prefix: tuple  # the decision values of the best plan found
    time_s: float  # its predicted iteration time (inf: the start did not fit and no neighbour did)
    evaluations: int  # plans the cost model evaluated


def _only(value):
    return lambda opts: [v for v in opts if v == value]


def _keep_or_reopen(value):
    return lambda opts: [value] if value in opts else list(opts)


def neighbours(space: PlanSpace, prefix: tuple, changed: tuple[int, ...]):
    """The plans that change the decisions at indices `changed` of `prefix` (every other decision
    kept where still valid, re-opened where the change made it invalid), as a Walk and PlanArrays."""
    pick = {name: _keep_or_reopen(v) for n, (name, v) in enumerate(zip(space.names, prefix)) if n not in changed}
    w = walker.walk(space.workload, pick, space.choices_memo)
    return w, walker.to_arrays(w, space.table)


def moves(n: int, width: int) -> list[tuple[int, ...]]:
    """The sets of decisions one round changes: each one alone, or (width 2) each pair."""
    return [(i,) for i in range(n)] if width == 1 else list(itertools.combinations(range(n), 2))


def refine(space: PlanSpace, prefix: tuple, budget: int = BUDGET, rounds: int = MAX_ROUNDS,
           seen: dict | None = None) -> Refined:
    """Steepest-descent coordinate search from a complete decision sequence: rounds of single
    changes while they help, then a round of pairs of changes (a micro-batch with the recompute
    it allows, a pipeline degree with the mesh order) when they stop helping. `seen` keeps the
    fastest neighbour of each (plan, change) across calls: starts whose paths meet pay once, and
    only plans evaluated are counted."""
    seen = {} if seen is None else seen
    spent = 0

    def fastest_of(plan: tuple, round_moves, force: bool = False) -> list[tuple[tuple | None, float]]:
        """The fastest neighbour of `plan` for each change of a round, the round's new neighbours
        walked until the budget is spent and priced in one evaluation (which moves a round tries
        depends on plan counts only, never on their times, so this is the one-by-one search's result)."""
        nonlocal spent
        walks, tried = [], []
        for changed in round_moves:
            if spent >= budget and not force:
                break
            tried.append(changed)
            if (plan, changed) not in seen:
                w, pa = neighbours(space, plan, changed)
                spent += len(pa)
                walks.append(((plan, changed), (w, pa)))
        for key, found in zip(dict(walks), _fastest_each(space, [wp for _, wp in walks])):
            seen[key] = found
        return [seen[plan, changed] for changed in tried]

    best, best_time = prefix, fastest_of(prefix, [()], force=True)[0][1]  # no change: the start itself
    width = 1
    for _ in range(rounds):
        if not np.isfinite(best_time) or spent >= budget:
            break  # the start does not fit (nothing to descend from), or the budget is spent
        moved = None
        for found in fastest_of(best, moves(len(space.names), width)):
            if found[1] < best_time * (1 - GAIN) and (moved is None or found[1] < moved[1]):
                moved = found
        if moved is None:
            if width == 2 or spent >= budget:
                break
            width = 2
            continue
        (best, best_time), width = moved, 1
    return Refined(best, best_time, spent)


def _fastest_each(space: PlanSpace, walks: list) -> list[tuple[tuple | None, float]]:
    """The decision values and time of the fastest fitting plan of each walk (None, inf: none fits),
    all walks' plans priced by one call of the cost model (its fixed cost, a few milliseconds, is most
    of a small walk's)."""
    sizes = [len(pa) for _, pa in walks]
    if not sum(sizes):
        return [(None, np.inf)] * len(walks)
    res = evaluate(space.workload, PlanArrays.joined([pa for _, pa in walks if len(pa)]), space.coeffs)
    out, start = [], 0
    for (w, _), n in zip(walks, sizes):
        fits, times = res["fits"][start:start + n], res["iteration_time"][start:start + n]
        start += n
        fit = np.flatnonzero(fits)
        if not len(fit):
            out.append((None, np.inf))
            continue
        j = int(fit[np.argmin(times[fit])])
        out.append((tuple(w.value(name, j) for name in space.names), float(times[j])))
    return out
