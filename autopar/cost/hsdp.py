"""HSDP's cost: ZeRO within each replica's shard group, gradients all-reduced across the replicas.

`dp_replicate` = r (autopar.axes: the folded axis, dp's outermost ranks) splits the gradient group
(dp x cp) into r replicas of dp x cp / r ranks each, torchtitan's dp_shard_cp. What runs:
- ZeRO-2 / 3, FSDP2 on the 2-D (replicate, shard) mesh: each gradient is reduce-scattered over the
  shard group, then its shard all-reduced across the replicas (FSDP2's reduce-scatter, then
  all-reduce on the replicate dimension); parameters are all-gathered within the shard group;
- ZeRO-1 under torch: DDP all-reduces over the whole group, ZeroRedundancyOptimizer shards the
  optimizer over the shard group and broadcasts within it; under Megatron-Core the distributed
  optimizer with `num_distributed_optimizer_instances` = r reduce-scatters within an instance,
  all-reduces across the instances, all-gathers within.
Optimizer states, sharded gradients and sharded weights are divided by the shard group's size.
Routed experts keep their expert-data-parallel group as before (cost/moe.py: ep within dp x cp);
autopar's executor does not run ep beside replicas (the capability rule of dp_replicate).
The core model (`cost/model.py`'s `evaluate`) takes the shard group's size and links from here,
and `replica_reduce` as the term every ZeRO reduction adds; r = 1 returns the whole gradient
group and its links unchanged and adds 0 (the plans of before are priced exactly as before).
"""

from __future__ import annotations

import functools

import numpy as np

from autopar import axes
from autopar.cost.arrays import PlanArrays, mesh_order_of, unique_rows
from autopar.cost.coefficients import Coefficients
from autopar.cost.collectives import all_reduce_time

FOLDED = "dp_replicate"


def replicas(pa: PlanArrays) -> np.ndarray:
    """The dp_replicate degree of every plan (1 where the folded axis is not declared)."""
    return np.asarray(getattr(pa, FOLDED, np.ones(len(pa))), dtype=float)


@functools.lru_cache(maxsize=1 << 12)
def _links(cluster, degrees: tuple[tuple[str, int], ...], order: int, r: int) -> tuple:
    """(shard group's ring, replicas' ring) of one layout: the shard group is dp's inner dp / r
    ranks x cp, the replicas r ranks dp / r of dp's steps apart."""
    dims = axes.ParallelDims(dict(degrees), mesh_order_of(order))
    strides, sizes = dims.strides(), dims.degrees
    inner = {"dp": sizes["dp"] // r, **{a: sizes[a] for a in axes.gradient_axes() if a != "dp"}}
    shard = int(np.prod(list(inner.values())))
    stride = min((strides[a] for a, n in inner.items() if n > 1), default=1)
    folded = axes.FOLDED[FOLDED]
    return cluster.ring(shard, stride), cluster.ring(r, folded.stride(dims, r))


def groups(cluster, pa: PlanArrays, c: Coefficients, dpn: np.ndarray, dp_bw: np.ndarray,
           dp_lat: np.ndarray) -> dict[str, np.ndarray]:
    """(N, 1) columns: `replicas`, the shard group's size (`shard`, dp x cp / r) and its link
    (`shard_bw`, `shard_lat`), the replicas' link (`rep_bw`, `rep_lat`); where r = 1 the gradient
    group's own size and link (`dpn`, `dp_bw`, `dp_lat`)."""
    r = replicas(pa)
    n = len(pa)
    shard_bw, shard_lat = dp_bw.copy(), dp_lat.copy()
    rep_bw, rep_lat = dp_bw.copy(), dp_lat.copy()
    hsdp = np.flatnonzero(r > 1)
    if len(hsdp):
        names = tuple(axes.AXES)
        sub = pa.take(hsdp)
        first, inverse = unique_rows([getattr(sub, a) for a in names] + [sub.mesh_order, replicas(sub)])
        table = np.zeros((len(first), 4))
        for row, i in enumerate(first):
            degrees = tuple((a, int(getattr(sub, a)[i])) for a in names)
            for col, link in enumerate(_links(cluster, degrees, int(sub.mesh_order[i]), int(replicas(sub)[i]))):
                table[row, 2 * col] = link.bandwidth * c.link(link.kind)
                table[row, 2 * col + 1] = link.latency * c.latency_scale
        t = table[inverse]
        shard_bw[hsdp, 0], shard_lat[hsdp, 0], rep_bw[hsdp, 0], rep_lat[hsdp, 0] = t.T
    return {"replicas": r.reshape(n, 1), "shard": dpn / r.reshape(n, 1), "shard_bw": shard_bw,
            "shard_lat": shard_lat, "rep_bw": rep_bw, "rep_lat": rep_lat}


def replica_reduce(grad_bytes: np.ndarray, g: dict[str, np.ndarray], base: float) -> np.ndarray:
    """Seconds of the all-reduce of the gradient shards (grad_bytes / shard) across the replicas
    that follows each ZeRO reduce-scatter; 0 without replicas."""
    r = g["replicas"]
    return np.where(r > 1, all_reduce_time(grad_bytes / g["shard"], r, g["rep_bw"], g["rep_lat"], base), 0.0)
