"""Invariants of the vectorised cost model: exact memory accounting by ZeRO stage and schedule,
batch evaluation equal to one-by-one, breakdowns that add up."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cost import Coefficients, PlanArrays, estimate, evaluate
from autopar.cost.model import memory_parts, time_parts
from autopar.plan import Plan
from autopar.search.space import enumerate_plans
from conftest import workload

W = workload(size="gpt2-medium", vocab=50304, nodes=2, global_batch=64)  # 16 GPUs, 24 layers, 16 heads


@pytest.fixture(scope="module")
def space():
    return enumerate_plans(W)


def test_breakdown_adds_up_to_iteration_time(space):
    res = evaluate(W, space)
    # the core's parts and the terms of declared axes and knobs (cp's K/V exchange)
    np.testing.assert_allclose(sum(res[p] for p in time_parts()), res["iteration_time"], rtol=1e-9)
    np.testing.assert_allclose(sum(res[p] for p in memory_parts()), res["peak_memory"], rtol=1e-9)
    assert (res["hw_flops"] >= res["model_flops"]).all()


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_batch_evaluation_equals_one_by_one(space, data):
    rows = data.draw(st.lists(st.integers(0, len(space) - 1), min_size=1, max_size=6))
    together = evaluate(W, space.take(np.array(rows)))
    for j, i in enumerate(rows):
        alone = evaluate(W, PlanArrays.from_plans([space.plan(i)], W.profile))
        for key in ("iteration_time", "peak_memory", "activations", "dp_comm"):
            assert alone[key][0] == pytest.approx(together[key][j], rel=1e-9)


def test_plan_arrays_round_trip(space):
    for i in np.linspace(0, len(space) - 1, 50).astype(int):
        p = space.plan(i)
        p.validate(W)
        assert PlanArrays.from_plans([p], W.profile).plan(0) == p


def test_model_states_by_zero_stage_are_exact():
    """16 bytes per parameter in bf16 with Adam, divided by dp exactly where ZeRO shards."""
    dp = W.world_size
    local = W.profile.params  # tp = pp = 1: every GPU holds the whole model
    expect = {  # weights, gradients, master weights, Adam moments
        0: (2 * local, 2 * local, 4 * local, 8 * local),
        1: (2 * local, 2 * local, 4 * local / dp, 8 * local / dp),
        2: (2 * local, 2 * local / dp, 4 * local / dp, 8 * local / dp),
    }
    for zero, (w, g, m, s) in expect.items():
        est = estimate(W, Plan(dp=dp, tp=1, pp=1, micro_batch_size=4, num_micro_batches=1, zero=zero))
        got = est.memory
        assert (got["weights"], got["gradients"], got["master_weights"], got["optimizer_states"]) == \
            pytest.approx((w, g, m, s), rel=1e-12)
    z3 = estimate(W, Plan(dp=dp, tp=1, pp=1, micro_batch_size=4, num_micro_batches=1, zero=3)).memory
    block = max(b.params for b in W.profile.layers)
    assert z3["weights"] == pytest.approx(2 * local / dp + 2 * 2 * block, rel=1e-12)  # + two gathered blocks
    off = estimate(W, Plan(dp=dp, tp=1, pp=1, micro_batch_size=4, num_micro_batches=1, zero=3,
                           offload_optimizer=True)).memory
    assert off["master_weights"] == 0 and off["optimizer_states"] == 0


def test_pipeline_accumulation_holds_whole_gradients_and_weights_under_fsdp():
    """torch.distributed.pipelining accumulates FSDP gradients unsharded over micro-batches and
    keeps blocks gathered from backward to the next forward: ZeRO-2/3 then hold whole gradients
    (and ZeRO-3 whole weights); with one micro-batch they stay sharded."""
    local = W.profile.params / 2  # pp = 2: half the model per stage (balanced, tied embeddings aside)
    for zero in (2, 3):
        acc = estimate(W, Plan(dp=8, tp=1, pp=2, micro_batch_size=2, num_micro_batches=4, zero=zero)).memory
        one = estimate(W, Plan(dp=8, tp=1, pp=2, micro_batch_size=8, num_micro_batches=1, zero=zero,
                               schedule="gpipe")).memory
        # (the peak rank may be the other stage: the two stages differ by the embedding and the head)
        assert acc["gradients"] == pytest.approx(8 * one["gradients"], rel=0.01)
        assert acc["gradients"] == pytest.approx(2 * local, rel=0.05)
        if zero == 3:
            assert acc["weights"] == pytest.approx(acc["gradients"], rel=1e-12)


def test_fsdp_reduce_scatters_once_per_micro_batch_unless_the_pipeline_accumulates():
    """ZeRO-2 without pipelining: one all-gather a step, a reduce-scatter after every backward;
    with a pipeline of several micro-batches: one of each. Exact with nothing hidden."""
    from autopar.cost.collectives import all_gather_time

    c = Coefficients(dp_overlap=0.0, collective_efficiency={"reduce_scatter": 0.5, "all_gather": 0.8})
    dp, link = 16, W.cluster.ring(16, 1)
    bw, lat = link.bandwidth * c.link(link.kind), link.latency
    grads = W.profile.params * 4  # fp32 reduction
    params = W.profile.params * 2
    scatter = all_gather_time(grads, dp, bw * 0.5, lat)
    gather = all_gather_time(params, dp, bw * 0.8, lat)
    for n in (1, 4):
        plan = Plan(dp=dp, tp=1, pp=1, micro_batch_size=4 // n, num_micro_batches=n, zero=2)
        assert evaluate(W, PlanArrays.from_plans([plan], W.profile), c)["dp_comm"][0] == \
            pytest.approx(n * scatter + gather, rel=1e-9)
    piped = evaluate(W, PlanArrays.from_plans([Plan(dp=8, tp=1, pp=2, micro_batch_size=2, num_micro_batches=4,
                                                    zero=2)], W.profile), c)["dp_comm"][0]
    single = evaluate(W, PlanArrays.from_plans([Plan(dp=8, tp=1, pp=2, micro_batch_size=8, num_micro_batches=1,
                                                     zero=2, schedule="gpipe")], W.profile), c)["dp_comm"][0]
    assert piped == pytest.approx(single, rel=1e-9)


def test_activations_in_flight_follow_the_schedule():
    """1F1B keeps pp micro-batches on the first rank, GPipe all m; with full recompute only the
    block inputs stay, plus one block being recomputed."""
    p = W.profile
    layer = p.layers[0]
    base = Plan(dp=4, tp=1, pp=4, micro_batch_size=2, num_micro_batches=8)
    blocks_rank0 = 6  # 24 layers over 4 ranks
    per_mb = 2 * (blocks_rank0 * layer.saved_bytes + p.embed.saved_bytes)
    assert estimate(W, base).memory["activations"] == pytest.approx(4 * per_mb, rel=1e-9)
    last_rank = 2 * (blocks_rank0 * layer.saved_bytes + p.head.saved_bytes)  # GPipe: all m on every rank
    assert estimate(W, base.with_(schedule="gpipe")).memory["activations"] == \
        pytest.approx(8 * max(per_mb, last_rank), rel=1e-9)
    full = estimate(W, base.with_(recompute="full", recompute_blocks=6)).memory["activations"]
    first = 4 * 2 * (blocks_rank0 * layer.out_bytes + p.embed.saved_bytes)  # 4 micro-batches in flight
    last = 1 * 2 * (blocks_rank0 * layer.out_bytes + p.head.saved_bytes)  # 1 in flight, holds the logits
    assert full == pytest.approx(max(first, last) + 2 * layer.saved_bytes, rel=1e-9)


def test_sequence_parallel_divides_all_activations_by_tp():
    """Korthikanti: tensor parallel keeps 10sbh replicated, sequence parallel shards it too; all
    but the loss's, which reads the logits of the whole sequence (gathered before the head), and,
    under torch, the column-wise linears' inputs, saved gathered (tests/test_sp_memory.py)."""
    plan = Plan(dp=8, tp=2, pp=1, micro_batch_size=1, num_micro_batches=8)
    a = estimate(W, plan).memory["activations"]
    b = estimate(W, plan.with_(sequence_parallel=True)).memory["activations"]
    assert W.profile.head.loss_saved_bytes > 0
    replicated = sum(k.count * (k.saved_bytes - k.saved_tp_bytes - (k.loss_saved_bytes - k.loss_saved_tp_bytes)
                                - k.entry_saved_bytes) for k in W.profile.blocks)
    assert a - b == pytest.approx(replicated / 2, rel=1e-9)


def test_interleaving_shrinks_the_bubble():
    plan = Plan(dp=2, tp=1, pp=8, micro_batch_size=1, num_micro_batches=32)
    plain = estimate(W, plan).breakdown["pp_bubble"]
    inter = estimate(W, plan.with_(schedule="interleaved", virtual_stages=3)).breakdown["pp_bubble"]
    assert inter < plain / 2


def test_no_parallel_communication_without_parallelism():
    one = workload(size="gpt2-medium", nodes=1, gpus_per_node=1, global_batch=8)
    est = estimate(one, Plan(dp=1, tp=1, pp=1, micro_batch_size=8, num_micro_batches=1))
    assert est.breakdown["tp_comm"] == est.breakdown["dp_comm"] == est.breakdown["pp_p2p"] == 0
    assert est.breakdown["pp_bubble"] == pytest.approx(0, abs=1e-12)


def test_better_links_never_slow_a_plan_down(space):
    slow = Coefficients(link_efficiency={"nvlink": 0.3, "ib": 0.3})
    fast = Coefficients(link_efficiency={"nvlink": 0.9, "ib": 0.9})
    assert (evaluate(W, space, fast)["iteration_time"] <= evaluate(W, space, slow)["iteration_time"] + 1e-12).all()
