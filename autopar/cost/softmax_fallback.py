"""Megatron's scale-mask-softmax when its fused kernel cannot run.

Megatron's unfused attention (Megatron-LM, Megatron-Core and Megatron-DeepSpeed alike) calls
`FusedScaleMaskSoftmax`, whose CUDA kernel needs the attention batches on a rank (micro-batch x
heads per tensor-parallel rank) to be a multiple of 4 (`is_kernel_available`: `attn_batches % 4 == 0`;
microsoft/Megatron-DeepSpeed megatron/model/fused_softmax.py at 0782d753: `attn_batch_size % 4 == 0`).
Otherwise it runs `forward_torch_softmax`: with Megatron's default query-key layer scaling the
scores go to fp32 (`float()`), are scaled, masked in place (`masked_fill_`), soft-maxed and cast
back (`half()`): five operations where the kernel is one, each a pass over the scores in HBM and
each a host launch (and an autograd node in backward). vTrain's Megatron-DeepSpeed runs at
tensor parallelism 8 and micro-batch 1 (2 heads per rank) take about 0.9 ms more per layer and
micro-batch than at micro-batch 2, at both hidden sizes (docs/hardware.md, "vTrain").

Not modelled: the kernel's key-length limit (2,048 to 8,192 by version) and its block-size
condition below 128 keys; the fp32 probabilities it keeps for backward (memory).
"""

from __future__ import annotations

import numpy as np

from autopar.runtime import megatron_attention

# Extra HBM bytes per score element over the fused kernel (which reads and writes the 16-bit scores
# once: 4 bytes forward; backward reads the gradient and the saved probabilities and writes one: 6).
# Forward: float() 2 + 4, * scale 4 + 4, masked_fill_ 4 + 4, Softmax 4 + 4, half() 4 + 2 = 36.
# Backward (autograd): half 2 + 4, softmax 4 + 4 + 4, masked_fill 4 + 4, mul 4 + 4, float 4 + 2 = 40.
FALLBACK_IO_BYTES = (36.0 - 4.0, 40.0 - 6.0)
# Host launches: the fallback issues 4 operations more than the fused call, per pass, on top of the
# FUSED_LAYER_OPS a Megatron layer's forward issues with the kernel (counted in docs/hardware.md)
FALLBACK_EXTRA_OPS = 4
FUSED_LAYER_OPS = 18


def fallback(workload, micro_batch: np.ndarray, tp: np.ndarray, sixteen_bit: np.ndarray) -> np.ndarray:
    """1.0 per plan whose attention batches per rank are not a multiple of 4 (the torch softmax
    runs), else 0.0; shape (G, 1). The kernel takes only 16-bit scores, so an fp32 plan never had it
    to lose. All zeros when the model names no head count."""
    heads = (workload.profile.dims or {}).get("heads")
    b = np.asarray(micro_batch, dtype=float)
    if not heads or not megatron_attention(workload) or "flash_attn" in workload.switches:
        return np.zeros((len(b), 1))
    batches = np.rint(b * heads / np.asarray(tp, dtype=float))
    return ((batches % 4 != 0) & np.asarray(sixteen_bit, dtype=bool)).astype(float)[:, None]
