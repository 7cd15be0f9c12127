"""Knob-by-knob sampling and the random planner: every walk is a plan of the space, walks reach
the whole space, and random search is a valid, reproducible baseline."""

from __future__ import annotations

import numpy as np
import pytest

from autopar.cost import estimate
from autopar.errors import AutoparError, NoValidPlanError
from autopar.search import get_planner
from autopar.search.simplicity import TIE, defaults
from autopar.search.space import degree_choices, enumerate_plans, sample
from conftest import workload


def uniform(rng):
    return lambda knob, choices: int(rng.integers(len(choices)))


@pytest.mark.parametrize("nodes, batch", [(1, 32), (2, 24)])
def test_walks_give_plans_of_the_space_and_reach_all_of_it(nodes, batch):
    w = workload(size="tiny", nodes=nodes, global_batch=batch)
    space = enumerate_plans(w)
    every = {space.plan(i) for i in range(len(space))}
    rng = np.random.default_rng(0)
    walked = [sample(w, uniform(rng)) for _ in range(3000)]
    assert set(walked) <= every
    assert {(p.dp, p.tp, p.pp) for p in walked} == {(d["dp"], d["tp"], d["pp"]) for d in degree_choices(w)}
    for attribute in ("micro_batch_size", "zero", "schedule", "virtual_stages", "recompute", "sequence_parallel",
                      "grad_comm_dtype", "offload_optimizer", "mesh_order", "bucket_mb"):
        assert {getattr(p, attribute) for p in walked} == {getattr(p, attribute) for p in every}, attribute


def test_random_planner_gives_distinct_fitting_plans_best_first():
    w = workload(size="gpt2-medium", vocab=50304, nodes=2, global_batch=128)
    planner = get_planner("random", trials=200, seed=1)
    plans = planner.propose(w, 5)
    assert 200 <= planner.evaluations <= 200 + 5 * (len(defaults()) + 1) ** 2  # + rounds of simpler variants of the 5 best
    assert len(set(plans)) == 5
    estimates = [estimate(w, p) for p in plans]
    assert all(e.fits for e in estimates)
    times = [e.iteration_time_s for e in estimates]
    assert all(b <= a * (1 + TIE) for a, b in zip(times[1:], times))  # best first; the simplest first among ties
    for p in plans:
        p.validate(w)


def test_random_planner_is_reproducible_and_more_trials_never_hurt():
    """The same seed draws the same walks, so 200 trials extend the first 50."""
    w = workload(size="gpt3-13b", nodes=4, global_batch=256)
    best = {n: get_planner("random", trials=n, seed=3).propose(w, 1)[0] for n in (50, 200)}
    assert get_planner("random", trials=50, seed=3).propose(w, 1)[0] == best[50]
    assert estimate(w, best[200]).iteration_time_s <= estimate(w, best[50]).iteration_time_s * (1 + TIE)


def test_errors_say_what_is_wrong():
    with pytest.raises(AutoparError, match="--trials must be at least 1"):
        get_planner("random", trials=0)
    with pytest.raises(NoValidPlanError, match="global batch 6 is not divisible"):
        get_planner("random", trials=10).propose(workload(size="tiny", nodes=8, global_batch=6))
    with pytest.raises(NoValidPlanError, match="none of the 10 plans random search tried .* fits on 8 x"):
        get_planner("random", trials=10).propose(workload(size="1t", nodes=1, global_batch=8))
