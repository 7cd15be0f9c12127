"""Per-stage plans in the executor (issue 41), in process: stages of no block cut from both paths
(copies of a torchtitan-style model, fx-graph stages of a model with its own names) compute the
whole model, the tied weight sits on an embedding-only first and a head-only last stage under the
one name pair, and each stage's blocks are wrapped for recompute as its own `stage_recompute`
entry says. Parity on 4 gloo ranks: tests/test_executor_plans.py (STAGES) and
tests/models/own_names_job.py (tied weights)."""

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from conftest import run_stages

from autopar.errors import PlanError
from autopar.executor.checkpointing import apply_ac
from autopar.executor.pipeline import cut_stages, held_blocks, stage_ids
from autopar.executor.tied import tied_names
from autopar.executor.train_step import apply
from autopar.executor.weights import build_full_model
from autopar.layout import forward_layout
from autopar.modelfile import load_model_file
from autopar.plan import Plan

OWN = Path(__file__).resolve().parent / "models" / "gpt_own_names.py"


@functools.lru_cache(maxsize=None)  # the tests cut copies of it and never change it
def build(name: str, tied: bool = False):
    file = load_model_file(name)
    model = build_full_model(lambda: file.build(size="tiny", dropout=0.0), seed=0).eval()
    if tied:
        model.out.weight = model.tok.weight
    return model


def plan(pp: int, split: tuple, v: int = 1, **kw) -> Plan:
    return Plan(dp=1, tp=1, pp=pp, micro_batch_size=1, num_micro_batches=pp, precision="fp32",
                schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v, layer_split=split, **kw)


def stages_of(model, p: Plan) -> dict[int, torch.nn.Module]:
    layout = forward_layout(model, model.layers)
    return {s: part for rank in range(p.pp)
            for s, part in zip(stage_ids(p, rank), cut_stages(model, model.layers, p, rank, layout))}


@pytest.mark.parametrize("name, pp, split, v", [
    (str(OWN), 4, (0, 2, 2, 0), 1), (str(OWN), 2, (0, 3, 1, 0), 2), ("gpt", 4, (0, 2, 2, 0), 1), ("gpt", 2, (4, 0), 1)],
    ids=["graph stages pp4", "graph stages interleaved", "copied stages pp4", "copied stages head-only"])
def test_stages_of_no_block_compute_the_whole_model(name, pp, split, v):
    model = build(name)
    p = plan(pp, split, v)
    by_stage = stages_of(model, p)
    stages = [by_stage[s] for s in range(p.stages)]
    tokens = torch.randint(0, 256, (2, 32))
    assert torch.allclose(run_stages(stages, tokens), model(tokens), atol=1e-6)
    layout = forward_layout(model, model.layers)
    assert [len(held_blocks(s, layout)) for s in stages] == list(split)
    assert sorted(n for s in stages for n in s.state_dict()) == sorted(model.state_dict())  # each entry once
    if split[0] == 0:  # the embedding only: no block's and no head's parameter
        assert not any(n.startswith(("layers.", "norm", "out")) for n, _ in stages[0].named_parameters())
    if split[-1] == 0:
        assert {n.split(".")[0] for n, _ in stages[-1].named_parameters()} <= {"norm", "out", "output"}


def test_an_embedding_only_and_a_head_only_stage_share_the_tied_weight():
    model = build(str(OWN), tied=True)
    by_stage = stages_of(model, plan(4, (0, 2, 2, 0)))
    assert tied_names(model) == [("tok.weight", "out.weight")]
    first, last = by_stage[0], by_stage[3]
    assert "tok.weight" in dict(first.named_parameters()) and "out.weight" in dict(last.named_parameters())
    assert torch.equal(first.get_parameter("tok.weight"), last.get_parameter("out.weight"))


def wrapped(part, layout) -> list[str]:
    """'full', 'selective' or '-' for each block the part runs."""
    out = []
    for container, key in held_blocks(part, layout):
        block = container._modules[key]
        selective = isinstance(block, CheckpointWrapper) and "context_fn" in block.checkpoint_fn.keywords
        out.append("selective" if selective else "full" if isinstance(block, CheckpointWrapper) else "-")
    return out


def test_each_stage_recomputes_what_its_own_entry_says():
    model = build("gpt")
    layout = forward_layout(model, model.layers)
    p = plan(2, (0, 3, 1, 0), v=2, stage_recompute=("none", "full:2", "selective", "none"))
    for rank in range(p.pp):
        parts, ids = cut_stages(model, model.layers, p, rank, layout), stage_ids(p, rank)
        count = apply_ac([held_blocks(part, layout) for part in parts], ids, p)
        got = {s: wrapped(part, layout) for s, part in zip(ids, parts)}
        assert count == sum(b != "-" for blocks in got.values() for b in blocks)
        assert got == ({0: [], 2: ["selective"]} if rank == 0 else {1: ["full", "full", "-"], 3: []})


def test_a_uniform_plan_still_recomputes_the_first_blocks_of_the_rank():
    model = build("gpt")
    layout = forward_layout(model, model.layers)
    p = plan(2, (1, 1, 1, 1), v=2, recompute="full", recompute_blocks=1)
    parts = cut_stages(model, model.layers, p, 0, layout)
    apply_ac([held_blocks(part, layout) for part in parts], stage_ids(p, 0), p)
    assert [wrapped(part, layout) for part in parts] == [["full"], ["-"]]


def test_a_stage_asked_to_recompute_more_blocks_than_it_holds_is_refused_before_any_process_group():
    gpt = load_model_file("gpt")
    p = Plan(dp=1, tp=1, pp=2, micro_batch_size=1, num_micro_batches=2, precision="fp32",
             stage_recompute=("full:3", "none"))  # the balanced split of 4 blocks gives stage 0 two
    with pytest.raises(PlanError, match=r"stage_recompute\[0\] is 'full:3' but stage 0 holds 2 blocks"):
        apply(p, lambda: gpt.build(size="tiny"), lambda ps: torch.optim.SGD(ps, lr=1.0), gpt.loss_fn,
              blocks=gpt.blocks, backend="gloo")
    assert not dist.is_initialized()
