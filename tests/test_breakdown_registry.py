"""The estimate's parts are the cost model's declared lists (`time_parts()`, `memory_parts()`,
HIDDEN_PARTS), not hand lists: `evaluate` returns each of them and refuses, naming it, a part
declared but not priced; the Why table's expert-parallel row names whichever part of the breakdown
moved most, a declared knob's own time term included."""

from __future__ import annotations

import re

import numpy as np
import pytest
from conftest import workload

from autopar.cost import PlanArrays, evaluate
from autopar.cost import model as cost_model
from autopar.cost.model import HIDDEN_PARTS, memory_parts, time_parts
from autopar.explain import explain, part_words
from autopar.knobs import Field, Knob, declare_knob, undeclare_knob
from autopar.plan import Plan

PLAN = Plan(dp=4, tp=2, pp=1, ep=2, micro_batch_size=1, num_micro_batches=4)


@pytest.fixture(scope="module")
def moe():
    return workload("moe", cluster="cpu", gpus_per_node=8, global_batch=16, size="tiny")


def test_evaluate_returns_every_declared_part(moe):
    res = evaluate(moe, PlanArrays.from_plans([PLAN], moe.profile))
    assert set(time_parts()) | set(memory_parts()) | set(HIDDEN_PARTS) <= set(res)
    assert {"cp", "ep_comm"} <= set(time_parts()) and {"cp_memory", "expert_weights"} <= set(memory_parts())


def test_a_part_declared_but_not_priced_is_named(moe, monkeypatch):
    monkeypatch.setattr(cost_model, "TIME_PARTS", cost_model.TIME_PARTS + ("xt",))
    with pytest.raises(RuntimeError, match=r"\['xt'\]"):
        evaluate(moe, PlanArrays.from_plans([PLAN], moe.profile))


@pytest.fixture
def slow_without_ep():
    """A knob with one choice whose own time term costs a second whenever ep is 1: the part that moves most."""
    declare_knob(Knob("xk", (Field("xk", bool, False),), lambda w, d: [False], label="throwaway knob",
                      time_term=lambda w, pa, c: np.where(pa.ep > 1, 0.0, 1.0)))
    try:
        yield
    finally:
        undeclare_knob("xk")


def test_the_expert_parallel_row_names_the_part_that_moved_most(moe, slow_without_ep):
    plan = Plan(**{**PLAN.fields(), "xk": False})  # the plan's fields now include the knob's
    row = next(r for r in explain(moe, plan) if r.knob == "ep")
    named = re.search(r"ep1 is [+-][\d.]+% \((.+?) [+-][\d,]+ ms\)", row.text)
    assert named, row.text
    res = evaluate(moe, PlanArrays.from_plans([plan, plan.with_(ep=1)], moe.profile))
    assert max(time_parts(), key=lambda p: abs(res[p][1] - res[p][0])) == "xk"
    assert named.group(1) == part_words("xk") == "xk"
