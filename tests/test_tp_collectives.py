"""The executor's tensor-parallel collectives, recorded op by op, are the ones the cost model prices
(cost/tensor_parallel.py): one per Megatron region each way whether q, k and v (or gate and up)
are one linear or several, a reduce-scatter (not an all-reduce) in backward under sequence
parallelism, and per pass the bytes `pass_bytes` charges. Run in-process on torch's fake process
group (two ranks, no communication), so the recorder sees every functional collective DTensor
issues with its real shapes."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from conftest import FAKE_TP, workload
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.cost.model import _kind_arrays
from autopar.cost.tensor_parallel import pass_bytes
from autopar.executor.tensor_parallel import apply_tp
from autopar.executor.weights import build_full_model
from autopar.modelfile import load_model_file

TP, BATCH = FAKE_TP, 2
FUNCOL = torch.ops._c10d_functional


class Collectives(TorchDispatchMode):
    """(kind, bytes of the whole tensor) of every functional collective dispatched while active."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in (FUNCOL.all_reduce, FUNCOL.reduce_scatter_tensor):
            self.calls.append((packet.__name__, args[0].numel() * args[0].element_size()))
        elif packet is FUNCOL.all_gather_into_tensor:  # the input is this rank's piece
            self.calls.append((packet.__name__, TP * args[0].numel() * args[0].element_size()))
        return func(*args, **(kwargs or {}))

    def kinds(self) -> Counter:
        return Counter(kind for kind, _ in self.calls)

    def traffic(self) -> int:
        """In units of (t - 1) / t bytes per rank: an all-reduce of n bytes is a reduce-scatter and an
        all-gather of n, so a sequence-parallel region's pair sends what its all-reduce would."""
        return sum(2 * n if kind == "all_reduce" else n for kind, n in self.calls)


def _passes(mesh, name: str, sequence_parallel: bool) -> tuple[Collectives, Collectives]:
    """The collectives of one forward (with the loss) and one backward of the tiny zoo model `name`."""
    zoo = load_model_file(name)
    model = build_full_model(lambda: zoo.build(size="tiny"), seed=0)
    apply_tp(model, mesh, zoo.tp_plan(model), zoo.blocks(model), sequence_parallel)
    x, y = zoo.example_batch(BATCH, device="cpu", size="tiny")
    with Collectives() as forward:
        loss = zoo.loss_fn(model(*x), y)
    with Collectives() as backward:
        loss.backward()
    return forward, backward


@pytest.mark.parametrize("name", ["llama", "gpt"])  # q, k, v and gate, up separate / fused q·k·v
def test_one_collective_per_region_each_way(fake_tp_mesh, name):
    layers = 4  # the tiny zoo models
    forward, backward = _passes(fake_tp_mesh, name, sequence_parallel=False)
    # embedding and two regions per layer reduce; the head gathers its logits
    assert forward.kinds() == {"all_reduce": 1 + 2 * layers, "all_gather_into_tensor": 1}
    # two regions per layer and the head's input gradient; nothing for the embedding
    assert backward.kinds() == {"all_reduce": 2 * layers + 1}
    forward, backward = _passes(fake_tp_mesh, name, sequence_parallel=True)
    assert backward.kinds()["all_reduce"] == 0  # every region's input gradient is reduce-scattered
    assert backward.kinds()["reduce_scatter_tensor"] == 2 * layers + 1  # and the head's


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_each_pass_sends_what_the_cost_model_prices(fake_tp_mesh, sequence_parallel):
    forward, backward = _passes(fake_tp_mesh, "llama", sequence_parallel)
    w = workload("llama", gpus_per_node=TP, global_batch=BATCH, dtype="fp32", size="tiny")
    sent = pass_bytes(_kind_arrays(w.profile), w)
    assert len(w.profile.layers) == 1  # one layer kind: the embedding, the layers' kind, the head
    counts = np.array([1, w.profile.dims["layers"], 1])
    priced = {k: BATCH * (counts * v).sum() for k, v in sent.items()}  # per sample and block kind
    assert priced["loss"] == 0
    forward_priced, backward_priced = 2 * priced["reduce_f"] + priced["gather_f"], 2 * priced["reduce_b"]
    if sequence_parallel:  # the same traffic, split between the passes differently: priced by its total
        assert forward.traffic() + backward.traffic() == forward_priced + backward_priced
    else:
        assert (forward.traffic(), backward.traffic()) == (forward_priced, backward_priced)
