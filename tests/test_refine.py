"""Coordinate-descent refinement (`policies/refine.py`): from any plan of the space it returns a
plan of the space that fits, at least as fast as the start, from which no single change of one
decision is faster (a local optimum), and it counts every plan it evaluated."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cost import evaluate
from autopar.envs.knobs import PlanSpace
from autopar.policies.refine import moves, neighbours, refine
from autopar.search.space import enumerate_plans
from conftest import workload


@pytest.fixture(scope="module")
def case():
    w = workload(size="gpt2-medium", vocab=50304, nodes=1, global_batch=64)
    space, plans = PlanSpace(w), enumerate_plans(w)
    res = evaluate(w, plans)
    return w, space, plans, res


@pytest.mark.heavy
@settings(max_examples=12, deadline=None)
@given(pick=st.integers(0, 10**9))
def test_refinement_ends_at_a_faster_local_optimum(case, pick):
    w, space, plans, res = case
    fitting = np.flatnonzero(res["fits"])
    start = int(fitting[pick % len(fitting)])
    found = refine(space, space.prefix_of(plans.plan(start)))
    plan = space.plan(found.prefix)
    plan.validate(w)
    [t] = evaluate(w, type(plans).from_plans([plan], w.profile))["iteration_time"]
    assert found.time_s == pytest.approx(t) and t <= res["iteration_time"][start] * (1 + 1e-9)
    assert t >= res["iteration_time"][fitting].min() * (1 - 1e-9)  # the oracle is the bound
    spent = 1
    for changed in moves(len(space.names), 1):
        _, pa = neighbours(space, found.prefix, changed)
        r = evaluate(w, pa)
        spent += len(pa)
        assert not (r["fits"] & (r["iteration_time"] < t * (1 - 1e-6))).any(), space.names[changed[0]]
    assert found.evaluations >= spent


def test_a_change_that_invalidates_later_decisions_reopens_them(case):
    """A new tensor degree changes dp and so the micro-batch choices: the neighbours still hold
    plans with that degree (the micro-batch re-chosen) rather than none."""
    w, space, plans, res = case
    start = space.prefix_of(plans.plan(int(np.flatnonzero(res["fits"])[0])))
    tp = space.names.index("tp")
    walked, pa = neighbours(space, start, (tp,))
    degrees = {walked.value("tp", i) for i in range(len(pa))}
    assert len(degrees) == len(space.choices(start[:tp])) >= 3


def test_refinement_stops_at_its_budget(case):
    w, space, plans, res = case
    start = space.prefix_of(plans.plan(int(np.flatnonzero(res["fits"])[0])))
    found = refine(space, start, budget=50)
    assert found.evaluations < 50 + max(len(neighbours(space, start, c)[1]) for c in moves(len(space.names), 1))
