"""Pipeline stages cut from the whole model, and the pipeline schedule.

A stage is a copy of the model that keeps its own blocks and drops the rest (torchtitan's way):
other stages' blocks become `nn.Identity` so the kept parameters keep their names (checkpoints
map across plans), and `tok_embeddings` / `norm` / `output` are set to None off the first / last
stage. A pipeline rank holds `virtual_stages` such chunks: stages r, r + pp, r + 2·pp, ...
"""

from __future__ import annotations

import copy
from itertools import accumulate

from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.nn.parallel import DistributedDataParallel

from autopar.errors import PlanError
from autopar.plan import Plan

FIRST_ONLY = ("tok_embeddings",)
LAST_ONLY = ("norm", "output")


def blocks_name(model: nn.Module, blocks: nn.ModuleList) -> str:
    """The attribute of `model` holding `blocks`; pipelining needs them as a direct child."""
    for name, child in model.named_children():
        if child is blocks:
            return name
    raise PlanError("pipeline parallelism needs the repeated blocks as a top-level nn.ModuleList of the "
                    "model (torchtitan layout: tok_embeddings, layers, norm, output); use pp=1 for this model")


def check_layout(model: nn.Module, blocks: nn.ModuleList) -> str:
    """The blocks' attribute name; every other top-level part must be one the stages know where
    to put (the model.py contract's pipeline layout)."""
    name = blocks_name(model, blocks)
    strays = [child for child, module in model.named_children()
              if child != name and child not in FIRST_ONLY + LAST_ONLY
              and module is not None and any(True for _ in module.parameters())]
    if strays:
        raise PlanError(f"pipeline parallelism cannot place the model's top-level module(s) {strays}: stages "
                        f"know {list(FIRST_ONLY)} (first stage), {list(LAST_ONLY)} (last stage) and the "
                        f"blocks; rename them accordingly or use pp=1")
    return name


def stage_ids(plan: Plan, pp_rank: int) -> list[int]:
    """Virtual stages held by pipeline rank `pp_rank`, in execution order."""
    return [pp_rank + chunk * plan.pp for chunk in range(plan.virtual_stages)]


def cut_stages(model: nn.Module, blocks: nn.ModuleList, plan: Plan, pp_rank: int) -> list[nn.Module]:
    """This rank's stage modules (one per virtual stage), copied from the full `model`."""
    check_layout(model, blocks)
    split = plan.split_for(len(blocks))
    if sum(split) != len(blocks):
        raise PlanError(f"layer_split {list(split)} sums to {sum(split)} but the model has {len(blocks)} blocks")
    bounds = [0, *accumulate(split)]
    stages = []
    for stage in stage_ids(plan, pp_rank):
        keep = range(bounds[stage], bounds[stage + 1])
        skip = nn.Identity()
        # deepcopy with a memo that maps dropped parts to a placeholder copies only what is kept
        memo = {id(b): skip for i, b in enumerate(blocks) if i not in keep}
        if stage != 0:
            memo.update({id(getattr(model, n)): None for n in FIRST_ONLY if getattr(model, n, None) is not None})
        if stage != plan.stages - 1:
            memo.update({id(getattr(model, n)): None for n in LAST_ONLY if getattr(model, n, None) is not None})
        stages.append(copy.deepcopy(model, memo))
    return stages


def rank_view(parts: list[nn.Module], name: str) -> nn.Module:
    """One module holding every part this rank owns under the full model's names: what the
    optimizer and distributed checkpoints see. A plain container, never run."""
    if len(parts) == 1:
        return parts[0]
    view = nn.Module()  # not a copy of parts[0]: FSDP's wrapped classes re-run __init__ when copied
    view._parameters, view._buffers = dict(parts[0]._parameters), dict(parts[0]._buffers)
    view._modules = dict(parts[0]._modules)
    for child in FIRST_ONLY + LAST_ONLY:
        if child in view._modules:
            view._modules[child] = next((p._modules[child] for p in parts if p._modules.get(child) is not None),
                                        None)
    lists = [p._modules[name] for p in parts]
    view._modules[name] = nn.ModuleList(
        next((lst[i] for lst in lists if not isinstance(lst[i], nn.Identity)), lists[0][i])
        for i in range(len(lists[0])))
    return view


def build_schedule(parts: list[nn.Module], plan: Plan, pp_rank: int, device, group, loss_fn):
    """The pipeline schedule that runs this rank's stages (parts already parallelised)."""
    for part in parts:
        if isinstance(part, DistributedDataParallel):
            # the stage arms DDP's reducer itself before the last micro-batch's backward; DDP's
            # own forward must not, which the stage's shape-inference forward would otherwise do
            part.require_backward_grad_sync = False
    stages = [PipelineStage(part, stage, plan.stages, device, group=group)
              for part, stage in zip(parts, stage_ids(plan, pp_rank))]
    if plan.schedule == "interleaved":
        return ScheduleInterleaved1F1B(stages, n_microbatches=plan.num_micro_batches, loss_fn=loss_fn)
    schedule = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
    return schedule(stages[0], n_microbatches=plan.num_micro_batches, loss_fn=loss_fn)
