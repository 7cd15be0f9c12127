"""Per-segment accounting of one forward + backward pass on the meta device.

A *segment* is the part of the model that is running: ``"embed"``, a block index, or ``"head"``;
the profiler's module hooks move :attr:`Recorder.segment` along as the pass proceeds. The
recorder is a TorchDispatchMode that sees every aten op (forward and backward) and a
saved-tensors hook that sees every tensor autograd keeps for backward.

Counting rules:
- FLOPs use FlopCounterMode's formulas (``torch.utils.flop_counter.flop_registry``).
- Memory traffic (io) sums input and output bytes of forward ops without FLOPs, views excluded.
- Saved bytes count each storage once per segment, at the storage's full size (what is actually
  held, even if only a view was saved); parameters and buffers are excluded by storage identity.
- Tensor-parallel sharding is tracked by dataflow on storages: sharded parameters start tagged,
  any op with a tagged input tags its outputs, and the profiler untags the outputs of modules whose
  parallel style ends in a collective (row-wise all-reduce, all-gather).
- The attention core (what selective recompute drops) is tracked the same way: a matmul of two
  activations (no parameter) with a seq x seq result starts it (q·kᵀ), other ops with a core input
  continue it (mask, softmax, dropout), and matmuls with a core input end it (probs·v). Looking at
  shapes alone would mistake (seq, hidden) activations for scores whenever hidden == seq.
- Attention scores (`attn_scores`, elements) are counted the same way: the first core tensor, or
  the (heads x s_q x s_k) a fused kernel computes without storing.
- Attention FLOPs (`attn_flops`) are the score and value products whatever computes them: the
  core's matmuls, or a fused attention kernel (flash). A fused kernel's backward recomputes the
  scores; that matmul is hardware work, not model FLOPs, so backward counts the other four (as an
  unfused attention's backward does), and the cost model prices the recompute as time.
- Launches (`launches`) count the forward ops that run a kernel: not views, nor the reshapes and
  allocations aten runs without one (`NO_KERNEL`). The host issues each one, so a block's host time follows
  its count (cost/launches.py); `loss_launches` are those of the model file's loss_fn.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry


def storage_key(t: torch.Tensor) -> int:
    """Identity of the memory behind ``t`` (shared by all views of it)."""
    return t.untyped_storage()._cdata


_aten = torch.ops.aten
FUSED_ATTENTION = {_aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
                   _aten._scaled_dot_product_cudnn_attention, _aten._flash_attention_forward,
                   _aten._efficient_attention_forward}
FUSED_ATTENTION_BACKWARD = {_aten._scaled_dot_product_flash_attention_backward,
                            _aten._scaled_dot_product_efficient_attention_backward,
                            _aten._scaled_dot_product_cudnn_attention_backward,
                            _aten._flash_attention_backward, _aten._efficient_attention_backward}
# ops that `is_view` does not flag but that only reshape metadata or allocate: no kernel, no launch
NO_KERNEL = {_aten._unsafe_view, _aten.detach, _aten.lift_fresh, _aten.empty, _aten.empty_like, _aten.empty_strided}


def _score_recompute_flops(args) -> float:
    """FLOPs of q·kᵀ that a fused attention backward (grad_out, query, key, ...) recomputes."""
    query, key = args[1], args[2]
    return 2.0 * query.numel() * key.shape[-2]


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Saved(NamedTuple):
    nbytes: int
    sharded: bool  # by tensor parallelism
    core: bool  # part of the attention core (seq x seq)
    loss: bool  # saved by the model file's loss_fn (the head's; the cost model swaps in Megatron's)
    entry: bool = False  # the input of a column-wise linear (whole on every rank under torch's SP)
    mask: bool = False  # a dropout's mask (native_dropout's second output) outside the attention core


@dataclass
class Tally:
    """What one segment did, per sample."""

    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    tp_fwd_flops: float = 0.0
    attn_core_flops: float = 0.0
    attn_flops: float = 0.0
    attn_scores: float = 0.0
    io_bytes: float = 0.0
    attn_core_io_bytes: float = 0.0
    out_bytes: float = 0.0
    tp_comm_bytes: float = 0.0
    tp_gather_bytes: float = 0.0
    launches: float = 0.0  # forward operators that run a kernel (the host launches each one)
    loss_launches: float = 0.0  # of which the model file's loss_fn's
    saved: dict[int, Saved] = field(default_factory=dict)  # by storage key

    def saved_bytes(self, *flags: str) -> float:
        """Bytes of the saved storages, or of those with every one of ``flags`` ("sharded", "core",
        "loss", "entry", "mask") set."""
        return float(sum(v.nbytes for v in self.saved.values() if all(getattr(v, f) for f in flags)))


class Recorder(TorchDispatchMode):
    """Tallies FLOPs, memory traffic, saved tensors and TP sharding for the current segment."""

    def __init__(self, seq_len: int, excluded: set[int]):
        super().__init__()
        self.seq_len = seq_len
        self.excluded = excluded  # storage keys of parameters and buffers
        self.segment = "embed"
        self.backward = False
        self.in_loss = False  # the model file's loss_fn is running
        self.tallies: dict = defaultdict(Tally)
        # storage key -> tensor; holding the tensors keeps the keys from being reused
        self._sharded: dict[int, torch.Tensor] = {}
        self._core: dict[int, torch.Tensor] = {}
        self._entry: dict[int, torch.Tensor] = {}
        self._dropout_masks: dict[int, torch.Tensor] = {}  # native_dropout's masks (profile/kernels.py)
        self._keep: list[torch.Tensor] = []  # saved tensors, held for the same reason

    @property
    def tally(self) -> Tally:
        return self.tallies[self.segment]

    # -- dataflow tags -----------------------------------------------------------------------------
    def tag(self, t: torch.Tensor):
        """Mark ``t`` as sharded by tensor parallelism."""
        self._sharded[storage_key(t)] = t

    def untag(self, t: torch.Tensor):
        self._sharded.pop(storage_key(t), None)

    def is_sharded(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self._sharded

    def mark_entry(self, t: torch.Tensor):
        """Mark ``t`` as the input of a column-wise linear (a region's entry), also where an op
        before the linear already saved it."""
        key = storage_key(t)
        self._entry[key] = t
        if key in self.tally.saved:
            self.tally.saved[key] = self.tally.saved[key]._replace(entry=True)

    def is_core(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self._core

    def _is_scores(self, inputs, outputs) -> bool:
        """A matmul of two activations into a seq x seq result: attention scores."""
        s = self.seq_len
        return (s > 1 and not any(storage_key(t) in self.excluded for t in inputs)
                and any(t.dim() >= 2 and tuple(t.shape[-2:]) == (s, s) for t in outputs))

    # -- hooks -----------------------------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks pack hook: record the storage (once per segment), keep the tensor."""
        key = storage_key(t)
        if key not in self.excluded and key not in self.tally.saved:
            core = self.is_core(t)
            self.tally.saved[key] = Saved(t.untyped_storage().nbytes(), self.is_sharded(t), core, self.in_loss,
                                          key in self._entry, key in self._dropout_masks and not core)
            self._keep.append(t)
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        if packet not in flop_registry:
            with self:  # as FlopCounterMode: count the ops a composite op decomposes into
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        flops = flop_registry[packet](*args, **kwargs, out_val=out) if packet in flop_registry else 0
        tally = self.tally
        if self.backward:
            if packet in FUSED_ATTENTION_BACKWARD:
                flops -= _score_recompute_flops(args)
            tally.bwd_flops += flops
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        tally.fwd_flops += flops
        if not func.is_view and packet not in NO_KERNEL:
            tally.launches += 1
            tally.loss_launches += self.in_loss
        if any(self.is_sharded(t) for t in inputs):
            tally.tp_fwd_flops += flops
            for t in outputs:
                self.tag(t)
        if packet is torch.ops.aten.native_dropout:  # (output, mask): a bool mask of what it kept
            self._dropout_masks[storage_key(out[1])] = out[1]
        core_in = any(self.is_core(t) for t in inputs)
        # the matmul with the values reads the core and ends it, even when its result is square too
        # (a head size equal to the sequence length)
        # a fused kernel's output is (.., s, head_dim), never scores, even where head_dim equals s
        starts_core = (bool(flops) and not core_in and packet not in FUSED_ATTENTION
                       and self._is_scores(inputs, outputs))
        if core_in or starts_core:
            tally.attn_core_flops += flops
        if core_in or starts_core or packet in FUSED_ATTENTION:
            tally.attn_flops += flops
        if starts_core:
            tally.attn_scores += sum(t.numel() for t in outputs)
        elif packet in FUSED_ATTENTION:  # (batch, heads, s_q) x s_k scores, never materialised
            tally.attn_scores += args[0].shape[:-1].numel() * args[1].shape[-2]
        if starts_core or (core_in and not flops):
            self._core.update((storage_key(t), t) for t in outputs)
        if not flops and not func.is_view:
            if packet is torch.ops.aten.embedding:  # reads the looked-up rows, not the whole table
                inputs = [*inputs[1:], *outputs]
            io = sum(tensor_bytes(t) for t in inputs + outputs)
            tally.io_bytes += io
            if core_in:
                tally.attn_core_io_bytes += io
        return out
