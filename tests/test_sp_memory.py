"""Under sequence parallelism torch's DTensor linears save their input as gathered along the
sequence, whole on every rank (autopar's executor hands a region's column-wise linears a
replicated DTensor, as torchtitan's plans do), where Megatron's save the rank's sequence shard and
gather it again in backward. The profiler marks those inputs (`entry_saved_bytes`) and the cost
model keeps them whole under runtime torch. Checked against what the executor's autograd graph
saves on torch's fake process group (two ranks, in-process)."""

from __future__ import annotations

import pytest
import torch
from conftest import FAKE_TP, workload
from torch.distributed.tensor import DTensor

from autopar.cost import estimate
from autopar.executor.tensor_parallel import apply_tp
from autopar.executor.weights import build_full_model
from autopar.modelfile import load_model_file
from autopar.plan import Plan

TP, BATCH = FAKE_TP, 2


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _saved_entry_inputs(mesh, name: str, sequence_parallel: bool) -> int:
    """Bytes on this rank of the saved tensors that are a column-wise linear's input, one forward."""
    zoo = load_model_file(name)
    model = build_full_model(lambda: zoo.build(size="tiny"), seed=0)
    plan = zoo.tp_plan(model)
    apply_tp(model, mesh, plan, zoo.blocks(model), sequence_parallel)
    entries = {}  # storage key -> bytes of a column-wise linear's input on this rank

    def note(module, args):
        x = _local(args[0])
        entries[x.untyped_storage()._cdata] = x.numel() * x.element_size()

    colwise = [model.get_submodule(fqn) for fqn, style in plan.items()
               if style in ("colwise", "vocab") and isinstance(model.get_submodule(fqn), torch.nn.Linear)]
    handles = [m.register_forward_pre_hook(note) for m in colwise]
    saved = set()

    def pack(t):
        saved.add(_local(t).untyped_storage()._cdata)
        return t

    x, _ = zoo.example_batch(BATCH, device="cpu", size="tiny")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*x)
    for h in handles:
        h.remove()
    return sum(n for key, n in entries.items() if key in saved)


@pytest.mark.parametrize("name", ["gpt", "llama"])  # fused q·k·v / separate q, k, v and gate, up
def test_column_wise_inputs_are_saved_whole_under_sequence_parallel(fake_tp_mesh, name):
    w = workload(name, gpus_per_node=TP, global_batch=BATCH, dtype="fp32", size="tiny")
    p, (s, h) = w.profile, (w.profile.seq_len, w.profile.dims["hidden"])
    # one input per region however many linears read it: the attention's and the MLP's, and the head's
    assert [b.entry_saved_bytes for b in p.blocks] == [0.0, 2 * s * h * 4, s * h * 4]
    whole = BATCH * sum(b.count * b.entry_saved_bytes for b in p.blocks)
    assert _saved_entry_inputs(fake_tp_mesh, name, sequence_parallel=False) == whole
    assert _saved_entry_inputs(fake_tp_mesh, name, sequence_parallel=True) == whole  # not whole / TP


def test_cost_model_keeps_them_whole_under_torch():
    """Megatron's layers keep the shard (Korthikanti's count: tests/test_megatron_memory.py)."""
    w = workload("llama", gpus_per_node=8, global_batch=8, size="small")
    p = w.profile
    entry = sum(b.count * b.entry_saved_bytes for b in p.blocks)
    assert entry > 0
    plan = Plan(dp=4, tp=2, pp=1, micro_batch_size=1, num_micro_batches=2)
    sp = plan.with_(sequence_parallel=True)
    replicated = sum(b.count * (b.saved_bytes - b.saved_tp_bytes - (b.loss_saved_bytes - b.loss_saved_tp_bytes))
                     for b in p.blocks)
    # runtime torch: sequence parallelism shards what stays replicated under tp, less the entries
    torch_drop = estimate(w, plan).memory["activations"] - estimate(w, sp).memory["activations"]
    assert torch_drop == pytest.approx((replicated - entry) / 2, rel=1e-9)
