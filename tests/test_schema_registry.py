"""The plan schema's ranges come from the registries: every axis's and folded axis's degree is
bounded by the GPUs autopar plans for, a throwaway axis's too, with no edit to autopar/schema.py."""

from __future__ import annotations

import pytest

from autopar import axes
from autopar.errors import PlanError
from autopar.plan import Plan
from autopar.schema import MAX_GPUS, PLAN_RANGES, check_plan_dict

BASE = dict(schema_version=1, dp=2, tp=1, pp=1, micro_batch_size=1, num_micro_batches=1)


def test_every_axis_degree_has_its_range():
    for name in (*axes.AXES, *axes.FOLDED):
        assert (PLAN_RANGES[name].lo, PLAN_RANGES[name].hi) == (1, MAX_GPUS), name
        with pytest.raises(PlanError, match=name):
            check_plan_dict({**BASE, name: MAX_GPUS + 1}, PlanError)


def test_a_declared_axis_is_range_checked_and_leaves_no_trace():
    axes.declare_axis(axes.Axis("xp", "throwaway", 1.5, help="a throwaway axis"))
    try:
        assert "xp" in PLAN_RANGES
        with pytest.raises(PlanError, match=r"xp"):
            Plan.from_dict({**BASE, "xp": 0})
        with pytest.raises(PlanError, match=r"xp"):
            check_plan_dict({**BASE, "xp": MAX_GPUS * 2}, PlanError)
        assert Plan.from_dict({**BASE, "xp": 2}).xp == 2
    finally:
        axes.undeclare("xp")
    assert "xp" not in PLAN_RANGES
