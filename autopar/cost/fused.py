"""The elementwise traffic of a transformer layer as Megatron-Core runs it, from the architecture.

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
"""

from __future__ import annotations

import numpy as np

from autopar.cost.gemm import layer_gemms

LAYER_BYTES_PER_HIDDEN = 42.0
ACTIVATION_BYTES = {False: 4.0, True: 6.0}  # per ffn element, plain or gated


def megatron_layer_io(profile) -> np.ndarray | None:
    """Per block kind, per sample in 16-bit: elementwise bytes outside attention's core of each layer
    kind (0 for the embedding and head, which keep the profile's), or None when the dims are unknown."""
    dims, s = profile.dims, profile.seq_len
    out = np.zeros(len(profile.layers) + 2)
    for i, blk in enumerate(profile.layers, start=1):
        gemms = layer_gemms(dims, s, blk.params)
        if gemms is None:
            return None
        gated = gemms[2][1] > dims["ffn"]  # gate and up in one column-parallel GEMM
        out[i] = s * (LAYER_BYTES_PER_HIDDEN * dims["hidden"] + ACTIVATION_BYTES[gated] * dims["ffn"])
    return out
