"""Tied input and output embeddings (Megatron's GPT, HF's GPT-2): one weight, counted once, in the
embedding; without pipeline parallelism it is reduced and updated once, with it the last stage
keeps a copy whose gradient the two ends all-reduce every step, exposed after the backward pass."""

from __future__ import annotations

import pytest

from autopar.cost import Coefficients, PlanArrays, estimate
from autopar.cost.collectives import all_reduce_time
from autopar.cost.model import _links, _pipeline
from autopar.plan import Plan
from autopar.profile import profile_model
from autopar.traces.vtrain import MODEL_FILE
from autopar.workload import Workload
from conftest import workload

V, H = 256, 64  # the tiny GPT's vocabulary and hidden size


@pytest.fixture(scope="module")
def pair():
    """(tied, untied) workloads of one tiny GPT on 2 GPUs: Megatron's file ties, the zoo's does not."""
    untied = workload("gpt", "dgx-a100-80g", gpus_per_node=2, global_batch=8, size="tiny")
    tied = Workload(profile_model(MODEL_FILE, {"size": "tiny"}, dtype="bf16"), untied.cluster, 8)
    return tied, untied


def test_a_tied_weight_is_counted_once_in_the_embedding(pair):
    tied, untied = pair
    p, q = tied.profile, untied.profile
    assert (p.tied_params, p.tied_tp_params, q.tied_params) == (V * H, V * H, 0)
    assert p.embed.params == q.embed.params and p.head.params == q.head.params - V * H
    assert p.params == q.params - V * H
    assert p.head.tp_fwd_flops == q.head.tp_fwd_flops > 0  # the head's GEMM still runs, sharded by tp


def test_without_a_pipeline_the_tied_weight_is_held_once(pair):
    tied, untied = pair
    plan = Plan(dp=2, tp=1, pp=1, micro_batch_size=1, num_micro_batches=4, precision="bf16")
    a, b = estimate(tied, plan), estimate(untied, plan)
    assert b.memory["weights"] - a.memory["weights"] == V * H * 2  # bf16
    assert b.memory["optimizer_states"] - a.memory["optimizer_states"] == V * H * 8
    assert a.breakdown["dp_comm"] < b.breakdown["dp_comm"]  # a smaller gradient to all-reduce


def test_over_a_pipeline_the_last_stage_keeps_a_copy_and_the_ends_all_reduce_it(pair):
    tied, untied = pair
    plan = Plan(dp=1, tp=1, pp=2, micro_batch_size=1, num_micro_batches=8, precision="bf16",
                grad_comm_dtype="bf16")
    a, b = estimate(tied, plan), estimate(untied, plan)
    pa = PlanArrays.from_plans([plan], tied.profile)
    c = Coefficients.for_cluster(tied.cluster, tied.runtime)
    held = [_pipeline(w, PlanArrays.from_plans([plan], w.profile), c)["local_params"].tolist() for w in pair]
    assert held[0] == held[1] and len(held[0][0]) == 2  # each stage (first, last) holds what the untied one's does
    assert a.memory == b.memory
    assert b.breakdown["dp_comm"] == 0.0  # dp 1: no gradient reduction at all
    links = _links(tied.cluster, pa, c)
    # bf16 gradients of the 256 x 64 embedding, between the first and the last stage
    expected = all_reduce_time(V * H * 2, 2, links["tied_bw"][0], links["tied_lat"][0], c.collective_latency_s)
    assert a.breakdown["dp_comm"] == pytest.approx(expected, rel=1e-12) and expected > 0
    assert a.hidden["dp_comm"] == 0.0  # nothing hides it
    assert a.iteration_time_s - b.iteration_time_s == pytest.approx(expected, rel=1e-9)
