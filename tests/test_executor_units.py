"""Executor pieces that need no process group (plus single-rank applies): TP styles, pipeline
cuts, data shares, measurement summaries, launch command lines, refusals."""

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.utils.data import DistributedSampler

from autopar.errors import PlanError
from autopar.executor.data import local_share
from autopar.executor.launch import check_world_size, torchrun_argv
from autopar.executor.measure import summarize, tokens_per_sample
from autopar.executor.options import RunOptions
from autopar.executor.mesh import resolve_backend
from autopar.executor.support import check_supported
from autopar.executor.parity import reference_losses
from autopar.executor.pipeline import cut_stages, rank_view, stage_ids
from autopar.executor.tensor_parallel import RegionInput, tp_styles
from autopar.executor.train_step import apply
from autopar.executor.weights import build_full_model, build_skeleton, unsaved_buffers
from autopar.modelfile import load_model_file
from autopar.plan import Plan

ARGS = {"size": "tiny", "dropout": 0.0}
GPT = load_model_file("gpt")


def plan(**kw) -> Plan:
    base = {"dp": 1, "tp": 1, "pp": 1, "micro_batch_size": 4, "num_micro_batches": 1, "precision": "fp32"}
    return Plan(**{**base, **kw})


def gpt_model() -> nn.Module:
    return build_full_model(lambda: GPT.build(**ARGS), seed=0)


def test_tp_styles_follow_megatron_regions():
    model = gpt_model()
    styles = tp_styles(model, GPT.tp_plan(model), model.layers, sequence_parallel=False)
    assert isinstance(styles["layers.0.attention.wqkv"], ColwiseParallel)
    assert isinstance(styles["layers.3.feed_forward.w2"], RowwiseParallel)
    assert styles["layers.0.attention.wo"].output_layouts == (Replicate(),)
    assert isinstance(styles["tok_embeddings.tok"], RowwiseParallel)  # vocab rows
    assert styles["output"].output_layouts == (Replicate(),)  # logits gathered for the loss
    assert not any(isinstance(s, SequenceParallel) for s in styles.values())
    assert not any(isinstance(s, RegionInput) for s in styles.values())  # one entry linear per region


def test_separate_entry_linears_share_one_replicated_input():
    llama = load_model_file("llama")
    model = llama.build(size="tiny")
    styles = tp_styles(model, llama.tp_plan(model), model.layers, sequence_parallel=False)
    for owner in ("layers.0.attention", "layers.3.feed_forward"):  # q, k, v; w1, w3
        assert isinstance(styles[owner], RegionInput) and not styles[owner].sequence_sharded


def test_sequence_parallel_shards_the_residual_stream():
    model = gpt_model()
    styles = tp_styles(model, GPT.tp_plan(model), model.layers, sequence_parallel=True)
    for norm in ("layers.0.attention_norm", "layers.2.ffn_norm", "norm"):
        assert isinstance(styles[norm], SequenceParallel)
    gather = styles["layers.1.attention"]  # gathers the sequence once for the fused QKV
    assert isinstance(gather, RegionInput)  # by position or by keyword (transformers' attention)
    assert styles["layers.1.feed_forward.w2"].output_layouts == (Shard(1),)  # reduce-scatter
    assert isinstance(styles["tok_embeddings"], PrepareModuleOutput)  # tokens + positions, then scatter
    assert styles["output"].input_layouts == (Shard(1),)


@pytest.mark.parametrize("name", ["llama", "vit"])
def test_sequence_parallel_finds_where_the_stream_starts_and_ends(name):
    zoo = load_model_file(name)
    model = zoo.build(size="tiny")
    styles = tp_styles(model, zoo.tp_plan(model), model.layers, sequence_parallel=True)
    if name == "llama":  # a bare vocab embedding and head: reduce-scatter in, gather for the loss
        assert styles["tok_embeddings"].output_layouts == (Shard(1),)
        assert styles["output"].input_layouts == (Shard(1),)
    else:  # patches + CLS + positions run whole, then scatter; the classifier reads the whole sequence
        assert isinstance(styles["tok_embeddings"], PrepareModuleOutput)
        assert isinstance(styles["output"], RegionInput)


def test_pipeline_cut_keeps_names_and_ends():
    p = plan(pp=2, num_micro_batches=2, schedule="interleaved", virtual_stages=2)
    model = gpt_model()
    names = dict(model.named_parameters())
    assert stage_ids(p, 0) == [0, 2] and stage_ids(p, 1) == [1, 3]
    first, third = cut_stages(model, model.layers, p, pp_rank=0)
    assert first.norm is None and first.output is None and first.tok_embeddings is not None
    assert third.tok_embeddings is None and third.output is None
    assert [type(b).__name__ for b in first.layers] == ["Block", "Identity", "Identity", "Identity"]
    assert [type(b).__name__ for b in third.layers] == ["Identity", "Identity", "Block", "Identity"]
    view = rank_view([first, third])
    held = dict(view.named_parameters())
    assert set(held) < set(names) and {n.split(".")[1] for n in held if n.startswith("layers.")} == {"0", "2"}
    assert all(torch.equal(held[n], names[n]) for n in held)  # copies of the same initial weights


def test_pipeline_refuses_forwards_it_cannot_cut():
    model = gpt_model()
    model.__class__ = type("Revisits", (type(model),), {  # a forward that runs one block twice
        "forward": lambda self, x: self.output(self.layers[0](self.layers[0](self.tok_embeddings(x))))})
    with pytest.raises(PlanError, match=r"runs each block once, in order, but the forward calls \[layers.0, layers.0\]"):
        cut_stages(model, model.layers, plan(pp=2, num_micro_batches=2), pp_rank=0)


def test_local_share_is_the_distributed_sampler_share():
    p = plan(dp=4, micro_batch_size=2)
    batch = torch.arange(p.global_batch * 3).reshape(p.global_batch, 3)
    for rank in range(4):
        sampler = DistributedSampler(range(p.global_batch), num_replicas=4, rank=rank, shuffle=False)
        assert torch.equal(local_share(batch, p, rank), batch[list(sampler)])
    with pytest.raises(ValueError, match="global batch is 8"):
        local_share(batch[:5], p, 0)


def test_summary_takes_the_slowest_rank_per_step():
    m = summarize([[0.1, 0.3, 0.2], [0.2, 0.1, 0.2]], [10, 20], global_batch=8, seq_len=32)
    assert m["step_times_s"] == [0.2, 0.3, 0.2] and m["median_step_s"] == 0.2
    assert m["tokens_per_s"] == pytest.approx(8 * 32 / 0.2) and m["peak_memory_bytes"] == [10, 20]
    assert tokens_per_sample((torch.zeros(4, 32, dtype=torch.long),)) == 32
    assert tokens_per_sample((torch.zeros(4, 3, 8, 8),)) == 1


def test_refusals_before_launch():
    with pytest.raises(PlanError, match=r"needs dp x tp x pp x cp = 2 x 1 x 1 x 1 = 2 ranks but --nnodes 1 x "
                                        r"--nproc-per-node 4 = 4"):
        check_world_size(plan(dp=2), RunOptions(nproc_per_node=4))
    with pytest.raises(PlanError, match="needs NCCL"):
        check_supported(plan(dp=2, grad_comm_dtype="bf16"), "gloo")
    check_supported(plan(dp=2, grad_comm_dtype="fp16"), "gloo")
    if not torch.cuda.is_available():
        with pytest.raises(PlanError, match="'nccl' needs CUDA"):
            resolve_backend("nccl")
    assert resolve_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")


def test_torchrun_command_lines():
    single = torchrun_argv("p.json", "gpt", {"size": "tiny"}, RunOptions(nproc_per_node=2), "r.json")
    assert single[:3] == ["--standalone", "--nnodes", "1"] and "--max-restarts" in single
    assert single[single.index("--module") + 1] == "autopar.executor.worker"
    multi = torchrun_argv("p.json", "gpt", {}, RunOptions(nproc_per_node=2, nnodes=2, node_rank=1,
                                                          master_port=1234, timeout_s=5), "r.json")
    assert "--standalone" not in multi and multi[multi.index("--node-rank") + 1] == "1"
    assert multi[multi.index("--master-port") + 1] == "1234" and multi[multi.index("--timeout") + 1] == "5"


@pytest.fixture
def one_rank_world():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def test_single_rank_apply_matches_the_plain_loop(one_rank_world):
    """A world of one (no torchrun): micro-batching and selective recompute keep the losses."""
    p = plan(micro_batch_size=2, num_micro_batches=2, recompute="selective")
    build = lambda: GPT.build(**ARGS)
    optimizer = lambda params: torch.optim.SGD(params, lr=2.0)
    torch.manual_seed(1)
    batch = GPT.example_batch(p.global_batch, device="cpu", **ARGS)
    par = apply(p, build, optimizer, GPT.loss_fn, blocks=GPT.blocks)
    losses = par.global_losses([par.train_step(*par.local_batch(*batch)) for _ in range(3)])
    assert losses == pytest.approx(reference_losses(build, optimizer, GPT.loss_fn, [batch] * 3), rel=1e-5)
    assert losses[2] < losses[0]


def _gloo_threads() -> int:
    """Threads gloo runs for live process groups (named by torch and gloo; Linux's /proc)."""
    tasks = Path("/proc/self/task")
    return sum("gloo" in (tasks / t / "comm").read_text() for t in os.listdir(tasks))


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="counts threads through Linux's /proc")
def test_close_lets_destroying_the_groups_join_their_threads(one_rank_world):
    """`close` drops every reference the ParallelModel holds to the process groups, so that
    destroy_process_group joins gloo's threads rather than leave them to interpreter exit (an abort
    when one is still freeing a collective's tensors then). Without close they outlive destroy."""
    from autopar.executor.mesh import release_meshes

    release_meshes()  # what earlier tests left for the collector
    before = _gloo_threads()
    p = plan(zero=3)  # FSDP2: its hooks hold the mesh in reference cycles
    par = apply(p, lambda: GPT.build(**ARGS), lambda params: torch.optim.SGD(params, lr=0.1), GPT.loss_fn,
                blocks=GPT.blocks)
    par.global_losses([par.train_step(*par.local_batch(*GPT.example_batch(p.global_batch, device="cpu", **ARGS)))])
    assert _gloo_threads() > before
    par.close()
    dist.destroy_process_group()
    assert _gloo_threads() == before
    assert par.model is None and par.schedule is None


def _selective_run(block, x):
    """Run `block` under selective checkpointing; (ops recomputed, their FLOPs, bytes of outputs kept)."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
    from torch.utils.flop_counter import flop_registry

    from autopar.executor.checkpointing import SelectivePolicy

    recomputed, flops, kept = [], 0, 0
    selective = SelectivePolicy()

    def policy(ctx, op, *a, **k):
        nonlocal flops, kept
        decision = selective(ctx, op, *a, **k)
        if not ctx.is_recompute:
            out = op(*a, **k) if decision.name == "MUST_SAVE" or op._overloadpacket in flop_registry else None
            if decision.name == "PREFER_RECOMPUTE":
                recomputed.append(op._overloadpacket.__name__)
                if op._overloadpacket in flop_registry:
                    flops += flop_registry[op._overloadpacket](*a, **k, out_val=out)
            elif not op.is_view:  # views share their base's storage: no new bytes
                kept += sum(t.nbytes for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return decision

    torch.manual_seed(0)
    out = checkpoint(block, x, use_reentrant=False, context_fn=lambda: create_selective_checkpoint_contexts(policy))
    out.sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    return recomputed, flops, kept


@pytest.mark.parametrize("dims", [{"hidden": 256, "seq_len": 64}, {"hidden": 128, "seq_len": 48}],
                         ids=["head size = seq len", "head size < seq len"])
def test_selective_recompute_redoes_what_the_profile_counts_as_the_attention_core(dims):
    """The executor's selective-checkpoint policy recomputes exactly the attention core the cost
    model charges for: the same FLOPs as the profile's attn_core_flops, and nothing outside it
    (no GEMM of a linear layer, no LayerNorm, GeLU or residual) but the dropouts."""
    from autopar.profile import profile_model

    args = {"size": "tiny", "layers": 1, "dropout": 0.1, **dims}
    block = GPT.blocks(build_full_model(lambda: GPT.build(**args), 0))[0]
    x = torch.randn(3, dims["seq_len"], dims["hidden"], requires_grad=True)
    recomputed, flops, _ = _selective_run(block, x)
    core = ["bmm", "mul", "masked_fill", "_softmax", "empty_like", "bernoulli_", "div_", "mul", "bmm"]
    dropout = ["empty_like", "bernoulli_", "div_", "mul"]  # the residual dropouts: noise and product redone
    assert recomputed == core + dropout + dropout
    layer = profile_model("gpt", args, dtype="fp32").layers[0]
    assert flops == 3 * layer.attn_core_flops


def test_selective_recompute_keeps_the_same_tensors_with_cuda_kernels(monkeypatch):
    """CUDA runs dropout as one native_dropout op (output and mask): it is redone whole, as the
    CPU's noise fill and multiply are, so selective recompute keeps the same bytes on a GPU as
    here (the profiler's CUDA dropout, patched in, dispatches what CUDA does)."""
    from autopar.profile.kernels import _dropout

    args = {"size": "tiny", "layers": 1, "dropout": 0.1, "hidden": 128, "seq_len": 48}
    block = GPT.blocks(build_full_model(lambda: GPT.build(**args), 0))[0]
    x = torch.randn(3, 48, 128, requires_grad=True)
    cpu_ops, cpu_flops, cpu_kept = _selective_run(block, x)
    x.grad = None
    monkeypatch.setattr(torch.nn.functional, "dropout", _dropout)
    cuda_ops, cuda_flops, cuda_kept = _selective_run(block, x)
    assert cuda_ops.count("native_dropout") == 3 and "bernoulli_" not in cuda_ops  # attention + 2 residual
    assert cuda_flops == cpu_flops and cuda_kept == cpu_kept > 0


def test_the_skeleton_holds_no_weights_even_from_a_builder_that_makes_them():
    """apply lays plans out on this skeleton on every rank; only rank 0 builds the real model."""
    real = GPT.module.build_model(**ARGS)  # the model.py's own function: CPU weights
    assert not any(p.is_meta for p in real.parameters())
    skeleton = build_skeleton(lambda: GPT.module.build_model(**ARGS))
    assert all(t.is_meta for t in [*skeleton.parameters(), *skeleton.buffers()])
    assert set(unsaved_buffers(skeleton)) == {f"layers.{i}.attention.mask" for i in range(len(skeleton.layers))}


class _ReadsValues(nn.Module):
    """A constructor that reads a tensor's value: it cannot run on the meta device."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, int(torch.ones(()).item()) + 1)


def test_a_model_that_cannot_be_built_on_meta_is_built_whole_for_its_skeleton():
    skeleton = build_skeleton(_ReadsValues)
    assert skeleton.lin.out_features == 2 and not skeleton.lin.weight.is_meta
