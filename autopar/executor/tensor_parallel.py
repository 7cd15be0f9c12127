"""Tensor (and sequence) parallelism from a model's declarative `tp_plan`.

A tp_plan of torch ParallelStyle objects (torchtitan's form) is applied as written. A plan of
style names (see `autopar.modelfile.TP_STYLES`) names linears and embeddings; this module turns
those into PyTorch's ParallelStyles, as torchtitan's `apply_tp` does by hand:

* colwise / rowwise pairs form Megatron-LM regions: an all-reduce (no SP) or a reduce-scatter
  (SP) where the region ends;
* "vocab" on an embedding shards its rows; on an output linear it shards the logits and
  gathers them for the loss.

A block's submodule that owns a region's first linears (attention, MLP) takes its input as a
DTensor replicated over the tp group (`RegionInput`, torchtitan's `PrepareModuleInput(...,
use_local_output=False)`): the column-wise linears inside share it, their input gradients add up
as partial sums and are reduced once for the region, as Megatron-LM's fused q/k/v does. Handed a
plain tensor, each `ColwiseParallel` would all-reduce its own input gradient: three for separate
q, k and v, two for gate and up (tests/test_tp_collectives.py counts them).

With sequence parallelism the residual stream between the input module and the head is sharded
along the sequence (dim 1); both are read from the forward (`autopar/layout.py`): the module the
first block's input comes from (else the first block's input itself) and the one the output
comes from. Norms on the stream run on their
shard (`SequenceParallel`, which also reduces their gradients); a region's owner gathers the
sequence once at its input and reduce-scatters the summed input gradient in backward
(`RegionInput`); an input module that is more than one vocab embedding (tokens + positions,
patches) runs replicated and its output is scattered (`PrepareModuleOutput`), as does everything
before the first block when no one module gives it its input (`StreamScatter`); a head that is
more than one vocab linear gathers its input and runs replicated. Other parameters must not
touch the sharded stream, and code inside a region owner must give its input only to the
region's linears (as torchtitan's and transformers' attention and MLP modules do).
"""

from __future__ import annotations

import inspect

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autopar.errors import PlanError
from autopar.layout import ForwardLayout, forward_layout

# styles whose linear reads the residual stream: under SP its input must be gathered first
_REGION_ENTRIES = ("colwise", "colwise_rep", "rowwise_in")


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _within(fqn: str, regions) -> bool:
    return fqn in regions or _inside(fqn, regions)


def _inside(fqn: str, regions) -> bool:
    return any(fqn.startswith(r + ".") for r in regions)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.lower().endswith("norm")


class RegionInput(ParallelStyle):
    """Hand a module its first input, by position or by keyword (transformers calls attention as
    ``self_attn(hidden_states=...)``), as a DTensor replicated over the group, gathered along the
    sequence (dim 1) first when `sequence_sharded`. Kept a DTensor unless `local_output` (a head
    that runs replicated), so that the gradients of the linears reading it are summed before the
    one collective of its backward; other inputs pass through. PrepareModuleInput needs to know
    which of the two ways the input comes."""

    def __init__(self, sequence_sharded: bool, local_output: bool = False):
        super().__init__()
        self.sequence_sharded, self.local_output = sequence_sharded, local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters))
        layout = Shard(1) if self.sequence_sharded else Replicate()

        def enter(t):
            d = DTensor.from_local(t, device_mesh, (layout,), run_check=False)
            if self.sequence_sharded:
                d = d.redistribute(placements=(Replicate(),))
            return d.to_local() if self.local_output else d

        def hook(_, args, kwargs):
            if args:
                return (enter(args[0]), *args[1:]), kwargs
            if first in kwargs:
                return args, {**kwargs, first: enter(kwargs[first])}
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class StreamScatter(ParallelStyle):
    """Give a module (the first block) its first input, replicated over the group, as this rank's
    part of the sequence (dim 1): where the stream starts when no one module computes it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters))

        def scatter(t):
            return DTensor.from_local(t, device_mesh, (Replicate(),), run_check=False).redistribute(
                placements=(Shard(1),)).to_local()

        def hook(_, args, kwargs):
            if args:
                return (scatter(args[0]), *args[1:]), kwargs
            return args, {**kwargs, first: scatter(kwargs[first])} if first in kwargs else kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


def _linear_style(style: str, module: nn.Module, stream_in: bool, stream_out: bool) -> ParallelStyle:
    """The ParallelStyle of one named linear/embedding. `stream_in` / `stream_out`: under SP its
    input comes from / its output goes to the sequence-sharded stream."""
    entry = Shard(1) if stream_in else Replicate()
    out = Shard(1) if stream_out else Replicate()
    if style == "colwise":
        return ColwiseParallel(input_layouts=entry)
    if style == "colwise_rep":
        return ColwiseParallel(input_layouts=entry, output_layouts=out)
    if style == "rowwise":
        return RowwiseParallel(output_layouts=out)
    if style == "rowwise_in":
        return RowwiseParallel(input_layouts=entry, output_layouts=out)
    if style == "vocab" and isinstance(module, nn.Embedding):  # token ids in, rows sharded
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=out)
    if style == "vocab":  # the output head: logits gathered over the vocabulary for the loss
        return ColwiseParallel(input_layouts=entry, output_layouts=Replicate())
    if style == "head_norm":  # input [batch, seq, heads, head_dim] with this rank's heads
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    raise ValueError(f"unknown tensor-parallel style {style!r}")


def tp_styles(model: nn.Module, tp_plan: dict[str, str], blocks, sequence_parallel: bool,
              layout: ForwardLayout | None = None) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan for the modules of `model` that `tp_plan` names.

    `tp_plan` has wildcards already expanded (full FQNs); entries for modules this pipeline
    stage does not hold are dropped. A plan of torch ParallelStyle objects is applied as written:
    its layouts decide the collectives and what sequence parallelism shards. `blocks`: the blocks
    `model` runs; `layout`: the whole model's (default: `model`'s own, a whole model).
    """
    present = dict(model.named_modules())
    plan = {fqn: style for fqn, style in tp_plan.items() if fqn in present}
    if any(isinstance(style, ParallelStyle) for style in tp_plan.values()):
        if sequence_parallel != any(isinstance(style, SequenceParallel) for style in tp_plan.values()):
            raise PlanError(f"the plan has sequence_parallel={str(sequence_parallel).lower()} but the model's "
                            "tp_plan of ParallelStyles decides it (SequenceParallel entries); use sequence_parallel="
                            f"{str(not sequence_parallel).lower()}")
        return plan
    styles: dict[str, ParallelStyle] = {}
    block_names = {name for name, m in present.items() if blocks is not None and any(m is b for b in blocks)}
    replicated = set()  # whole modules off the sequence-sharded stream
    if sequence_parallel:
        layout = layout or forward_layout(model, blocks)
        if layout.sp_problem:
            raise PlanError(layout.sp_problem)
        start, head = layout.input, layout.head
        # before the first block everything runs whole (but an input module the plan shards itself)
        before = {m for m in layout.first if m in present and isinstance(present[m], nn.Module)}
        replicated = {m for m in before | {head} if m in present and not (m == start and m in plan)}
        if head in plan:
            replicated.discard(head)
    # the block parts that own a region's entry linears; without SP only where two or more share the
    # input (one linear reduces its own gradient as well as its owner would)
    entries = [_parent(fqn) for fqn, style in plan.items()
               if style in _REGION_ENTRIES and _parent(fqn) not in block_names | {""} and not _within(fqn, replicated)]
    owners = {name for name in entries if sequence_parallel or entries.count(name) > 1}
    styles.update({name: RegionInput(sequence_parallel) for name in owners})
    if sequence_parallel:
        if start in replicated:
            styles[start] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                use_local_output=True)
        elif start is None and layout.blocks and layout.blocks[0] in present:
            styles[layout.blocks[0]] = StreamScatter()
        if head in replicated:
            styles[head] = RegionInput(sequence_sharded=True, local_output=True)
        styles.update({name: SequenceParallel(use_local_output=True) for name, module in present.items()
                       if name and _is_norm(module) and name not in plan
                       and not _within(name, replicated) and not _inside(name, owners)})
    for fqn, style in plan.items():
        stream_out = sequence_parallel and not _within(fqn, replicated)
        stream_in = stream_out and not _inside(fqn, owners)
        styles[fqn] = _linear_style(style, present[fqn], stream_in, stream_out)
    return styles


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: dict[str, str], blocks, sequence_parallel: bool,
             layout: ForwardLayout | None = None) -> None:
    """Shard `model` (a whole model or one pipeline stage of it, `layout` the whole model's) over
    `tp_mesh` in place."""
    parallelize_module(model, tp_mesh, tp_styles(model, tp_plan, blocks, sequence_parallel, layout))
