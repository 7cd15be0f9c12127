"""torchtitan's per-op selective activation checkpointing, priced (the `op_sac` workload switch).

torchtitan's `selective` AC with option `op` (`torchtitan/distributed/activation_checkpoint.py`,
`_custom_policy`) saves the outputs of the compute-heavy ops of each block (matmuls, SDPA's
flash kernel, reduce-scatters, the amax of float8 scaling) but only every second `aten.mm` in the
order the forward runs them, counted afresh in each block; every other op is recomputed before
backward. So a Llama layer, whose forward runs wq, wk, wv, wo, w1, w3, w2 (torchtitan's
`Attention` and `FeedForward`), recomputes wk, wo and w3, the layer's elementwise ops (norms,
rotary, SiLU, the products) and the tensor-parallel all-gathers (reduce-scatters are saved), and
keeps the attention kernel. Plan recompute `selective` otherwise means autopar's own checkpoint
of the attention core (cost/model.py); this module replaces it where a workload sets `op_sac`.
"""

from __future__ import annotations

import numpy as np

from autopar.cost.gemm import layer_gemms
from autopar.knobs import DTYPE_BYTES


def applies(workload) -> bool:
    return "op_sac" in workload.switches


def _forward_mms(dims: dict, seq_len: int, blk) -> list[tuple[float, float, bool]]:
    """(N, K, column-wise) of a layer's forward matmuls in torchtitan's order, q, k and v apart, a
    gated MLP's w1 and w3 apart (cost/gemm.py fuses them as Megatron-Core does)."""
    gemms = layer_gemms(dims, seq_len, blk)
    if not gemms:
        return []
    h, heads = dims["hidden"], dims["heads"]
    kv, head_dim = dims.get("kv_heads", heads), dims.get("head_dim", h // heads)
    mms = [(heads * head_dim, h, True), (kv * head_dim, h, True), (kv * head_dim, h, True),
           (h, heads * head_dim, False)]
    if len(gemms) > 2:
        ffn = gemms[3][2]
        mms += [(ffn, h, True)] * (gemms[2][1] // ffn) + [(h, ffn, False)]
    return mms


def recomputed_flops(profile) -> np.ndarray:
    """(K,) per block kind, the forward matmul FLOPs per sample op SAC reruns (every second mm; all
    are sharded by tp: column-wise ones along N, row-wise ones along K)."""
    return _mm_flops(profile, slice(1, None, 2))


def saved_elements(profile) -> np.ndarray:
    """(K, 2) per block kind, elements per token op SAC keeps for backward besides the block's input:
    [sharded by tp, whole on each rank]. The kept matmuls' outputs (every first of two: wq, wv, w1,
    w2 for a gated Llama layer; a column-wise one's output is the rank's shard, a row-wise one's the
    whole partial sum before its reduction) and SDPA's output (heads x head_dim, sharded)."""
    out = np.zeros((len(profile.layers) + 2, 2))
    for i, blk in enumerate(profile.layers, start=1):
        mms = _forward_mms(profile.dims, profile.seq_len, blk)
        if mms:
            kept = mms[0::2]
            out[i] = (sum(n for n, _, col in kept if col) + mms[0][0], sum(n for n, _, col in kept if not col))
    return out


def recompute_time(workload, g, b, t, rate, gemm_scale, flops_f, io_f, tp_f, fwd_scale) -> np.ndarray:
    """(G, K) seconds per micro-batch of what op SAC reruns before each layer's backward: its
    recomputed matmuls at the pass's GEMM rate (fp8's factor on the linears where it applies), every
    elementwise op of the forward, and the forward's tensor-parallel all-gathers (under sequence
    parallelism the gather's part of the pass's collectives: of `fwd_scale` (G, 1), the pass's bytes as a
    share of bf16's (cost/precision.py `tp_forward_scale`), the gather holds scale - 0.5, so half of them, a
    third where the gathers move fp8; without it the all-reduces, none of which is saved)."""
    profile = workload.profile
    lin = b * recomputed_flops(profile) / t
    linear_share = np.divide(b * _mm_flops(profile) / t, flops_f, out=np.zeros_like(flops_f), where=flops_f > 0)
    factor = 1 - np.divide(1 - gemm_scale, linear_share, out=np.zeros_like(flops_f), where=linear_share > 0)
    sp = np.asarray(g.sequence_parallel, dtype=bool)[:, None]
    return lin * factor / rate + io_f + np.where(sp, (fwd_scale - 0.5) / fwd_scale, 1.0) * tp_f


def _mm_flops(profile, which: slice = slice(None)) -> np.ndarray:
    """(K,) per block kind, the forward FLOPs per sample of the layer's matmuls `which` selects (all by default)."""
    out = np.zeros(len(profile.layers) + 2)
    for i, blk in enumerate(profile.layers, start=1):
        mms = _forward_mms(profile.dims, profile.seq_len, blk)[which]
        out[i] = sum(2.0 * profile.seq_len * n * k for n, k, _ in mms)
    return out


def kept_bytes(workload, b, act_scale, t, sp_div, act_sel) -> np.ndarray:
    """(G, K) activation bytes per micro-batch a layer keeps under op SAC (the block's input,
    sequence-sharded under sequence parallelism, and `saved_elements`); other blocks keep `act_sel`."""
    profile = workload.profile
    elems = saved_elements(profile)
    per_token = profile.dims.get("hidden", 0) / sp_div + elems[:, 0] / t + elems[:, 1]
    layer = b * act_scale * profile.seq_len * per_token * DTYPE_BYTES[profile.dtype]
    is_layer = np.array([0.0] + [1.0] * len(profile.layers) + [0.0]) > 0
    return np.where(is_layer & (elems.sum(axis=1) > 0), layer, act_sel)
