"""Pipeline stages cut from the whole model at its blocks, in the order its forward runs them.

What runs before the first block goes to the first stage, what runs after the last to the last
stage, whatever the modules are called (`autopar/layout.py` reads the forward). The first and the
last stage may hold no block (`layer_split` 0 at an end): then the first runs only what comes
before the first block (the embedding), the last only what comes after the last (norm, head). Two ways to cut,
both keeping the model's own parameter names (checkpoints map across plans, tp_plan entries and
tied weights find their modules):

* a forward that skips parts set to None and runs nn.Identity blocks (torchtitan's layout: the
  zoo's `StagedModel`, `hf:` models) gets copies of the model, other stages' blocks nn.Identity,
  the other ends' modules None (torchtitan's way);
* any other forward is cut from its fx graph: a stage is a `GraphModule` running its part of the
  forward's glue with the model's modules under their own names, and the values live across a
  cut (the blocks' outputs) are what it passes to the next stage.

A pipeline rank holds `virtual_stages` such chunks: stages r, r + pp, r + 2·pp, ..., or under the V-shaped
zero-bubble schedules (zbv, dualpipev) stages r and 2·pp-1-r (`stage_ids`).
"""

from __future__ import annotations

import copy
from itertools import accumulate

from torch import fx, nn
from torch.fx.graph_module import _copy_attr
from torch.nn.parallel import DistributedDataParallel

from autopar.errors import PlanError
from autopar.knobs import rank_stages
from autopar.layout import ForwardLayout, forward_layout, live, recomputable
from autopar.plan import Plan


def schedule_class(name: str) -> type:
    """torch's schedule class for a plan's schedule name. torch.distributed.pipelining is imported here, on a
    pipelined plan's first use: it imports torch._dynamo (about a CPU-second per process), which the ranks
    of every other plan, and the launcher's pre-flight (it only cuts stages), never need."""
    from torch.distributed import pipelining  # imports torch._dynamo: only a pipelined plan's ranks pay it

    return {"gpipe": pipelining.ScheduleGPipe, "1f1b": pipelining.Schedule1F1B,
            "interleaved": pipelining.ScheduleInterleaved1F1B, "zb": pipelining.ScheduleInterleavedZeroBubble,
            "zbv": pipelining.ScheduleZBVZeroBubble, "dualpipev": pipelining.ScheduleDualPipeV}[name]


def stage_ids(plan: Plan, pp_rank: int) -> list[int]:
    """Virtual stages held by pipeline rank `pp_rank`, in pipeline order (looped: r, r + pp, ...; a V
    for zbv / dualpipev: r and 2pp-1-r): the placement `autopar.knobs.stage_rank` declares."""
    return rank_stages(plan.pp, plan.virtual_stages, plan.schedule, pp_rank)


def cut_stages(model: nn.Module, blocks: nn.ModuleList, plan: Plan, pp_rank: int,
               layout: ForwardLayout | None = None) -> list[nn.Module]:
    """This rank's stage modules (one per virtual stage), cut from the full `model`."""
    layout = layout or forward_layout(model, blocks)
    if layout.pp_problem:
        raise PlanError(layout.pp_problem)
    split = plan.split_for(len(blocks))
    if sum(split) != len(blocks):
        raise PlanError(f"layer_split {list(split)} sums to {sum(split)} but the model has {len(blocks)} blocks")
    bounds = [0, *accumulate(split)]
    cut = _copied_stage if layout.skips_parts else _graph_stage
    return [cut(model, list(blocks), layout, bounds[s], bounds[s + 1], s == 0, s == plan.stages - 1)
            for s in stage_ids(plan, pp_rank)]


def _copied_stage(model, blocks, layout: ForwardLayout, lo: int, hi: int, first: bool, last: bool) -> nn.Module:
    """A copy of the model keeping blocks lo..hi-1 (the others nn.Identity) and the ends' modules
    with parameters of the first / last stage only where it is that stage."""
    skip = nn.Identity()
    # deepcopy with a memo that maps dropped parts to a placeholder copies only what is kept
    memo = {id(b): skip for i, b in enumerate(blocks) if not lo <= i < hi}
    for ends, here in ((layout.first, first), (layout.last, last)):
        if not here:
            memo.update({id(m): None for m in _param_modules(model, ends)})
    return copy.deepcopy(model, memo)


def _param_modules(model: nn.Module, names) -> list[nn.Module]:
    modules = dict(model.named_modules())
    return [modules[n] for n in names if n in modules and any(True for _ in modules[n].parameters())]


def _graph_stage(model, blocks, layout: ForwardLayout, lo: int, hi: int, first: bool, last: bool) -> nn.Module:
    """The forward's graph from block lo (the start, on the first stage) to block hi (the end, on
    the last) as a GraphModule over the model's own modules, copied."""
    nodes = list(layout.graph.nodes)
    where = {n.target: i for i, n in enumerate(nodes) if n.op == "call_module" and n.target in layout.blocks}
    # a cut at block i is where that block's call starts; after the last block (a head-only last
    # stage): just past its call
    cuts = [where[name] for name in layout.blocks] + [where[layout.blocks[-1]] + 1]
    start = 0 if first else cuts[lo]
    end = len(nodes) if last else cuts[hi]
    graph, env = fx.Graph(), {}
    if not first:
        for n in live(nodes, start):
            env[n] = graph.placeholder(n.name)

    def value(n: fx.Node):
        if n not in env:  # made by an earlier stage: a parameter, buffer or constant computed again here
            assert recomputable(n), n
            env[n] = graph.node_copy(n, value)
        return env[n]

    for n in nodes[start:end]:
        if n.op == "output":
            graph.output(fx.node.map_arg(n.args[0], value))
        elif n.op != "placeholder" or first:
            env[n] = graph.node_copy(n, value)
    if not last:
        out = [value(n) for n in live(nodes, end)]
        graph.output(out[0] if len(out) == 1 else tuple(out))
    stage = fx.GraphModule(model, graph, class_name=type(model).__name__ + "Stage")
    _keep_buffer_kinds(model, stage)
    if first:
        _keep_unused(model, stage, layout)
    return copy.deepcopy(stage)


def _keep_buffer_kinds(model: nn.Module, stage: nn.Module) -> None:
    """Buffers the forward reads by name stay non-persistent where the model's are (GraphModule
    registers every buffer it copies as persistent), so checkpoints hold the same entries."""
    for name, _ in stage.named_buffers():
        owner, _, leaf = name.rpartition(".")
        if leaf in model.get_submodule(owner)._non_persistent_buffers_set:
            stage.get_submodule(owner)._non_persistent_buffers_set.add(leaf)


def _keep_unused(model: nn.Module, stage: nn.Module, layout: ForwardLayout) -> None:
    """Modules with parameters the forward never uses ride on the first stage: every parameter
    keeps a place, so checkpoints of any plan hold the same entries."""
    used = {n.target for n in layout.graph.nodes if n.op in ("call_module", "get_attr")}
    for name, module in model.named_modules():
        if name and module._parameters and not any(name == u or name.startswith(u + ".") for u in used):
            _copy_attr(model, stage, name)


def held_blocks(part: nn.Module, layout: ForwardLayout) -> list[tuple[nn.Module, str]]:
    """(parent module, child name) of each block `part` really runs (not another stage's
    placeholder), in forward order: where recompute and compile wrap them in place."""
    held = []
    for name in layout.blocks:
        parent, _, key = name.rpartition(".")
        try:
            container = part.get_submodule(parent)
        except AttributeError:
            continue
        block = container._modules.get(key)
        if block is not None and not isinstance(block, nn.Identity):
            held.append((container, key))
    return held


def rank_view(parts: list[nn.Module]) -> nn.Module:
    """One module holding every part this rank owns under the full model's names: what the
    optimizer and distributed checkpoints see. A plain container, never run."""
    real = list({id(p): p for p in parts if p is not None and not isinstance(p, nn.Identity)}.values())
    if len(real) <= 1:
        return real[0] if real else parts[0]
    # not a copy of parts[0]: FSDP's wrapped classes re-run __init__ when copied
    view = nn.ModuleList() if all(isinstance(p, nn.ModuleList) for p in real) else nn.Module()
    for p in real:
        view._parameters.update(p._parameters)
        view._buffers.update(p._buffers)
        view._non_persistent_buffers_set |= p._non_persistent_buffers_set
    for name in dict.fromkeys(k for p in real for k in p._modules):
        subs = [p._modules[name] for p in real if p._modules.get(name) is not None]
        view._modules[name] = rank_view(subs) if subs else None
    return view


def build_schedule(parts: list[nn.Module], plan: Plan, pp_rank: int, device, group, loss_fn):
    """The pipeline schedule that runs this rank's stages (parts already parallelised)."""
    for part in parts:
        if isinstance(part, DistributedDataParallel):
            # the stage arms DDP's reducer itself before the last micro-batch's backward; DDP's
            # own forward must not, which the stage's shape-inference forward would otherwise do
            part.require_backward_grad_sync = False
    from torch.distributed.pipelining import PipelineStage  # imports torch._dynamo: see schedule_class
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti  # the same

    stages = [PipelineStage(part, stage, plan.stages, device, group=group)
              for part, stage in zip(parts, stage_ids(plan, pp_rank))]
    schedule = schedule_class(plan.schedule)
    # a multi-stage schedule (interleaved, zero-bubble, V) takes this rank's stages, the others its one stage
    held = stages if issubclass(schedule, PipelineScheduleMulti) else stages[0]
    return schedule(held, n_microbatches=plan.num_micro_batches, loss_fn=loss_fn)
