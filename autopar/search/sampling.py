"""Knob-by-knob walks of the plan space for the sampling planners (random, Optuna).

A walk (`autopar.search.space.sample`) picks one knob at a time from the choices the space
allows given the earlier picks, so every plan it returns is a plan of the space, without
enumerating the space. Each choice has a position in [0, 1] on its knob (`Knob.position_of`:
a categorical knob's slot, a degree or micro-batch's log share of its range given the earlier
picks), so a search that needs fixed distributions (Optuna) suggests one number per knob and
takes the valid choice nearest to it: near positions mean similar plans, and a share rather
than an absolute value keeps suggestions beyond one workload's range from all landing on its end.
"""

from __future__ import annotations

import numpy as np

from autopar.cost import PlanArrays, evaluate
from autopar.errors import NoValidPlanError
from autopar.plan import Plan
from autopar.search.exhaustive import distinct, no_plan_error
from autopar.search.simplicity import defaults, simpler_variants, simplest_first, tie_buckets
from autopar.search.space import degree_choices


def check_space(workload) -> None:
    """Unlike the oracle, a sampler cannot tell an empty space from a sparse one: check first."""
    if not degree_choices(workload):
        raise no_plan_error(workload)


def nearest(positions: np.ndarray, target: float) -> int:
    """The valid choice closest to a suggested position (the lower one on a tie)."""
    return int(np.argmin(np.abs(positions - target)))


def best_distinct(workload, plans: list[Plan], result: dict, k: int, method: str) -> tuple[list[Plan], int]:
    """The k fastest plans that fit, best first (the simplest first among ties), skipping any that
    repeats a better plan's structure (it differs only in a data-parallel detail), as the oracle does;
    and the cost-model evaluations spent on the simpler variants of the best plans, which the
    sampler may not have drawn."""
    fit = np.flatnonzero(result["fits"])
    if len(fit) == 0:
        raise sample_memory_error(workload, method, len(plans), float(np.min(result["peak_memory"])))
    fitted = [plans[i] for i in fit]
    times = np.asarray(result["iteration_time"], dtype=float)[fit]
    tried = set(plans)
    spent = 0
    # the k fastest, and every plan tied with the fastest: the simplest of the tie is returned, so its
    # simpler variants must have been tried too; a variant that joins the tie brings its own (until
    # none is new: each round sets at least one more knob back to its default)
    for _ in range(len(defaults()) + 1):
        best = dict.fromkeys([*np.argsort(times, kind="stable")[:k], *np.flatnonzero(tie_buckets(times) == 0)])
        extra = list(dict.fromkeys(v for i in best for v in simpler_variants(workload, fitted[i]) if v not in tried))
        if not extra:
            break
        tried.update(extra)
        spent += len(extra)
        res = evaluate(workload, PlanArrays.from_plans(extra, workload.profile))
        fitted += [p for p, ok in zip(extra, res["fits"]) if ok]
        times = np.concatenate([times, res["iteration_time"][res["fits"]]])
    pa = PlanArrays.from_plans(fitted, workload.profile)
    return [fitted[i] for i in distinct(pa, simplest_first(fitted, times), k)], spent


def sample_memory_error(workload, method: str, tried: int, least_bytes: float) -> NoValidPlanError:
    """Unlike the oracle, a sampler that found nothing cannot say that nothing fits."""
    gpu = workload.cluster.gpu
    return NoValidPlanError(
        f"none of the {tried} plans {method} tried for {workload.profile.name} fits on {workload.world_size} x "
        f"{gpu.name}: the leanest needs {least_bytes / 1e9:.1f} GB per GPU but {workload.memory_budget / 1e9:.1f} GB "
        f"are usable; use more --trials, or --method exhaustive to check every plan")
