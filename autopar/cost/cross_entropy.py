"""Megatron's vocab-parallel cross-entropy, priced from the logit count instead of the file's loss.

Megatron-LM (and Megatron-DeepSpeed, whose runs vTrain measured) computes the loss as
`vocab_parallel_cross_entropy(output.float(), labels)` (megatron/model/gpt_model.py;
megatron/core/tensor_parallel/cross_entropy.py, `_VocabParallelCrossEntropy`): unfused eager ops
on fp32 logits, each a pass over the logits in HBM. Per logit element on a rank:
forward: `float()` reads 2 and writes 4 bytes, the max reads 4, subtracting it reads 4 and writes
4, `exp` reads 4 and writes 4, the sum reads 4, the in-place division that leaves the softmax for
backward reads 4 and writes 4 (38); backward: the in-place multiply by the loss gradient reads 4
and writes 4, and `float()`'s backward casts to 16-bit, reading 4 and writing 2 (14). These are
HBM bytes, priced at the GPU's streaming rate (not scaled by the fitted `elementwise_traffic`,
which is relative to the file's profiled ops). The head's profiled elementwise traffic (the
file's own loss and its final norm) is replaced; the final norm's bytes are under 1% of the
loss's at vTrain's shapes (hidden 1,024-12,288, vocabulary 51,200). Without the switch the head
costs what the file's loss does (`F.cross_entropy` is one fused log-softmax kernel), as autopar's
executor runs it.

Memory follows the loss that runs. The file's loss keeps what the profile saw it save
(`loss_saved_bytes`: `F.cross_entropy` keeps its log-softmax of the gathered logits), whole on every
rank under sequence parallelism too, since the head gathers the sequence before it. Where the logits
stay sharded over the vocabulary (runtime megatron, or the switch), Megatron's loss keeps its fp32
softmax of the rank's vocabulary share, the target mask and the masked target index
(`ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)`: 4 bytes per logit and 9 per
token; the fused Megatron-Core loss saves the same) instead.
"""

from __future__ import annotations

import numpy as np

from autopar.runtime import is_megatron

CROSS_ENTROPY_BYTES = (38.0, 14.0)  # HBM bytes per logit element: forward, backward
# Kernels the loss launches in forward (host time, cost/launches.py): `float()`; in
# `_VocabParallelCrossEntropy.forward` the max, its all-reduce, the subtraction, the target mask (<,
# >=, |), clone, shift and masked fill of the target, arange, the gather and its clone, its masked
# fill and all-reduce, exp, sum and its all-reduce, log, the subtraction and the in-place division
# (20); the loss mask's weighted mean (multiply, two sums, divide: Megatron-DeepSpeed's `CrossEntropy`)
LOSS_LAUNCHES = 25.0
SOFTMAX_SAVED_BYTES = 4.0  # per logit on a rank: the fp32 softmax Megatron's loss keeps for backward
TARGET_SAVED_BYTES = 9.0  # per token: the target mask (bool) and the masked target index (int64)


def vocab_parallel(workload) -> bool:
    """Whether the loss runs on logits sharded over the vocabulary (Megatron's, under runtime megatron
    or the switch), so that a vocab-sharded head never gathers them (cost/tensor_parallel.py)."""
    return is_megatron(workload.runtime) or "megatron_cross_entropy" in workload.switches


def applies(workload) -> bool:
    return "megatron_cross_entropy" in workload.switches and "vocab" in (workload.profile.dims or {})


def loss_as_run(k: dict[str, np.ndarray], workload) -> dict[str, np.ndarray]:
    """The per-kind figures with the head's profiled elementwise traffic (the file's loss) taken out
    under the switch, `head_times` pricing Megatron's instead; as profiled otherwise."""
    if not applies(workload):
        return k
    io = k["io_bytes"].copy()
    io[-1] = 0.0  # the head is the last kind
    return {**k, "io_bytes": io}


def head_times(workload, b: np.ndarray, tp: np.ndarray, hbm_bytes_per_s: float, kinds: int):
    """Forward and backward seconds of the loss per micro-batch and block kind, shape (G, K): on the
    head only (the last kind), b samples' logits sharded over the vocabulary by tp."""
    profile = workload.profile
    logits = b * profile.seq_len * profile.dims["vocab"] / tp / hbm_bytes_per_s  # (G, 1)
    head = np.zeros(kinds)
    head[-1] = 1.0
    return CROSS_ENTROPY_BYTES[0] * logits * head, CROSS_ENTROPY_BYTES[1] * logits * head


def saved_as_run(k: dict[str, np.ndarray], workload, b: np.ndarray, act_scale: np.ndarray,
                 split: np.ndarray) -> np.ndarray:
    """Bytes the loss keeps for backward per micro-batch and block kind (G, K), the head's only: the
    file's loss's (its sharded part over `split`; the rest whole on every rank, sequence
    parallelism or not, for the loss reads the gathered logits), or Megatron's where the logits
    stay sharded over the vocabulary."""
    out = np.zeros((len(b), len(k["saved_bytes"])))
    dims = workload.profile.dims or {}
    if vocab_parallel(workload) and "vocab" in dims:
        out[:, -1] = b[:, 0] * workload.profile.seq_len * (SOFTMAX_SAVED_BYTES * dims["vocab"] / split[:, -1]
                                                           + TARGET_SAVED_BYTES)
    else:
        loss, loss_tp = k["loss_saved_bytes"][-1], k["loss_saved_tp_bytes"][-1]
        out[:, -1] = b[:, 0] * act_scale[:, 0] * (loss_tp / split[:, -1] + loss - loss_tp)
    return out
