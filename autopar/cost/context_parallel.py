"""Context parallelism's cost: the sequence split over cp ranks, and the K/V exchange it needs.

Each cp rank holds mbs x seq / cp tokens of every micro-batch: causal load balancing cuts the
sequence into 2 x cp chunks and gives rank i chunks i and 2cp-1-i, so every rank does 1/cp of the
attention's work as well as of the rest (torch's `_HeadTailLoadBalancer`, Megatron-Core's and
Transformer Engine's layout). The core model divides each rank's tokens by cp (`sequence_share`)
and reduces gradients over dp x cp (`gradient_group_size`: the weights are replicated over cp, as
torchtitan's dp_cp mesh); this module adds the K/V exchange, as the runtime schedules it:

- torch (`torch.distributed.tensor.experimental.context_parallel`, `_cp_options.rotate_method`):
  "allgather" (torch's default, what autopar's executor runs) all-gathers every rank's K/V once
  per attention call, issued before the first (local) step and waited after it; "alltoall"
  rotates them round the ring in cp - 1 `permute_tensor` steps, each under one step's attention.
  Backward rotates K/V again the same way and sends dK/dV round the ring (always all-to-all).
- megatron (Transformer Engine's ring attention, `cp_comm_type` p2p): cp - 1 point-to-point
  steps of K/V forward, K/V and dK/dV backward, each overlapped with one step's attention.

Only what a step's attention cannot hide is exposed. Per layer and micro-batch a rank's K/V are
tokens x (K and V elements per token) / tp x 2 bytes (4 in fp32); the elements per token are those
of the attention call's inputs (attn_flops / (2 seq^2): heads x head size, twice) under torch,
which exchanges what the model passes to SDPA (grouped K/V heads already repeated in the zoo Llama,
as in torchtitan's repeat_kv); Megatron-Core exchanges the grouped heads (x kv_heads / heads). Exposed seconds add to the
iteration as m + (pp - 1) / v micro-batch steps of the busiest pipeline rank (the bubble carries
them too); memory adds the exchange buffers of one layer.
"""

from __future__ import annotations

import math

import numpy as np

from autopar import axes
from autopar.cost.arrays import PlanArrays, mesh_order_of, unique_rows
from autopar.cost.coefficients import Coefficients
from autopar.knobs import PRECISIONS, RECOMPUTE_MODES, storage_dtype
from autopar.runtime import is_megatron

ROTATE_METHODS = ("allgather", "alltoall")  # torch's _cp_options.rotate_method
TORCH_ROTATE_METHOD = "allgather"  # torch's default, which autopar's executor keeps
RING = "p2p"  # Transformer Engine's ring (Megatron-Core's cp_comm_type "p2p")
FULL = RECOMPUTE_MODES.index("full")
FP32 = PRECISIONS.index("fp32")


def sequence_share(pa: PlanArrays) -> np.ndarray:
    """The cp degree of every plan (1 where the axis is not declared): a rank's tokens are 1/cp."""
    return np.asarray(getattr(pa, "cp", np.ones(len(pa))), dtype=float)


def gradient_group_size(pa: PlanArrays) -> np.ndarray:
    """Ranks that reduce gradients together (and shard ZeRO states): the product of the degrees of
    the axes declared with `reduces_gradients` (dp x cp)."""
    return math.prod(np.asarray(getattr(pa, a), dtype=float) for a in axes.gradient_axes())


def method_of(workload) -> str:
    return RING if is_megatron(workload.runtime) else TORCH_ROTATE_METHOD


def _attention(workload) -> tuple[float, float]:
    """(K and V elements per token exchanged, attention forward FLOPs per sample) per repeated layer,
    averaged. torch exchanges the attention call's inputs; Megatron-Core / Transformer Engine the
    grouped K/V heads (the model's kv_heads of heads, when its config names both)."""
    profile = workload.profile
    layers = [(blk, blk.count) for blk in profile.layers]
    n = sum(c for _, c in layers) or 1
    flops = sum(blk.attn_flops * c for blk, c in layers) / n
    kv = flops / (2.0 * profile.seq_len ** 2)
    heads, kv_heads = profile.dims.get("heads"), profile.dims.get("kv_heads")
    if is_megatron(workload.runtime) and heads and kv_heads:
        kv *= kv_heads / heads
    return kv, flops


def _cp_links(cluster, pa: PlanArrays, c: Coefficients) -> tuple[np.ndarray, np.ndarray]:
    """Bandwidth (efficiency applied) and latency of each plan's cp ring, once per distinct (degrees, order)."""
    names = tuple(axes.AXES)
    first, inverse = unique_rows([getattr(pa, a) for a in names] + [pa.mesh_order])
    table = np.zeros((len(first), 2))
    for row, i in enumerate(first):
        dims = axes.ParallelDims({a: int(getattr(pa, a)[i]) for a in names}, mesh_order_of(pa.mesh_order[i]))
        if dims.degrees["cp"] == 1:
            table[row] = (np.inf, 0.0)
            continue
        link = cluster.ring(dims.degrees["cp"], dims.strides()["cp"])
        table[row] = (link.bandwidth * c.link(link.kind), link.latency * c.latency_scale)
    t = table[inverse.reshape(-1)]
    return t[:, 0], t[:, 1]


def kv_exchange(workload, pa: PlanArrays, coeffs: Coefficients | None = None,
                method: str | None = None) -> dict[str, np.ndarray]:
    """Per plan: `exposed` (seconds per iteration the K/V exchange adds), `traffic` (seconds of it in
    all, hidden or not) and `buffer` (bytes of one layer's exchange buffers). `method`: one of
    ROTATE_METHODS or RING; by default the workload runtime's."""
    c = coeffs if coeffs is not None else Coefficients.for_cluster(workload.cluster, workload.runtime)
    method = method or method_of(workload)
    if method not in (*ROTATE_METHODS, RING):
        raise ValueError(f"unknown K/V exchange {method!r}; use one of {', '.join((*ROTATE_METHODS, RING))}")
    cp = sequence_share(pa)
    if not (cp > 1).any():  # no plan splits the sequence (most evaluations): nothing is exchanged
        return {key: np.zeros(len(pa)) for key in ("exposed", "traffic", "buffer")}
    profile, cluster = workload.profile, workload.cluster
    tp, pp = np.asarray(pa.tp, float), np.asarray(pa.pp, float)
    kv_per_token, attn_flops = _attention(workload)
    samples = np.asarray(pa.micro_batch_size, float) / cp  # a rank's share of a micro-batch
    nbytes = np.where(pa.precision == FP32, 4.0, 2.0)
    kv = samples * profile.seq_len * kv_per_token / tp * nbytes  # this rank's K and V of one layer
    # attention runs in the storage dtype (bf16 under fp8: torchao and TE cast only the linears)
    peak = np.array([cluster.gpu.peak_flops[storage_dtype(p)] for p in PRECISIONS])[pa.precision]
    step = samples * attn_flops / tp / cp / (peak * c.gemm_efficiency)  # one ring step's forward attention
    bw, lat = _cp_links(cluster, pa, c)
    base = c.collective_latency_s
    hop = kv / bw + lat + base  # one rotation of K/V to the ring's next rank
    gather = (cp - 1) / cp * kv * cp / bw + (cp - 1) * lat + base  # all-gather of every rank's K/V
    steps = cp - 1
    if method == "allgather":  # gathered during the local step; dK/dV still go round the ring
        fwd = np.maximum(gather - step, 0.0)
        bwd = np.maximum(gather - 2 * step, 0.0) + steps * np.maximum(hop - 2 * step, 0.0)
        traffic = 2 * gather + steps * hop
        buffer = kv * cp + kv
    else:  # a ring: each step's rotation under that step's attention; backward moves K/V and dK/dV
        fwd = steps * np.maximum(hop - step, 0.0)
        bwd = steps * np.maximum(2 * hop - 2 * step, 0.0)
        traffic = 3 * steps * hop
        buffer = 2 * kv
    layers = np.ceil(profile.num_layers / pp)  # on the busiest pipeline rank
    recomputed = np.where(pa.recompute == FULL, np.minimum(pa.recompute_blocks, layers), 0.0)
    per_mb = layers * (fwd + bwd) + recomputed * fwd
    mb_steps = np.asarray(pa.num_micro_batches, float) + (pp - 1) / np.asarray(pa.virtual_stages, float)
    on = cp > 1
    return {"exposed": np.where(on, per_mb * mb_steps, 0.0),
            "traffic": np.where(on, layers * traffic * mb_steps, 0.0),
            "buffer": np.where(on, buffer, 0.0)}


def time_term(workload, pa: PlanArrays, coeffs: Coefficients) -> np.ndarray:
    """The K/V exchange's exposed seconds per iteration (the `cp` part of an estimate)."""
    return kv_exchange(workload, pa, coeffs)["exposed"]


def memory_term(workload, pa: PlanArrays, coeffs: Coefficients) -> np.ndarray:
    """The K/V exchange buffers of one layer, per rank (the `cp_memory` part of an estimate)."""
    return kv_exchange(workload, pa, coeffs)["buffer"]


axes.attach_terms("cp", time_term=time_term, memory_term=memory_term)
