"""Whether the output layer's GEMMs are aligned for cuBLAS's tensor-core kernels, as a note.

cuBLAS's fastest tensor-core kernels want each matrix's leading dimension to be a multiple of 16
bytes, 8 elements in 16 bits (NVIDIA's Matrix Multiplication Background guide, "Tensor Core
Requirements"; docs/hardware.md "GEMM shapes"). Since cuBLAS 11 a GEMM off that grid still runs
on tensor cores, but on slower kernels. A transformer's hidden and MLP sizes are multiples of 8 by
design; its vocabulary often is not (GPT-2's 50,257), and tensor parallelism splits it further.
The logits GEMM writes, and its backward reads, a matrix whose leading dimension is the rank's
slice of the vocabulary. No public figure gives those kernels' rate, so the cost model prices the
head as if aligned (vTrain's A100 runs suggest a head 2-3x its aligned price, docs/hardware.md
"vTrain"), and this note says so instead. Padding the vocabulary is the usual fix: Megatron-LM
pads to a multiple of 128 x tp (`--make-vocab-size-divisible-by`), nanoGPT pads GPT-2's to 50,304.
"""

from __future__ import annotations

import math

from autopar.axes import padded_vocab

ALIGN_BYTES = 16
HEAD_BYTES = {"fp32": 4}  # the head's GEMM input bytes by plan precision; 2 otherwise (fp8 keeps the head in bf16)


def vocab_per_rank(profile, tp: int) -> int | None:
    """Output columns of the head on one tensor-parallel rank (the largest slice), or None when the
    profile names no vocabulary."""
    vocab = (profile.dims or {}).get("vocab")
    if not vocab:
        return None
    sharded = tp > 1 and profile.head.tp_params > 0
    return math.ceil(vocab / tp) if sharded else int(vocab)


def alignment_note(workload, plan) -> str:
    """One line when the head's per-rank vocabulary is not a multiple of 16 bytes on a GPU whose
    GEMMs run in cuBLAS's tensor-core tiles; "" otherwise."""
    if not workload.cluster.gpu.sms:  # not a GPU priced by its tensor-core tiles (the CPU preset)
        return ""
    columns = vocab_per_rank(workload.profile, plan.tp)
    elements = ALIGN_BYTES // HEAD_BYTES.get(plan.precision, 2)
    if columns is None or columns % elements == 0:
        return ""
    vocab = workload.profile.dims["vocab"]
    tp = plan.tp if workload.profile.head.tp_params > 0 else 1
    padded = padded_vocab(vocab, tp, elements)
    per_rank = f" ({elements} per rank x tp {tp})" if tp > 1 else ""
    return (f"note: the output layer's vocabulary per tensor-parallel rank ({columns:,}) is not a multiple of "
            f"{elements}: cuBLAS runs its GEMMs on slower tensor-core kernels, which the estimate does not "
            f"price; pad the vocabulary to {padded:,}{per_rank}")
