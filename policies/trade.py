"""Degree trades: the refinement's move between parallel layouts, which one-knob changes cannot make.

Coordinate descent (`policies/refine.py`) changes one decision at a time and keeps the others
where they are still valid. Between two layouts that is too little: from dp32 x pp10 (ZeRO-2,
selective recompute, 160 micro-batches of 1) to dp320 x pp1 the micro-batching, ZeRO stage,
recompute, offload and compile must all change with the degrees, and every plan on the way is
slower or does not fit. A trade moves a factor from one axis to another with the world size
kept: one or two explicit degrees change and data parallelism, the derived axis, takes up the
difference (dp <-> tp, dp <-> pp, dp <-> cp; tp <-> pp with their product kept; or dp32 x tp2 x
pp8 to dp512 x tp1 x pp1 at once, where neither half alone is faster). The decisions after
the degrees (a folded axis such as ep among them) are then chosen again by the policy,
conditioned on the new degrees (greedy decoding from them): the policy was trained to choose
micro-batching, ZeRO and recompute for whatever degrees it is given. The fastest
completion that beats the current plan is refined by coordinate descent and becomes the
current plan; trades repeat from it until none is faster or the evaluation budget is spent.
Each layout is completed once; every plan the cost model sees is counted.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from autopar import axes
from autopar.cost import PlanArrays, evaluate
from autopar.envs.knobs import PlanSpace
from autopar.errors import PlanError
from autopar.knobs import knobs
from autopar.plan import Plan
from autopar.policies.decode import beam_searches
from autopar.policies.refine import GAIN, Refined, refine
from autopar.search import stages
from autopar.search.space import choices, plan_of, values_of

Completion = Callable[[list[tuple]], "list[tuple | None]"]  # layouts -> their complete decision sequences (None:
# none fits), all at once: the policy's decodes run in lockstep
MAX_CHANGED = 2  # explicit degrees one trade changes (dp, derived, takes up the difference)
BUDGET = 20_000  # cost-model evaluations of the trades (completions' masks, refinements): no round starts
# past it; a round itself is not cut short (one round may complete every layout: up to about 15,000 more)


def degree_count(space: PlanSpace) -> int:
    """How many leading decisions are explicit axis degrees (tp, pp, cp: the layout). A folded
    axis (ep, a split of dp x cp's ranks) is no part of it: the policy chooses it with the rest."""
    return next((n for n, name in enumerate(space.names) if name not in axes.AXES), len(space.names))


def layouts(space: PlanSpace) -> list[tuple]:
    """Every layout of the space (the explicit degrees' values), from the choices alone: no plan
    is evaluated (a layout none of whose plans fits has no completion)."""
    n = degree_count(space)
    out, stack = [], [()]
    while stack:
        prefix = stack.pop()
        if len(prefix) == n:
            out.append(prefix)
        else:
            stack.extend(prefix + (v,) for v in space.choices(prefix))
    return sorted(out)


def is_trade(a: tuple, b: tuple) -> bool:
    """Whether layout b is one trade away from layout a: one or two explicit degrees changed, data
    parallelism (derived: the world size over the others) taking up the difference, so a factor
    moves between dp and one axis, between two axes (their product kept), or among dp and two."""
    return 0 < sum(x != y for x, y in zip(a, b)) <= MAX_CHANGED


def policy_completion(actor, space: PlanSpace, features) -> Completion:
    """The policy's plan for each layout: greedy decoding of the decisions after the degrees (None: no plan of
    the layout fits), the layouts' decodes in lockstep (`decode.beam_searches`)."""
    def complete(targets: list[tuple]) -> list[tuple | None]:
        space.prefetch(targets)
        open_ = [t for t in targets if space.step(t).allowed.any()]
        decoded = dict(zip(open_, beam_searches(actor, space, features, 1, open_)))
        return [decoded[t][0].prefix if decoded.get(t) else None for t in targets]
    return complete


def trade(space: PlanSpace, start: Refined, complete: Completion, seen: dict | None = None,
          budget: int = BUDGET, completions: list | None = None) -> Refined:
    """From a refined plan: complete every layout one trade away (`complete`: the policy's
    `policy_completion`), refine the fastest completion when it beats the current plan, and
    repeat from the result. `seen` is coordinate descent's memo (shared with the planner's other
    starts). The evaluations counted are the completions' estimates and the refinements' (the
    masks' are in space.evaluations). Every completion's decisions are appended to `completions`
    when one is given (the rl planner's per-stage finish weighs them: a layout that a balanced split
    makes slow can be the fastest per stage)."""
    seen = {} if seen is None else seen
    best, spent, tried = start, 0, set()
    n, all_layouts = degree_count(space), layouts(space)
    masks_before = space.evaluations
    while np.isfinite(best.time_s) and spent + space.evaluations - masks_before < budget:
        tried.add(best.prefix[:n])
        targets = [t for t in all_layouts if t not in tried and is_trade(best.prefix[:n], t)]
        tried.update(targets)
        completed = [p for p in complete(targets) if p is not None]
        if completions is not None:
            completions.extend(completed)
        if not completed:
            break
        spent += len(completed)
        res = evaluate(space.workload, PlanArrays.from_plans([space.plan(p) for p in completed], space.workload.profile),
                       space.coeffs)
        times = np.where(res["fits"], res["iteration_time"], np.inf)
        j = int(np.argmin(times))
        if not times[j] < best.time_s * (1 - GAIN):
            break
        found = refine(space, completed[j], seen=seen)
        spent += found.evaluations
        best = Refined(found.prefix, found.time_s, 0)
    return Refined(best.prefix, best.time_s, spent)


def traded_outer_plans(space: PlanSpace, plan: Plan) -> list[Plan]:
    """`plan`'s outer plan (`stages.outer_of`) in every layout one trade away, its micro-batches the batch's at
    the new data-parallel degree, its other knobs kept where the space still offers them (else its first
    choice: sequence parallelism off at tp 1, a folded degree back to 1): candidates for the per-stage
    solver where no uniform plan of the layout fits, so neither the policy (its masks allow only plans that
    fit) nor the trades' completions offer one. Each at the plan's micro-batch size and at 1, what memory a
    per-stage plan needs most often allows."""
    workload, n = space.workload, degree_count(space)
    names = space.names[:n]
    here = tuple(getattr(plan, a) for a in names)
    outer = values_of(stages.outer_of(plan))
    out: list[Plan] = []
    for layout in layouts(space):
        if not is_trade(here, layout) or workload.world_size % int(np.prod(layout)):
            continue
        dp = workload.world_size // int(np.prod(layout))  # the derived axis takes the rest of the GPUs
        for size in dict.fromkeys((plan.micro_batch_size, 1)):
            if workload.global_batch % (dp * size):
                continue
            decided = {**outer, **dict(zip(names, layout)), axes.derived_axis(): dp, "micro_batch_size": size,
                       "num_micro_batches": workload.global_batch // (dp * size)}
            for k in knobs():
                offered = choices(workload, k, decided)
                if decided[k.name] not in offered:
                    if not offered:
                        break
                    decided[k.name] = offered[0]
            else:
                try:
                    candidate = plan_of(workload, decided)
                    candidate.validate(workload)
                except PlanError:
                    continue
                if candidate not in out:
                    out.append(candidate)
    return out
