"""Each block's share of the host's time per pass, from the kernels it launches.

The host issues every kernel a block runs (eager torch, Megatron's Python), so where a run is
host-bound a block costs what its launches cost, not what a layer does: the zoo GPT's embedding
launches 5 kernels in forward (two lookups, an add, a dropout, the positions' arange), a layer 18,
and a head with Megatron's vocabulary-parallel loss 27. `block_host_s` (and `tp_host_s`) are
priced per layer, the count-weighted mean of the profile's layer kinds; every block kind pays its
forward launches over that mean (`block_weights`). A profile that counted no launches (stored by
a profiler before version 13) prices every block as a layer, as before.
"""

from __future__ import annotations

import numpy as np

from autopar.cost import cross_entropy
from autopar.runtime import is_megatron

# Megatron's transformer layer issues 18 GPU operations in forward (two norms, five GEMMs and the QKV
# bias add, the attention core's kernels, the bias-GeLU and bias-dropout-adds, the tensor-parallel
# collectives: docs/references.md §5, Megatron's transformer.py); Megatron-Core's TE layer fuses the
# same way whatever the model file's eager ops (RMSNorm, rotary, SwiGLU each one kernel there)
MEGATRON_LAYER_LAUNCHES = 18.0


def block_weights(k: dict[str, np.ndarray], workload) -> np.ndarray:
    """Host time of each block kind per pass, in layers' worth, shape (K,): its forward launches
    over the layers' mean; under Megatron's loss (the switch) the head's loss launches are that
    loss's (cost/cross_entropy.py) instead of the file's."""
    launches = np.asarray(k["launches"], dtype=float).copy()
    if cross_entropy.applies(workload):
        launches[-1] += cross_entropy.LOSS_LAUNCHES - k["loss_launches"][-1]
    per_layer = _mean_layer_launches(k, workload)
    if per_layer <= 0:  # launches not counted
        return np.ones_like(launches)
    return launches / per_layer


def _mean_layer_launches(k: dict[str, np.ndarray], workload) -> float:
    """The profile's forward launches of a layer, the count-weighted mean over its layer kinds (0: none counted)."""
    counts = np.array([float(b.count) for b in workload.profile.layers])
    launches = np.asarray(k["launches"], dtype=float)[1:-1]
    return float(np.dot(counts, launches) / counts.sum()) if counts.sum() else 0.0


def layer_launches(k: dict[str, np.ndarray], workload) -> float:
    """Kernels a layer launches per forward pass: Megatron's fused layer under a Megatron runtime, else
    the profile's count-weighted mean over its layer kinds (0 for a profile that counted none). The
    default launch cost (`Coefficients.launch_s`) is priced per these. 0 for a mixture-of-experts
    model: the model file's eager expert loop is not how runtimes launch experts (one grouped GEMM, or
    Megatron-Core's loop, whose launches cost/moe.py prices itself)."""
    if workload.profile.is_moe:
        return 0.0
    if is_megatron(workload.runtime):
        return MEGATRON_LAYER_LAUNCHES
    return _mean_layer_launches(k, workload)


def end_weights(weights: np.ndarray) -> np.ndarray:
    """`block_weights` of the ends only (the embedding, the head): what a plan with CUDA graphs of its
    layers still launches kernel by kernel."""
    ends = np.zeros_like(weights)
    ends[[0, -1]] = weights[[0, -1]]
    return ends
