"""Tile and wave quantisation of a transformer layer's GEMMs (NVIDIA's Matrix Multiplication
Background guide, "Tile Quantization" and "Wave Quantization"; docs/hardware.md).

cuBLAS splits a GEMM's M x N output into thread-block tiles and runs them in waves of one tile per
SM: a dimension that is not a multiple of the tile pays for a whole tile, and the last wave of
tiles leaves SMs idle. The fraction of the launched tile-waves doing useful work is the shape
efficiency of one GEMM; a layer's is the FLOP-weighted harmonic mean over its GEMMs (forward,
activation gradient and weight gradient, whose outputs are M x N, M x K and N x K).

The shapes come from the architecture (`profile.dims`: hidden, heads, kv heads, ffn, vocab), not
from how a file writes it: Megatron-Core fuses q, k, v into one GEMM whatever the file does, and
the same shapes priced for two files of one architecture give them one time (issue 10, point 3).
A profile without these dims (not a transformer) gets efficiency 1.
"""

from __future__ import annotations

import numpy as np

# Thread-block tiles (rows x columns of the output) cuBLAS's large bf16 kernels use on A100/H100/B200;
# it picks, per shape, the one that wastes least.
TILES = ((128, 256), (256, 128))


def _one(m: np.ndarray, n: np.ndarray, sms: int) -> np.ndarray:
    """Useful fraction of the tile-waves of an m x n output, best tile."""
    best = np.zeros(np.broadcast(m, n).shape)
    for tm, tn in TILES:
        tiles = np.ceil(m / tm) * np.ceil(n / tn)
        best = np.maximum(best, m * n / (tm * tn) / (np.ceil(tiles / sms) * sms))
    return best


def layer_gemms(dims: dict, seq_len: int, blk) -> list[tuple[float, float, float, bool]] | None:
    """(M per sample, N, K, sharded along N) of one transformer layer's (`blk`, a BlockProfile)
    forward GEMMs, or None when the profile does not name the dims. Column-parallel GEMMs shard N,
    row-parallel ones K. A gated MLP (SwiGLU: gate and up, one column-parallel GEMM in
    Megatron-Core) is told from the layer's parameter count: three ffn x hidden matrices instead of
    two. A layer with routed experts has the attention's GEMMs only: its experts' grouped GEMMs are
    cost/moe.py's, whatever dense `ffn` a config also names (Mixtral's `intermediate_size` is its
    experts')."""
    try:
        h, heads = dims["hidden"], dims["heads"]
    except KeyError:
        return None
    kv, head_dim = dims.get("kv_heads", heads), dims.get("head_dim", h // heads)
    qkv = (heads + 2 * kv) * head_dim
    attention = [(seq_len, qkv, h, True), (seq_len, h, heads * head_dim, False)]
    if blk.experts:
        return attention
    if "ffn" not in dims:
        return None
    ffn = dims["ffn"]
    gated = 2 if blk.params - (qkv + heads * head_dim) * h > 2.5 * h * ffn else 1
    return attention + [(seq_len, gated * ffn, h, True), (seq_len, h, ffn, False)]


def head_gemms(dims: dict, seq_len: int) -> list[tuple[float, float, float, bool]] | None:
    """The output projection: hidden -> vocab, column-parallel."""
    if "hidden" not in dims or "vocab" not in dims:
        return None
    return [(seq_len, dims["vocab"], dims["hidden"], True)]


_KIND_MEMO: dict[tuple, dict[tuple[float, float], np.ndarray]] = {}  # (shape inputs) -> (mb, tp) -> row


def kind_efficiency(profile, micro_batch: np.ndarray, tp: np.ndarray, sms: int) -> np.ndarray:
    """Shape efficiency per plan and block kind of the profile, shape (G, K): embedding 1 (a
    lookup), each layer kind and the head from their GEMMs. Memoised per (micro-batch, tp): the
    cost model asks it on every evaluation, searches and fits for the same few pairs."""
    mb, t = np.asarray(micro_batch, dtype=float), np.asarray(tp, dtype=float)
    pairs, inverse = np.unique(np.stack([mb, t], axis=1), axis=0, return_inverse=True)
    if len(_KIND_MEMO) > 256:
        _KIND_MEMO.clear()
    inputs = (repr(sorted(profile.dims.items())), profile.seq_len, sms,  # everything layer_gemms reads
              tuple((b.params, bool(b.experts)) for b in profile.layers))
    memo = _KIND_MEMO.setdefault(inputs, {})
    keys = [(float(a), float(b)) for a, b in pairs]
    missing = [i for i, key in enumerate(keys) if key not in memo]
    if missing:
        rows = _kind_rows(profile, pairs[missing, 0], pairs[missing, 1], sms)
        for i, row in zip(missing, rows):
            memo[keys[i]] = row
    table = np.stack([memo[key] for key in keys]) if keys else np.ones((0, len(profile.blocks)))
    return table[inverse.reshape(-1)]


def _kind_rows(profile, micro_batch: np.ndarray, tp: np.ndarray, sms: int) -> np.ndarray:
    dims, s = profile.dims, profile.seq_len
    cols = [np.ones(len(micro_batch))]
    cols += [shape_efficiency(layer_gemms(dims, s, blk), micro_batch, tp, sms) for blk in profile.layers]
    cols.append(shape_efficiency(head_gemms(dims, s), micro_batch, tp, sms))
    return np.stack(cols, axis=1)


def shape_efficiency(gemms, micro_batch: np.ndarray, tp: np.ndarray, sms: int) -> np.ndarray:
    """Shape efficiency of a block's GEMMs (forward and backward together) per plan, shape (G,)."""
    b, t = np.asarray(micro_batch, dtype=float), np.asarray(tp, dtype=float)
    if gemms is None or not sms:
        return np.ones(np.broadcast(b, t).shape)
    flops = time = 0.0
    for m, n, k, column in gemms:
        m = m * b
        n, k = (n / t, k) if column else (n, k / t)
        f = 2 * m * n * k
        # forward m x n, activation gradient m x k, weight gradient n x k
        time = time + f / _one(m, n, sms) + f / _one(m, k, sms) + f / _one(n, k, sms)
        flops = flops + 3 * f
    return flops / time
