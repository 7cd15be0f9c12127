"""collective_time: the cost model's collectives priced for any process group of a cluster."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.cluster import load_cluster
from autopar.cost import Coefficients, collective_time
from autopar.cost.collectives import KINDS, all_reduce_time

DGX = load_cluster("dgx-a100-80g").with_nodes(4)
C = Coefficients.for_cluster(DGX)


def test_all_reduce_inside_a_node_is_the_cost_models_ring():
    link = DGX.ring(8, 1)
    want = all_reduce_time(2**30, 8, link.bandwidth * C.link(link.kind), link.latency * C.latency_scale,
                           C.collective_latency_s)
    assert collective_time("all_reduce", 2**30, (8, 1), DGX, C) == pytest.approx(want)
    assert link.kind == "nvlink"


def test_a_group_across_nodes_is_slower_than_inside_one():
    inside = collective_time("all_reduce", 2**30, (8, 1), DGX, C)
    # 8 ranks one per node-slot, 4 nodes apart from each other: every hop crosses a NIC
    across = collective_time("all_reduce", 2**30, (4, 8), DGX, C)
    assert across > 3 * inside


def test_all_to_all_across_nodes_is_bound_by_the_nics():
    nbytes = 2.0**28
    inside = collective_time("all_to_all", nbytes, (8, 1), DGX, C)
    two_nodes = collective_time("all_to_all", nbytes, (16, 1), DGX, C)
    nic = DGX.p2p(8)
    # half of each rank's buffer leaves the node through that rank's own NIC
    assert two_nodes >= 0.5 * nbytes / (nic.bandwidth * C.link(nic.kind))
    assert two_nodes > 2 * inside


def test_send_recv_and_trivial_groups():
    assert collective_time("all_gather", 1e9, (1, 1), DGX, C) == 0
    link = DGX.p2p(8)
    assert collective_time("send_recv", 1e9, (2, 8), DGX, C) > 1e9 / link.bandwidth
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("allreduce", 1e9, (8, 1), DGX, C)


@settings(max_examples=40, deadline=None)
@given(nbytes=st.floats(1e3, 1e11), size=st.sampled_from([2, 4, 8, 16, 32]), stride=st.sampled_from([1, 2, 8]))
def test_all_reduce_is_a_reduce_scatter_then_an_all_gather(nbytes, size, stride):
    """NCCL's ring all-reduce is a reduce-scatter followed by an all-gather over the same ring: the two
    halves' times add up to it (less one per-call latency), and every kind grows with the bytes."""
    if (size - 1) * stride >= DGX.num_gpus:
        return
    c = Coefficients.from_dict({**C.to_dict(), "collective_latency_s": 1e-5, "collective_efficiency": {}})
    whole = collective_time("all_reduce", nbytes, (size, stride), DGX, c)
    halves = sum(collective_time(k, nbytes, (size, stride), DGX, c) for k in ("reduce_scatter", "all_gather"))
    assert whole == pytest.approx(halves - c.collective_latency_s, rel=1e-9)
    for kind in KINDS:
        group = (2, stride) if kind == "send_recv" else (size, stride)
        assert np.all(collective_time(kind, 2 * nbytes, group, DGX, c) > collective_time(kind, nbytes, group, DGX, c))
