"""The elementwise traffic and saved activations of a transformer layer as Megatron-Core runs it,
from the architecture.

Megatron-Core (with Transformer Engine) runs its own layer whatever a model file writes: its
norms, residual adds, dropouts and activation are the same fused kernels for any file of one
architecture. Pricing them from the file's eager ops would make two files of one architecture
cost differently (a Llama file's RMSNorm, rotary and SwiGLU in eager ops count about four times
the bundled GPT's bytes), so under runtime megatron a layer's elementwise bytes outside attention's
core come from its dims, counted as the bundled GPT file counts the same ops (which the A100 fit's
`elementwise_traffic` is relative to): per token, 42 bytes per hidden element (two norms, two
dropouts and residual adds, the attention's reshapes) and 4 per ffn element of the activation
(read and write), 6 for a gated one (gate and up read, one written). Rotary embeddings are not
priced (Megatron fuses them into one read and write of q and k).

What the layer keeps for backward is Megatron-Core's too, not the file's (an eager RMSNorm or
SwiGLU keeps several whole tensors where Megatron's fused kernels keep one): Korthikanti et al.
2022's count (section 4: 34 bytes per token and hidden element outside attention's core), extended
to grouped-query attention and gated MLPs. Per token, in 16-bit: each norm's input (2h, twice) and
each column-parallel GEMM's input (the norm's output, 2h, twice: an "entry", the sequence shard
under sequence parallelism); q, k and v (2 (heads + 2 kv) head_dim, 2 x 3h without grouped-query
attention); the attention's output, which the output projection saves (2 heads head_dim, 2h where
head_dim is hidden / heads); the MLP's first output, which the activation's backward reads (2 ffn, twice
that gated: gate and up), and the activation's output, which the second GEMM saves (2 ffn); plus the
file's own dropout masks (one byte per element at each site: Megatron keeps the same) and the norms'
fp32 statistics. Rotary embeddings' rotated copies of q and k are not counted (Korthikanti's GPT has
none). What Transformer Engine's fp8 changes is in cost/precision.py.
"""

from __future__ import annotations

import numpy as np

from autopar.cost.gemm import layer_gemms
from autopar.knobs import DTYPE_BYTES

LAYER_BYTES_PER_HIDDEN = 42.0
NORM_SAVED = 4.0  # per hidden element per token: the inputs of the two norms (16-bit)
NORM_STATS = 16.0  # per token: the two norms' fp32 mean and reciprocal deviation, LayerNorm's; an RMSNorm
# keeps only the second (8 bytes less per token and layer, under 0.1% of a layer's; the dims do not say which)
ENTRY_SAVED = 4.0  # the two column-parallel GEMMs' inputs (the norms' outputs)
ACTIVATION_BYTES = {False: 4.0, True: 6.0}  # per ffn element, plain or gated


def _dense_layers(profile):
    """(index in the kind arrays, BlockProfile, its four GEMMs) of each layer kind Megatron-Core's own
    dense layer replaces: known dims, no routed experts (an MoE layer keeps the file's figures)."""
    for i, blk in enumerate(profile.layers, start=1):
        gemms = layer_gemms(profile.dims, profile.seq_len, blk)
        if gemms is not None and not blk.experts:
            yield i, blk, gemms


def megatron_layer_io(profile) -> dict[str, np.ndarray]:
    """Per block kind, per sample in 16-bit: `io_bytes`, the elementwise bytes outside attention's core
    of each dense layer kind, and `dense`, 1 where that replaces the file's figure, else 0 (the
    embedding, the head and MoE layers keep the profile's)."""
    s, k = profile.seq_len, len(profile.layers) + 2
    out = {n: np.zeros(k) for n in ("io_bytes", "dense")}
    for i, _, gemms in _dense_layers(profile):
        gated = gemms[2][1] > profile.dims["ffn"]  # gate and up in one column-parallel GEMM
        out["io_bytes"][i] = s * (LAYER_BYTES_PER_HIDDEN * profile.dims["hidden"]
                                  + ACTIVATION_BYTES[gated] * profile.dims["ffn"])
        out["dense"][i] = 1.0
    return out


def megatron_layer_saved(profile) -> dict[str, np.ndarray]:
    """Per block kind, per sample, in the profile's dtype: `saved_bytes`, `saved_tp_bytes` (split by
    tensor parallelism) and `entry_saved_bytes` of each dense layer kind as Megatron-Core keeps them
    outside attention's core (module doc; the core is priced by the caller), with `dense` as in
    `megatron_layer_io`."""
    s, k = profile.seq_len, len(profile.layers) + 2
    out = {n: np.zeros(k) for n in ("saved_bytes", "saved_tp_bytes", "entry_saved_bytes", "dense")}
    scale = DTYPE_BYTES[profile.dtype] / 2  # the counts are 16-bit bytes
    for i, blk, gemms in _dense_layers(profile):
        (_, qkv, h, _), (_, _, attn_out, _), (_, first, _, _), (_, _, ffn, _) = gemms
        tp = s * scale * (2 * qkv + 2 * attn_out + 2 * first + 2 * ffn)
        entry = s * scale * ENTRY_SAVED * h
        out["saved_tp_bytes"][i], out["entry_saved_bytes"][i] = tp, entry
        out["saved_bytes"][i] = tp + entry + s * (scale * NORM_SAVED * h + NORM_STATS) + blk.mask_saved_bytes
        out["dense"][i] = 1.0
    return out
