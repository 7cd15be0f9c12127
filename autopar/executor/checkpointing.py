"""Activation checkpointing (recompute) of pipeline blocks, as the plan asks.

* full: the first `recompute_blocks` blocks this pipeline rank holds keep only their input and
  rerun their forward in backward (Megatron-LM's full recompute, per-block segments); per stage
  (`stage_recompute`), each virtual stage's own setting: "full:K" its first K blocks (Megatron's
  "block" method), "selective" or "none", so a rank's chunks may differ;
* selective: Korthikanti et al.'s selective recompute, written as a PyTorch selective-checkpoint
  policy: the attention core (the scores matmul, scale, mask, softmax, dropout and the matmul
  with the values) is recomputed, every other op's output is kept. The core is found by dataflow
  as the profiler finds it (`autopar.profile.recorder`): a batched matmul into a square
  (seq x seq) result starts it, and every op reading such a tensor belongs to it. So what the
  executor drops and redoes is what the cost model counts (`attn_core_bytes`, `attn_core_flops`).
  Fused attention (scaled_dot_product_attention) keeps no seq x seq tensor: nothing to drop.
  Dropout is recomputed whole on every device, so selective recompute keeps the same tensors on
  a GPU as in the CPU tests: CUDA runs it as one `native_dropout` op (output and bool mask), the
  CPU as a noise fill (`empty_like`, `bernoulli_`, `div_`) and a multiply by that noise.

Blocks are wrapped in place with `checkpoint_wrapper` (whose state-dict hooks keep parameter
names unchanged, so checkpoints still map across plans).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autopar.knobs import stage_full_blocks
from autopar.plan import Plan

_aten = torch.ops.aten
_BATCHED_MATMULS = {_aten.bmm.default: (0, 1), _aten.baddbmm.default: (1, 2)}  # op: positions of the factors
_LAYOUT = {_aten.clone.default, _aten._unsafe_view.default, _aten.contiguous.default}
# buffers that in-place ops fill or update later: dropout's noise on the CPU (empty_like, bernoulli_)
# and the row means of rms_norm's CPU decomposition (mean, then add_ of eps)
_FRESH = {_aten.empty_like.default, _aten.empty.memory_format, _aten.mean.dim}
_DROPOUT = {_aten.native_dropout.default}
_NOISE_FILLS = {_aten.bernoulli_.float, _aten.bernoulli_.Tensor, _aten.div_.Scalar}


def _square(t) -> bool:
    """A batched tensor with a square trailing matrix: attention scores or probabilities."""
    return isinstance(t, torch.Tensor) and t.dim() >= 3 and t.shape[-1] == t.shape[-2]


def _attention_core(op, args, kwargs) -> bool:
    if op in _BATCHED_MATMULS:
        a, b = (args[i] for i in _BATCHED_MATMULS[op])
        if a.shape[-2] == b.shape[-1]:  # produces a square result: the scores
            return True
    # layout ops only move data (and copy the matmuls' operands): with a head size equal to the
    # sequence length queries, keys and values are square too, and the profiler keeps them
    if op.is_view or op in _LAYOUT:
        return False
    return any(_square(t) for t in tree_leaves((args, kwargs)))


class SelectivePolicy:
    """The selective-checkpoint policy of one checkpointed call (forward and recompute): it
    remembers where the dropout noise it has seen filled lies, by address (the dispatcher hands
    out a new Python object per op), until the multiply that applies it uses it up."""

    def __init__(self):
        self.noise: set[tuple] = set()

    def __call__(self, ctx, op, *args, **kwargs):
        # a kept tensor must not change afterwards, so in-place ops and the buffers they fill
        # (dropout's noise on the CPU: empty_like, bernoulli_, div_) are always recomputed, and so
        # is the multiply by that noise: dropout keeps nothing, on the CPU as on CUDA (module doc)
        if op in _NOISE_FILLS:
            self.noise.add(_where(args[0]))
        if (op._schema.is_mutable or op in _FRESH or op in _DROPOUT or _attention_core(op, args, kwargs)
                or (op is _aten.mul.Tensor and _takes_noise(self.noise, args))):
            return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE


def _where(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape)


def _takes_noise(noise: set, args) -> bool:
    """Whether this multiply applies a dropout noise (then used up: its memory may be reused)."""
    for a in args:
        if isinstance(a, torch.Tensor) and _where(a) in noise:
            noise.discard(_where(a))
            return True
    return False


def _selective_context():
    return create_selective_checkpoint_contexts(SelectivePolicy())


def recomputed(held: list[list[tuple[nn.Module, str]]], stages: list[int], plan: Plan) -> list[tuple[tuple, bool]]:
    """((parent, child name), selective?) of each block to wrap. `held`: the real blocks of each
    stage this rank runs (`stages`, in execution order). Per stage from `stage_recompute` ("full:K":
    that stage's first K blocks; a stage of no block wraps none); else uniform: every block
    (selective) or the first `recompute_blocks` this rank holds across its chunks (full)."""
    if plan.stage_recompute:
        out = []
        for blocks, stage in zip(held, stages):
            entry = plan.stage_recompute[stage]
            out += ([(b, True) for b in blocks] if entry == "selective"
                    else [(b, False) for b in blocks[:stage_full_blocks(entry)]])
        return out
    every = [b for blocks in held for b in blocks]
    if plan.recompute == "selective":
        return [(b, True) for b in every]
    return [(b, False) for b in every[:plan.recompute_blocks]] if plan.recompute == "full" else []


def apply_ac(held: list[list[tuple[nn.Module, str]]], stages: list[int], plan: Plan) -> int:
    """Wrap the blocks `recomputed` chooses, in place. Returns how many blocks were wrapped."""
    chosen = recomputed(held, stages, plan)
    for (container, index), selective in chosen:
        kwargs = {"context_fn": _selective_context} if selective else {}
        setattr(container, str(index), checkpoint_wrapper(getattr(container, str(index)), **kwargs))  # non-reentrant
    return len(chosen)
