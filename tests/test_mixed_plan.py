"""The mixed plan (autopar/mixed/plan.py) and workload (autopar/mixed/workload.py): lanes of segments,
their JSON, and the one-line validation against a mixed cluster."""

from __future__ import annotations

import json

import pytest
from conftest import profile

from autopar.cluster.mixed import parse_mixed_spec
from autopar.errors import AutoparError, PlanError
from autopar.mixed.plan import Lane, MixedPlan, Segment
from autopar.mixed.workload import MixedWorkload
from autopar.plan import Plan

A, H = "dgx-a100-80g", "dgx-h100"


@pytest.fixture(scope="module")
def mw():
    return MixedWorkload(profile("gpt", size="tiny"), parse_mixed_spec(f"{A}:1,{H}:1"), 64)


def plan(**kw):
    base = dict(dp=4, tp=1, pp=1, micro_batch_size=2, num_micro_batches=4)
    return Plan(**{**base, **kw})


def two_lanes():
    """A data-parallel lane of 4 A100s (32 samples) and a pipeline over the H100s then 4 A100s (32)."""
    return MixedPlan((Lane((Segment(A, 1, 1),), plan()),
                      Lane((Segment(H, 2, 1), Segment(A, 1, 1)), plan(tp=2, pp=2, num_micro_batches=4))))


def test_shares_and_gpus(mw):
    mp = two_lanes()
    assert [lane.share for lane in mp.lanes] == [32, 32] and mp.global_batch == 64
    assert (mp.gpus(A), mp.gpus(H), mp.gpus()) == (8, 8, 16)
    assert mp.lanes[1].segment_plan(mp.lanes[1].segments[1]).tp == 1
    assert [list(r) for r in mp.lanes[1].stage_ranges()] == [[0], [1]]
    mp.validate(mw)


def test_json_round_trip(tmp_path, mw):
    mp = two_lanes()
    path = tmp_path / "mixed.json"
    mp.save(path)
    d = json.loads(path.read_text())
    assert d["mixed_plan_version"] == 1 and d["lanes"][1]["segments"][0] == {"group": H, "tp": 2, "stages": 1}
    assert MixedPlan.load(path) == mp
    assert MixedPlan.from_dict(mp.to_dict()) == mp


def test_on_group_sizes_whole_nodes_or_one_node(mw):
    assert mw.on_group(H, 8, 16).cluster.num_gpus == 8 and mw.on_group(H, 8, 16).global_batch == 16
    small = mw.on_group(A, 4, 16).cluster
    assert (small.nodes, small.gpus_per_node, small.gpu.name) == (1, 4, mw.cluster.group(A).gpu.name)
    with pytest.raises(PlanError, match="not whole nodes"):
        mw.on_group(A, 12, 16)


def refused(mw, mp_or_builder, match):
    with pytest.raises(PlanError, match=match) as e:
        mp = mp_or_builder() if callable(mp_or_builder) else mp_or_builder
        mp.validate(mw)
    assert "\n" not in str(e.value)


def test_validation_is_one_line_per_problem(mw):
    refused(mw, MixedPlan((Lane((Segment(A, 1, 1),), plan()),)), r"shares 32 = 32 but the global batch is 64")
    refused(mw, MixedPlan((Lane((Segment(A, 1, 1),), plan(dp=8, num_micro_batches=2)),
                           Lane((Segment(A, 1, 1),), plan(dp=8, num_micro_batches=2)))),
            r"16 GPUs on group dgx-a100-80g, which has 8")
    refused(mw, MixedPlan((Lane((Segment("v100", 1, 1),), plan(dp=8, num_micro_batches=4)),)),
            r"unknown group 'v100'")
    refused(mw, MixedPlan((Lane((Segment(A, 16, 1),), plan(dp=1, tp=16, num_micro_batches=32)),)),
            r"tp=16 on group dgx-a100-80g of 8 GPUs per node")
    refused(mw, MixedPlan((Lane((Segment(A, 3, 1),), plan(dp=1, tp=3, num_micro_batches=32)),)),
            r"use a tp dividing 8")
    refused(mw, lambda: Lane((Segment(A, 1, 1), Segment(H, 1, 1)), plan(pp=3)), r"segments hold 2 stages")
    refused(mw, lambda: Lane((Segment(A, 2, 1),), plan()), r"first segment tp=2")
    refused(mw, lambda: Lane((Segment(A, 1, 2), Segment(H, 1, 2)), plan(pp=4, schedule="interleaved",
                                                                          virtual_stages=2)),
            r"pipeline across groups runs 1f1b or gpipe")
    # a lane on one group is the homogeneous plan on its part: Plan.validate's own checks, prefixed
    refused(mw, MixedPlan((Lane((Segment(A, 1, 2),), plan(pp=2, layer_split=(1, 1))),
                           Lane((Segment(H, 1, 1),), plan(dp=8, micro_batch_size=1)))),
            r"lane 1: layer_split sums to 2 but the model has 4 blocks")
    # a lane across groups: Plan.validate_parts on each segment, prefixed with its group (tp must divide the 4 heads)
    refused(mw, MixedPlan((Lane((Segment(H, 8, 1), Segment(A, 8, 1)), plan(dp=1, tp=8, pp=2,
                                                                            num_micro_batches=32)),)),
            rf"lane 1: group {H}: tp=8 does not divide")


def test_bad_documents_are_one_line(tmp_path):
    good = two_lanes().to_dict()
    cases = [
        ({**good, "mixed_plan_version": 7}, "mixed_plan_version is 7"),
        ({**good, "extra": 1}, r"unknown mixed plan key\(s\) \['extra'\]"),
        ({**good, "lanes": []}, "non-empty list of lanes"),
        ({**good, "lanes": [{"segments": [{"group": A, "tp": 1}], "plan": good["lanes"][0]["plan"]}]},
         r"lanes\[0\]: segment is missing key\(s\) \['stages'\]"),
        ({**good, "lanes": [{"segments": [{"group": A, "tp": 0, "stages": 1}], "plan": good["lanes"][0]["plan"]}]},
         "tp must be a positive integer"),
        ({**good, "lanes": [{"segments": [], "plan": good["lanes"][0]["plan"]}]}, "at least one segment"),
    ]
    for doc, match in cases:
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(doc))
        with pytest.raises(PlanError, match=match) as e:
            MixedPlan.load(path)
        assert "\n" not in str(e.value) and str(path) in str(e.value)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(PlanError):
        MixedPlan.load(tmp_path / "broken.json")


def test_fp8_names_the_group_that_cannot():
    with pytest.raises(AutoparError, match=f"group {A}: .*fp8"):
        MixedWorkload(profile("gpt", size="tiny"), parse_mixed_spec(f"{A}:1,{H}:1"), 64, fp8=True)
