"""What the head's loss keeps for backward, as the runtime runs it (cost/cross_entropy.py
`saved_as_run`): the file's loss reads the gathered logits, so what it saves counts whole on every
rank with sequence parallelism too; Megatron's vocab-parallel loss keeps an fp32 softmax of the
rank's vocabulary share instead; and the head, at the end of the last chunk, has one micro-batch
in flight under 1F1B and interleaving (all of them under GPipe), not its rank's average."""

from __future__ import annotations

import dataclasses

import pytest

from autopar.cost import estimate
from autopar.plan import Plan
from autopar.workload import Workload
from conftest import workload

V, S = 256, 32  # the tiny GPT's vocabulary and sequence


@pytest.fixture(scope="module")
def gpt():
    return workload("gpt", "dgx-a100-80g", gpus_per_node=4, global_batch=8, size="tiny")


def _heavier_head(w: Workload, extra: float, loss: bool) -> Workload:
    """`w` with `extra` more saved bytes per sample at the head, counted as the loss's or not."""
    head = w.profile.head
    more = dataclasses.replace(head, saved_bytes=head.saved_bytes + extra,
                               loss_saved_bytes=head.loss_saved_bytes + (extra if loss else 0.0))
    return dataclasses.replace(w, profile=dataclasses.replace(w.profile, blocks=(*w.profile.blocks[:-1], more)))


def _activations(w: Workload, plan: Plan) -> float:
    return estimate(w, plan).memory["activations"]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_files_loss_counts_whole_on_every_rank(gpt, sequence_parallel):
    plan = Plan(dp=2, tp=2, pp=1, micro_batch_size=2, num_micro_batches=2, precision="bf16", recompute="none",
                sequence_parallel=sequence_parallel)
    extra = 1e6
    base = _activations(gpt, plan)
    as_loss = _activations(_heavier_head(gpt, extra, loss=True), plan) - base
    as_rest = _activations(_heavier_head(gpt, extra, loss=False), plan) - base
    assert as_loss == pytest.approx(2 * extra, rel=1e-12)  # micro-batch 2, whole on each rank
    # the head's other saved tensors are sharded along the sequence with the stream
    assert as_rest == pytest.approx(2 * extra / (2 if sequence_parallel else 1), rel=1e-12)


def test_megatrons_loss_saves_an_fp32_softmax_of_the_ranks_vocabulary_share(gpt):
    head = gpt.profile.head
    assert S * V * 2 + S * 8 <= head.loss_saved_bytes < S * V * 2 + S * 8 + 16  # bf16 log-softmax, targets
    megatron = dataclasses.replace(gpt, runtime="megatron")
    for tp in (1, 2, 4):
        plan = Plan(dp=4 // tp, tp=tp, pp=1, micro_batch_size=2, num_micro_batches=tp, precision="bf16",
                    recompute="none", sequence_parallel=tp > 1)
        share = -(-V // (128 * tp)) * 128  # Megatron pads the vocabulary to a multiple of 128 x tp
        delta = _activations(megatron, plan) - _activations(gpt, plan)
        # under SP Megatron also saves the column-wise linears' inputs sharded (tests/test_sp_memory.py)
        entries = sum(b.count * b.entry_saved_bytes for b in gpt.profile.blocks) * (1 - 1 / tp)
        assert delta == pytest.approx(2 * (S * (4 * share + 9) - head.loss_saved_bytes - entries), rel=1e-9)


@pytest.mark.parametrize(("schedule", "virtual", "in_flight"),
                         [("1f1b", 1, 1), ("interleaved", 2, 1), ("gpipe", 1, 4)])
def test_the_head_has_one_micro_batch_in_flight_but_under_gpipe(gpt, schedule, virtual, in_flight):
    plan = Plan(dp=2, tp=1, pp=2, micro_batch_size=1, num_micro_batches=4, precision="bf16", recompute="none",
                schedule=schedule, virtual_stages=virtual)
    extra = 1e9  # makes the head's rank the peak, with one extra or two
    one, two = (_activations(_heavier_head(gpt, n * extra, loss=False), plan) for n in (1, 2))
    assert two - one == pytest.approx(extra * in_flight, rel=1e-9)
