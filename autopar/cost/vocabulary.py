"""The output layer's vocabulary: what a runtime's padding of it costs, and, as one note, what the
estimate does not show.

Megatron-LM pads the vocabulary itself, to a multiple of 128 x tp (`--make-vocab-size-divisible-by`):
its padded rows and columns are priced like the others (`tp_split`), tp need not divide the file's
vocabulary there, and the note has nothing to say. Under other runtimes it says two things, both
fixed by padding the vocabulary (nanoGPT pads GPT-2's 50,257 to 50,304):

- tensor parallelism shards the vocabulary, so tp must divide it (`autopar/axes.py`); a
  vocabulary such as 50,257 (29 x 1,733) leaves only tp 1, and the search cannot say why a plan
  has no tensor parallelism unless the note does;
- cuBLAS's fastest tensor-core kernels want each matrix's leading dimension a multiple of 16
  bytes, 8 elements in 16 bits (NVIDIA's Matrix Multiplication Background guide, "Tensor Core
  Requirements"; docs/hardware.md "GEMM shapes"). Since cuBLAS 11 a GEMM off that grid still runs
  on tensor cores, on slower kernels. Hidden and MLP sizes are multiples of 8 by design; the
  logits GEMM writes, and its backward reads, a matrix whose leading dimension is the rank's slice
  of the vocabulary. No public figure gives those kernels' rate, so the cost model prices the
  head as if aligned (vTrain's A100 runs suggest a head 2-3x its aligned price, docs/hardware.md
  "vTrain") and the note says so instead.
"""

from __future__ import annotations

import math

import numpy as np

from autopar.axes import divisors, padded_vocab, tp_units
from autopar.runtime import vocab_padding

ALIGN_BYTES = 16
HEAD_BYTES = {"fp32": 4}  # the head's GEMM input bytes by plan precision; 2 otherwise (fp8 keeps the head in bf16)


def tp_split(workload, tp, kinds: int) -> np.ndarray:
    """Over how many ranks each block kind's tensor-parallel-sharded part is spread, shape (G, K): tp,
    and at the ends (embedding rows, head columns) under a runtime that pads the vocabulary itself
    tp x the file's vocabulary over the padded one: Megatron's padded rows and columns are weights,
    GEMM work and logits like the others, though model FLOPs count the file's vocabulary."""
    t = np.asarray(tp, dtype=float)
    split = np.repeat(t[:, None], kinds, axis=1)
    vocab, multiple = (workload.profile.dims or {}).get("vocab"), vocab_padding(workload)
    if vocab and multiple:
        split[:, [0, -1]] = (vocab * t / padded_vocab(vocab, t, multiple))[:, None]
    return split


def tp_limit(workload) -> tuple[int, int]:
    """(largest tp the vocabulary allows, largest the model's other sharded dims allow), both within
    one node (where tensor parallelism runs) and dividing the world; equal when the vocabulary is
    not what limits it."""
    profile, cluster = workload.profile, workload.cluster
    vocab = (profile.dims or {}).get("vocab")
    if not profile.has_tp_plan or vocab not in profile.tp_units:
        return 1, 1
    common = math.gcd(*tp_units(workload, vocab=False))  # 0 when nothing else is sharded: every t divides it
    fits = [t for t in divisors(workload.world_size) if t <= cluster.gpus_per_node and common % t == 0]
    return max(t for t in fits if vocab % t == 0), max(fits)


def vocabulary_note(workload, plan) -> str:
    """One line when the vocabulary keeps tp below what the rest of the model allows, or when a
    rank's slice of it is off the 16-byte grid on a GPU whose GEMMs run in cuBLAS's tensor-core
    tiles; "" otherwise."""
    profile = workload.profile
    vocab = (profile.dims or {}).get("vocab")
    if not vocab or vocab_padding(workload):  # Megatron pads it to 128 x tp: nothing to say
        return ""
    head_tp = plan.tp if profile.head.tp_fwd_flops > 0 else 1  # a head whose GEMM tp does not split keeps it whole
    columns = math.ceil(vocab / head_tp)  # the largest rank's slice
    elements = ALIGN_BYTES // HEAD_BYTES.get(plan.precision, 2)
    allowed, possible = tp_limit(workload)
    misaligned = bool(workload.cluster.gpu.sms) and columns % elements != 0  # GPUs priced by their tiles
    said = []
    if allowed < possible:
        said.append(f"keeps tensor parallelism at tp <= {allowed}, where the rest of the model allows {possible} "
                    "(tp must divide it)")
    if misaligned:
        said.append(f"is {columns:,} per tensor-parallel rank, not a multiple of {elements}: cuBLAS runs its GEMMs "
                    "on slower tensor-core kernels, which the estimate does not price")
    if not said:
        return ""
    tp = possible if allowed < possible else head_tp
    per_rank = f" ({elements} per rank x tp {tp})" if tp > 1 else ""
    return (f"note: the output layer's vocabulary ({vocab:,}) {' and '.join(said)}; pad it to "
            f"{padded_vocab(vocab, tp, elements):,}{per_rank}")
