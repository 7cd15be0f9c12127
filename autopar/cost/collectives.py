"""Collective communication times: bytes and a process group into seconds.

`collective_time` prices any collective for a device-mesh axis of a cluster graph. The cost model's
own terms call the ring formulas below on per-plan link arrays; the MoE dispatch uses
`all_to_all_time` with its own per-node NIC sharing and DeepEP's byte overrides (cost/moe.py), and
context parallelism's K/V all-gather is written out in cost/context_parallel.py: the three do not
yet share one all-to-all and one link lookup (docs/hardware.md says so).

The formulas are nccl-tests' bus-bandwidth convention (docs/references.md §3): a ring all-reduce
moves 2(n-1)/n of the buffer over each rank's link, all-gather and reduce-scatter (n-1)/n, and an
all-to-all (n-1)/n of each rank's buffer, each of those fractions at the group's bus bandwidth.
Each call also pays its per-hop latencies and one fixed per-call cost (NCCL's base latency,
`collective_latency_s`). `collective_time` takes a process group as the cluster graph sees it
(size and stride of a device-mesh axis) and applies the cluster's link efficiencies.
"""

from __future__ import annotations

import numpy as np

from autopar.cost.coefficients import Coefficients

# nccl-tests' bus-bandwidth factor per kind: the fraction of `size` bytes (nccl-tests' buffer size:
# all-gather's output, reduce-scatter's input, all-to-all's per-rank buffer) each rank's link carries
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}
KINDS = (*BUS_FACTOR, "send_recv")


def all_reduce_time(nbytes, n, bw, lat, base=0.0):
    """Ring all-reduce: 2(n-1)/n of the data crosses each link, 2(n-1) latency steps, plus the
    fixed cost of one collective call (NCCL's base latency: launch and rendezvous)."""
    t = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
    return t + base if base else t


def all_gather_time(nbytes, n, bw, lat, base=0.0):
    """Ring all-gather or reduce-scatter of `nbytes` in total: (n-1)/n of it per link."""
    t = (n - 1) / n * nbytes / bw + (n - 1) * lat
    return t + base if base else t


def collective_time(kind: str, nbytes, group: tuple[int, int], cluster, coeffs: Coefficients | None = None):
    """Seconds for one collective `kind` (KINDS) of `nbytes` (nccl-tests' size, see BUS_FACTOR) over
    the process group `group` = (size, stride) on `cluster`: the ranks b, b+stride, ... of a
    device-mesh axis (tp innermost has stride 1). The rate is the cluster graph's worst such ring
    (for a group spanning nodes: its members' NICs, shared) at the coefficients' efficiency for the
    link kind (`Coefficients.for_cluster(cluster)` if none given), plus (n-1) hop latencies (2(n-1)
    for all-reduce) and the per-call base latency. An all-to-all spanning nodes sends (n-m)/n of its
    buffer off the node (m members per node) through one NIC per member, which bounds it from below.
    `send_recv`: one message from a rank to the one `stride` later."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; one of {', '.join(KINDS)}")
    size, stride = group
    c = coeffs if coeffs is not None else Coefficients.for_cluster(cluster)
    nbytes = np.asarray(nbytes, dtype=float)
    base = c.collective_latency_s
    if kind == "send_recv":
        link = cluster.p2p(stride)
        return nbytes / (link.bandwidth * c.link(link.kind)) + link.latency * c.latency_scale + base
    if size <= 1:
        return np.zeros_like(nbytes)
    link = cluster.ring(size, stride)
    bw = link.bandwidth * c.link(link.kind) * c.collective(kind)
    steps = 2 * (size - 1) if kind == "all_reduce" else size - 1
    t = BUS_FACTOR[kind](size) * nbytes / bw
    span = (size - 1) * stride
    if kind == "all_to_all" and span >= cluster.gpus_per_node:
        members = max(1, min(size, cluster.gpus_per_node // stride))
        nic = cluster.p2p(cluster.gpus_per_node)  # a GPU through its NIC to the same GPU of the next node
        t = np.maximum(t, (size - members) / size * nbytes / (nic.bandwidth * c.link(nic.kind)))
    return t + steps * link.latency * c.latency_scale + base


def all_to_all_time(nbytes, n, per_node, intra_bw, inter_bw, lat, base=0.0, on_node=None, off_node=None):
    """All-to-all of `nbytes` per rank over n ranks (arrays: one group per plan), `per_node` of them on
    each node, as the MoE terms price it (autopar/cost/moe.py): each rank keeps
    1/n, sends (per_node - 1)/n over NVLink and (n - per_node)/n over its NIC (or `on_node` and
    `off_node` bytes, for a dispatcher that routes otherwise), both at once; n - 1 pairwise steps of
    latency, plus the fixed cost of a collective call."""
    n = np.asarray(n, dtype=float)
    per_node = np.minimum(np.asarray(per_node, dtype=float), n)
    on_node = nbytes * (per_node - 1) / n if on_node is None else on_node
    intra = np.where(per_node > 1, on_node / intra_bw, 0.0)
    off_node = nbytes * (n - per_node) / n if off_node is None else off_node
    inter = np.where(n > per_node, off_node / inter_bw, 0.0)
    t = np.maximum(intra, inter) + (n - 1) * lat
    return np.where(n > 1, t + base, 0.0)
