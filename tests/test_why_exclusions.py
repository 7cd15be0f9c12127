"""The Why table's "not considered" rows cover every exclusion the registries make: an axis or
folded axis of which the plan space offers no degree above 1 gets one row with its own rule's
reason (cp below the tokens per rank the space searches, cp on a model that cannot split its
sequence, ep on a dense model), a throwaway axis's too; an axis the space does offer gets none."""

from __future__ import annotations

import pytest
from conftest import workload

from autopar import axes
from autopar.explain import DEGREES, explain
from autopar.plan import Plan


@pytest.fixture(scope="module")
def gpt():
    return workload("gpt", cluster="cpu", gpus_per_node=4, global_batch=8, size="tiny")


PLAN = Plan(dp=4, tp=1, pp=1, micro_batch_size=1, num_micro_batches=2)


def _not_considered(reasons) -> dict[str, tuple[str, str]]:
    """{what: (row, why)} of the "... not considered: why" rows."""
    out = {}
    for r in reasons:
        what, sep, why = r.text.partition(" not considered: ")
        if sep:
            out[what] = (r.knob, why)
    return out


def test_cp_and_ep_left_out_of_the_space_say_why(gpt):
    rows = _not_considered(explain(gpt, PLAN))
    tokens = gpt.profile.seq_len // 2
    assert rows["cp > 1"] == ("cp", f"cp=2 leaves {tokens} tokens per rank; the plan space offers cp from 2048 up")
    assert rows["ep > 1"][0] == "ep" and "is a dense model (no experts to shard)" in rows["ep > 1"][1]
    assert "tp > 1" not in rows and "pp > 1" not in rows  # the space offers them


def test_a_model_that_cannot_split_its_sequence_says_so():
    moe = workload("moe", cluster="cpu", gpus_per_node=4, global_batch=8, size="tiny")
    rows = _not_considered(explain(moe, Plan(dp=4, tp=1, pp=1, micro_batch_size=1, num_micro_batches=2)))
    assert "sequence_shardable = True" in rows["cp > 1"][1]
    assert "ep > 1" not in rows
    assert list(rows).count("cp > 1") == 1


def test_a_declared_axis_rule_is_a_row_with_no_edit_to_explain(gpt):
    axes.declare_axis(axes.Axis("xp", "throwaway", 1.5, lambda w, d: None if d == 1 else f"xp={d} is never allowed",
                                help="a throwaway axis"))
    try:
        plan = Plan(dp=4, tp=1, pp=1, micro_batch_size=1, num_micro_batches=2)
        reasons = explain(gpt, plan)
        assert _not_considered(reasons)["xp > 1"] == ("xp", "xp=2 is never allowed")
        assert [r.knob for r in reasons].count(DEGREES) == 1  # the degrees' own row, not overwritten by it
    finally:
        axes.undeclare("xp")
