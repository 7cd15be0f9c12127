"""Tensor (and sequence) parallelism from a model's declarative `tp_plan`.

A tp_plan of torch ParallelStyle objects (torchtitan's form) is applied as written. A plan of
style names (see `autopar.modelfile.TP_STYLES`) names linears and embeddings; this module turns
those into PyTorch's ParallelStyles, as torchtitan's `apply_tp` does by hand:

* colwise / rowwise pairs form Megatron-LM regions: an all-reduce (no SP) or a reduce-scatter
  (SP) where the region ends;
* "vocab" on an embedding shards its rows; on an output linear it shards the logits and
  gathers them for the loss.

With sequence parallelism the residual stream between the input module (`tok_embeddings`) and
the head (`output`) is sharded along the sequence (dim 1). Norms on the stream run on their
shard (`SequenceParallel`, which also reduces their gradients); a block's submodule that owns a
region's first linears gathers the sequence once at its input (`GatherSequence`); an input
module that is more than one vocab embedding (tokens + positions, patches) runs replicated and
its output is scattered (`PrepareModuleOutput`); a head that is more than one vocab linear
gathers its input and runs replicated. Other parameters must not touch the sharded stream.
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

INPUT, HEAD = "tok_embeddings", "output"  # torchtitan's names of the stream's two ends
# styles whose linear reads the residual stream: under SP its input must be gathered first
_REGION_ENTRIES = ("colwise", "colwise_rep", "rowwise_in")


def _parent(fqn: str) -> str:
    return fqn.rpartition(".")[0]


def _inside(fqn: str, regions) -> bool:
    return any(fqn.startswith(r + ".") for r in regions)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.lower().endswith("norm")


class GatherSequence(ParallelStyle):
    """All-gather a module's first input along the sequence (dim 1), whether it is passed by
    position or by keyword (transformers calls attention as ``self_attn(hidden_states=...)``);
    other inputs pass through. PrepareModuleInput needs to know which of the two it will be."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters))

        def gather(t):
            return DTensor.from_local(t, device_mesh, (Shard(1),), run_check=False).redistribute(
                placements=(Replicate(),)).to_local()

        def hook(_, args, kwargs):
            if args:
                return (gather(args[0]), *args[1:]), kwargs
            if first in kwargs:
                return args, {**kwargs, first: gather(kwargs[first])}
            return args, kwargs

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


def tp_styles(model: nn.Module, tp_plan: dict[str, str], blocks: nn.ModuleList | None,
              sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The `parallelize_module` plan for the modules of `model` that `tp_plan` names.

    `tp_plan` has wildcards already expanded (full FQNs); entries for modules this pipeline
    stage does not hold are dropped. A plan of torch ParallelStyle objects is applied as written:
    its layouts decide the collectives and what sequence parallelism shards.
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
    replicated, gatherers = set(), set()  # whole modules off the stream / block parts that gather
    if sequence_parallel:
        if not hasattr(model, INPUT):
            raise PlanError(f"sequence parallelism needs the model's input module named '{INPUT}' (torchtitan "
                            f"layout) to know where the sequence is split; use a plan without it")
        block_names = {name for name, m in present.items() if blocks is not None and any(m is b for b in blocks)}
        for end in (INPUT, HEAD):
            if end in present and end not in plan:
                replicated.add(end)
        gatherers = {_parent(fqn) for fqn, style in plan.items()
                     if style in _REGION_ENTRIES and _parent(fqn) not in block_names | {""}
                     and not _inside(fqn, replicated)}
        if INPUT in replicated:
            styles[INPUT] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                                use_local_output=True)
        if HEAD in replicated:
            styles[HEAD] = GatherSequence()
        styles.update({name: GatherSequence() for name in gatherers})
        styles.update({name: SequenceParallel(use_local_output=True) for name, module in present.items()
                       if name and _is_norm(module) and name not in plan
                       and not _inside(name, replicated | gatherers)})
    for fqn, style in plan.items():
        stream_out = sequence_parallel and not _inside(fqn, replicated)
        stream_in = stream_out and not _inside(fqn, gatherers)
        styles[fqn] = _linear_style(style, present[fqn], stream_in, stream_out)
    return styles


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, tp_plan: dict[str, str], blocks: nn.ModuleList | None,
             sequence_parallel: bool) -> None:
    """Shard `model` (a whole model or one pipeline stage of it) over `tp_mesh` in place."""
    parallelize_module(model, tp_mesh, tp_styles(model, tp_plan, blocks, sequence_parallel))
