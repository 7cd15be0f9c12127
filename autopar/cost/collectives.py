"""Time of one collective over a group of ranks, from its bottleneck link's rate (bytes/s, efficiency
applied) and per-hop latency: nccl-tests' bus-bandwidth conventions (docs/references.md §3)."""

from __future__ import annotations

import numpy as np


def all_reduce_time(nbytes, n, bw, lat, base=0.0):
    """Ring all-reduce: 2(n-1)/n of the data crosses each link, 2(n-1) latency steps, plus the
    fixed cost of one collective call (NCCL's base latency: launch and rendezvous)."""
    t = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
    return t + base if base else t


def all_gather_time(nbytes, n, bw, lat, base=0.0):
    """Ring all-gather or reduce-scatter of `nbytes` in total: (n-1)/n of it per link."""
    t = (n - 1) / n * nbytes / bw + (n - 1) * lat
    return t + base if base else t


def all_to_all_time(nbytes, n, per_node, intra_bw, inter_bw, lat, base=0.0, on_node=None, off_node=None):
    """All-to-all of `nbytes` per rank over n ranks, `per_node` of them on each node: each rank keeps
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
