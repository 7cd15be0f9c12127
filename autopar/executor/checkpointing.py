"""Activation checkpointing (recompute) of pipeline blocks, as the plan asks.

* full: the first `recompute_blocks` blocks this pipeline rank holds keep only their input and
  rerun their forward in backward (Megatron-LM's full recompute, per-block segments);
* selective: every block keeps the outputs of its linear layers and collectives and recomputes
  the rest, the attention core (scores, softmax, dropout) foremost: Korthikanti et al.'s
  selective recompute, written as a PyTorch selective-checkpoint policy.

Blocks are wrapped in place with `checkpoint_wrapper` (whose state-dict hooks keep parameter
names unchanged, so checkpoints still map across plans).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autopar.plan import Plan

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
# ops whose outputs selective recompute keeps: GEMMs of the linear layers (costly to redo) and
# tensor-parallel collectives (recomputing them would repeat communication)
_SAVED_OPS = {_aten.mm.default, _aten.addmm.default, _c10d.all_reduce.default,
              _c10d.reduce_scatter_tensor.default, _c10d.all_gather_into_tensor.default}


def _selective_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_ac(blocks_held: list[tuple[nn.ModuleList, int]], plan: Plan) -> int:
    """Wrap blocks for recompute. `blocks_held` lists (ModuleList, index) of the real blocks this
    rank holds, in execution order. Returns how many blocks were wrapped."""
    if plan.recompute == "none":
        return 0
    chosen = blocks_held if plan.recompute == "selective" else blocks_held[:plan.recompute_blocks]
    kwargs = {"context_fn": _selective_context} if plan.recompute == "selective" else {}
    for container, index in chosen:
        container[index] = checkpoint_wrapper(container[index], **kwargs)  # non-reentrant
    return len(chosen)
