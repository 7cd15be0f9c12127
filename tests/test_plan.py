"""The Plan contract: self-consistency, validation against a workload, versioned JSON."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from autopar.errors import PlanError
from autopar.plan import Plan, balanced_split, device_blocks
from conftest import workload


def plan(**kw) -> Plan:
    base = dict(dp=2, tp=2, pp=2, micro_batch_size=1, num_micro_batches=4)
    return Plan(**{**base, **kw})


def test_json_round_trip_keeps_every_field():
    p = plan(zero=1, recompute="full", recompute_blocks=2, schedule="interleaved", virtual_stages=2,
             sequence_parallel=True, grad_comm_dtype="bf16", bucket_mb=5.0, layer_split=(1, 2, 2, 1))
    assert Plan.from_json(p.to_json()) == p
    assert json.loads(p.to_json())["schema_version"] == 2  # 2: per-stage recompute, 0-block end stages


@pytest.mark.parametrize("change, message", [
    ({"bogus": 1}, "unknown plan key(s) ['bogus']"),
    ({"schema_version": 99}, "schema_version is 99"),
    ({"tp": 0}, "plan: tp must be an integer in [1, 131072], got 0"),
    ({"zero": 5}, "zero must be one of"),
    ({"schedule": "zigzag"}, "schedule must be one of"),
    ({"recompute": "full"}, "needs recompute_blocks >= 1"),
    ({"recompute_blocks": 3}, "only applies to recompute 'full'"),
    ({"schedule": "interleaved"}, "needs pp >= 2 and virtual_stages >= 2"),
    ({"virtual_stages": 2}, "needs schedule 'interleaved'"),
    ({"num_micro_batches": 1}, "needs at least 2 micro-batches"),
    ({"tp": 1, "sequence_parallel": True}, "sequence_parallel needs tp >= 2"),
    ({"offload_optimizer": True}, "needs zero 2 or 3"),
    ({"layer_split": [1, 2, 3]}, "layer_split has 3 entries"),
    ({"mesh_order": ["pp", "tp", "tp"]}, "mesh_order must be a permutation"),
])
def test_malformed_plans_are_rejected_with_the_constraint(change, message):
    d = {**plan().to_dict(), **change}
    with pytest.raises(PlanError) as e:
        Plan.from_dict(d)
    assert message in str(e.value)


def test_invalid_json_text_names_line_and_column():
    with pytest.raises(PlanError, match="line 1 column"):
        Plan.from_json("{not json")


def test_validate_against_workload():
    w = workload(size="tiny", nodes=1, global_batch=16)  # 8 GPUs, tiny GPT: 4 heads, 4 layers
    good = Plan(dp=2, tp=2, pp=2, micro_batch_size=2, num_micro_batches=4)
    good.validate(w)
    cases = [
        (good.with_(dp=1), "= 4 but the cluster has 8 GPUs"),
        (good.with_(num_micro_batches=2), "global batch is 16; set num_micro_batches = 4"),
        (good.with_(micro_batch_size=3, num_micro_batches=2), "dp x micro_batch_size = 6 does not divide it"),
        (Plan(dp=1, tp=8, pp=1, micro_batch_size=2, num_micro_batches=8), "tp=8 does not divide"),
        (Plan(dp=1, tp=1, pp=8, micro_batch_size=1, num_micro_batches=16), "exceeds the model's 4 blocks"),
        (good.with_(recompute="full", recompute_blocks=3), "exceeds the 2 blocks on the busiest pipeline rank"),
        (good.with_(layer_split=(3, 2)), "layer_split sums to 5 but the model has 4 blocks"),
    ]
    for p, message in cases:
        with pytest.raises(PlanError) as e:
            p.validate(w)
        assert message in str(e.value)


def test_save_is_atomic_and_loads_back(tmp_path):
    path = tmp_path / "plan.json"
    plan().save(path)
    assert Plan.load(path) == plan()
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_strides_follow_the_mesh_order():
    assert plan(dp=4, tp=2, pp=3).strides() == {"tp": 1, "cp": 2, "dp": 2, "pp": 8}
    assert plan(dp=4, tp=2, pp=3, mesh_order=("pp", "tp", "dp")).strides() == {"dp": 1, "cp": 4, "tp": 4, "pp": 8}
    # torchtitan's ParallelDims: pp, dp, cp, tp outermost first; cp between dp and tp
    assert plan(dp=2, tp=2, pp=2, cp=2).strides() == {"tp": 1, "cp": 2, "dp": 4, "pp": 8}


@given(st.integers(1, 200), st.integers(1, 64))
def test_balanced_split_is_even_and_complete(blocks, stages):
    if stages > blocks:
        with pytest.raises(PlanError):
            balanced_split(blocks, stages)
        return
    split = balanced_split(blocks, stages)
    assert len(split) == stages and sum(split) == blocks and max(split) - min(split) <= 1
    # the extra blocks go to the middle first (the ends also hold the embedding and the head): a
    # stage farther from both ends never holds fewer blocks; the first stage gets one only when every
    # stage but the last has one, and the last stage never does
    depth = [min(i, stages - 1 - i) for i in range(stages)]
    assert all(split[i] >= split[j] for i in range(stages) for j in range(stages) if depth[i] > depth[j])
    assert (split[0] > min(split)) == (stages > 1 and blocks % stages == stages - 1)
    assert split[-1] == min(split)


def test_device_blocks_assigns_virtual_stages_round_robin():
    assert device_blocks((1, 2, 3, 4), 2) == (4, 6)


def test_older_names_of_a_field_still_read_as_their_one_name():
    """Plans written with an earlier spelling of a field read as today's (one name everywhere)."""
    d = plan().to_dict()
    old = {("micro_batch" if k == "micro_batch_size" else "comm_dtype" if k == "grad_comm_dtype" else k): v
           for k, v in d.items()}
    assert "micro_batch_size" not in old and Plan.from_dict(old) == plan()
