"""The tensor-parallel collectives of each pass, ends included: a layer's backward mirrors its
forward (one all-reduce per region each way), the embedding sends nothing in backward, a
vocab-sharded head all-gathers its logits in forward and all-reduces the hidden states' gradient in
backward, and Megatron's vocab-parallel loss never gathers the logits (three fp32 values per token
instead). Priced exactly, from the profile's measured bytes (cost/tensor_parallel.py)."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cost import Coefficients, PlanArrays, estimate
from autopar.cost.collectives import all_gather_time, all_reduce_time
from autopar.cost.model import _links
from autopar.plan import Plan
from autopar.profile import profile_model
from autopar.traces.vtrain import MODEL_FILE
from autopar.workload import Workload
from conftest import workload

V, H, S, LAYERS = 256, 64, 32, 4  # the tiny GPT's vocabulary, hidden size, sequence, layers
PLAN = Plan(dp=1, tp=2, pp=1, micro_batch_size=2, num_micro_batches=1, precision="bf16", recompute="none")


@pytest.fixture(scope="module")
def zoo():
    """The zoo GPT on 2 GPUs: its head (style "vocab") gathers the logits, as autopar's executor runs it."""
    return workload("gpt", "dgx-a100-80g", gpus_per_node=2, global_batch=2, size="tiny")


def _prices(w):
    """all_reduce / all_gather of n bytes over the plan's tensor-parallel group, one call each."""
    pa = PlanArrays.from_plans([PLAN], w.profile)
    c = Coefficients.for_cluster(w.cluster, w.runtime)
    links = _links(w.cluster, pa, c)
    bw, lat, base = links["tp_bw"][0], links["tp_lat"][0], c.collective_latency_s
    return (lambda n: all_reduce_time(n, 2, bw, lat, base)), (lambda n: all_gather_time(n, 2, bw, lat, base))


def test_the_profile_tells_gathers_from_all_reduces(zoo):
    embed, head, layer = zoo.profile.embed, zoo.profile.head, zoo.profile.layers[0]
    assert (embed.tp_comm_bytes, embed.tp_gather_bytes) == (S * H * 2, 0)  # the embedding's output, all-reduced
    assert (head.tp_comm_bytes, head.tp_gather_bytes) == (0, S * V * 2)  # the logits, all-gathered
    assert (layer.tp_comm_bytes, layer.tp_gather_bytes) == (2 * S * H * 2, 0)  # two row-wise outputs


def test_torch_gathers_the_logits_and_reduces_the_heads_input_gradient(zoo):
    ar, ag = _prices(zoo)
    b = PLAN.micro_batch_size
    layers = LAYERS * 2 * ar(b * 2 * S * H * 2)  # forward and backward, two regions each
    ends = ar(b * S * H * 2) + ag(b * S * V * 2) + ar(b * S * H * 2)  # embed forward; head forward, backward
    est = estimate(zoo, PLAN)
    assert est.breakdown["tp_comm"] == pytest.approx(layers + ends, rel=1e-12)
    assert est.hidden["tp_comm"] == 0.0


def test_megatrons_loss_keeps_the_logits_sharded(zoo):
    megatron = dataclasses.replace(zoo, runtime="megatron")
    ar, _ = _prices(megatron)
    b = PLAN.micro_batch_size
    layers = LAYERS * 2 * ar(b * 2 * S * H * 2)
    loss = 3 * ar(b * S * 4)  # the maximum, the target's logit and the sum of exponentials, fp32 per token
    ends = ar(b * S * H * 2) + loss + ar(b * S * H * 2)
    assert estimate(megatron, PLAN).breakdown["tp_comm"] == pytest.approx(layers + ends, rel=1e-12)


def test_a_column_split_head_without_a_gather_still_reduces_its_input_gradient(zoo):
    """vTrain's file (Megatron's head: column-split, no gather) under torch with Megatron's loss."""
    vtrain = Workload(profile_model(MODEL_FILE, {"size": "tiny"}, dtype="bf16"), zoo.cluster, 2,
                      switches=("megatron_cross_entropy",))
    head = vtrain.profile.head
    assert (head.tp_comm_bytes, head.tp_gather_bytes) == (0, 0) and head.tp_fwd_flops > 0
    ar, _ = _prices(vtrain)
    b = PLAN.micro_batch_size
    expected = LAYERS * 2 * ar(b * 2 * S * H * 2) + ar(b * S * H * 2) + 3 * ar(b * S * 4) + ar(b * S * H * 2)
    assert estimate(vtrain, PLAN).breakdown["tp_comm"] == pytest.approx(expected, rel=1e-12)
    plain = dataclasses.replace(vtrain, switches=())  # the file's loss, on logits it leaves sharded: the same
    assert estimate(plain, PLAN).breakdown["tp_comm"] == pytest.approx(expected, rel=1e-12)
