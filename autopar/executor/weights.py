"""This rank's initial weights, with the whole model in host RAM on one rank only.

Rank 0 builds the whole model from the seed (the same weights as `parity.reference_losses`'s
single-process build). Every rank, rank 0 included, also builds a skeleton of it on the meta
device (shapes, no storage); `apply` lays the plan out on the skeleton (pipeline cut, tensor
parallelism, FSDP2 all work on meta), and `materialise` gives each rank storage for its own
shard only and copies rank 0's values into it: torch.distributed.checkpoint's
`set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)` broadcasts one
tensor at a time and each rank keeps its slice of it (DTensor parameters) or the whole of it.
Non-persistent buffers (causal masks, rotary tables) are in no state dict: rank 0 broadcasts
those itself. So a job holds the full model in host RAM once, and a model larger than one rank's
share never reaches a device whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from autopar.modelfile import materialize

SOURCE_RANK = 0  # the rank that builds the whole model (set_model_state_dict broadcasts from rank 0)
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.",)  # checkpoint_wrapper's child, absent from state dicts


def build_full_model(build_model: Callable[[], nn.Module], seed: int) -> nn.Module:
    """The whole model on the CPU with the weights `seed` gives: what rank 0 broadcasts and what
    the single-process reference trains."""
    torch.manual_seed(seed)
    model = build_model()
    if any(p.is_meta for p in model.parameters()):
        materialize(model, "cpu")
    return model


def build_skeleton(build_model: Callable[[], nn.Module]) -> nn.Module:
    """The model on the meta device: every parameter and buffer with its shape and no storage.
    A constructor that reads tensor values cannot run on meta; such a model is built whole
    (correct, only without the saving)."""
    try:
        with torch.device("meta"):
            return build_model()
    except (NotImplementedError, RuntimeError):
        return build_model()


def build_source(build_model: Callable[[], nn.Module], seed: int) -> nn.Module | None:
    """The whole model on the source rank, None on every other rank."""
    return build_full_model(build_model, seed) if dist.get_rank() == SOURCE_RANK else None


def unsaved_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: buffer} of the buffers no state dict holds (non-persistent ones), meta or not."""
    saved = set(model.state_dict())
    return {name: b for name, b in model.named_buffers(remove_duplicate=False) if name not in saved}


def unwrapped(name: str) -> str:
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def _fill(part: nn.Module, source: nn.Module | None, unsaved: dict[str, torch.Tensor],
          device: torch.device, skip: frozenset = frozenset()) -> None:
    """Copy the source rank's weights into `part`, an allocated part under the whole model's
    names. `unsaved`: the skeleton's non-persistent buffers; `skip`: entries filled otherwise
    (expert-parallel shards: `autopar.executor.expert_parallel.fill_experts`)."""
    full = {k: v for k, v in source.state_dict().items() if k not in skip} if source is not None else {}
    # strict=False: a pipeline stage holds only some of the whole model's entries
    set_model_state_dict(part, dict(full), options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                     strict=False))
    local = {unwrapped(name): b for name, b in part.named_buffers(remove_duplicate=False)}
    with torch.no_grad():
        for name, like in unsaved.items():  # the same names, in the same order, on every rank
            value = (source.get_buffer(name).to(device) if source is not None
                     else torch.empty(like.shape, dtype=like.dtype, device=device))
            dist.broadcast(value, SOURCE_RANK)
            if name in local:
                local[name].copy_(value)


def materialise(parts: list[nn.Module], source: nn.Module | None, unsaved: dict[str, torch.Tensor],
                device: torch.device, offload: bool, skip: frozenset = frozenset()) -> None:
    """Give this rank's skeleton parts (laid out already: only shards get storage) their storage
    and rank 0's weights. A collective: every rank calls it at the same point of `apply`, and
    every rank holds as many parts (one per virtual pipeline stage).

    Each part is filled on its own (under the whole model's names): parts of an interleaved
    pipeline each hold their own copy of buffer-only modules (rotary tables), which a merged
    view would show once. With FSDP2's CPU offload the sharded parameters live on the host,
    buffers on the device (moved after the weights arrive: DCP loads a state dict on one device)."""
    for part in parts:
        part.to_empty(device="cpu" if offload else device)
        _fill(part, source, unsaved, device, skip)
    if offload:
        for module in (m for part in parts for m in part.modules()):
            for name, buf in module._buffers.items():
                if buf is not None:
                    module._buffers[name] = buf.to(device)
