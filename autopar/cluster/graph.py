"""The cluster as a networkx graph, and the link a ring over a group of ranks gets on it.

Nodes are devices ("n3.gpu5", "n3.nvswitch", "n3.pcie2", "n3.cpu1", "n3.nic5", and one
"fabric" switch joining all NICs: a non-blocking fat tree is assumed). Undirected edges carry
`bandwidth` (one-way bytes/s: each direction of a full-duplex link carries this much),
`latency` (seconds) and `kind`.

Group links are derived on a one-node template graph (local names, plus "fabric"): the
cluster is homogeneous, so a group's link depends only on which local GPUs it holds in each
node and on whether it spans nodes. This keeps a 16,384-GPU cluster as cheap as one node.

The rule models NCCL's rings. Intra-node: a ring over the node's members in rank order, each
hop routed over the widest links (least seconds per byte); a physical edge crossed by n hops in
one direction gives each n-th of its rate, so a PCIe-tree ring bottlenecks where hops share the
root or socket link, while an NVSwitch gives every GPU its own NVLink rate. Inter-node: with k
members in a node NCCL runs k channels, each through one member's nearest NIC, so the node
pushes the sum of the members' GPU->NIC->fabric rates (members sharing a NIC or a PCIe uplink
share its rate). A group gets the smaller of the two.
"""

from __future__ import annotations

import functools
import math
from collections import Counter

import networkx as nx

from autopar.cluster.hardware import Link, NodeLayout

FABRIC = "fabric"
NO_LINK = Link(math.inf, 0.0, "none")  # a group of one rank communicates with nobody


def node_edges(layout: NodeLayout, gpus: int) -> list[tuple[str, str, str]]:
    """(u, v, kind) for every edge of one node with local names, plus its NIC -> fabric edges."""
    switches = math.ceil(gpus / layout.gpus_per_pcie_switch) if layout.gpus_per_pcie_switch else 0
    gpu_kind = "shm" if layout.intra == "shm" else "pcie"
    edges = []
    for i in range(gpus):
        if layout.intra == "nvswitch":
            edges.append((f"gpu{i}", "nvswitch", "nvlink"))
        host = f"pcie{i // layout.gpus_per_pcie_switch}" if switches else f"cpu{i * layout.sockets // gpus}"
        edges.append((f"gpu{i}", host, gpu_kind))
    edges += [(f"pcie{j}", f"cpu{j * layout.sockets // switches}", "pcie") for j in range(switches)]
    edges += [(f"cpu{a}", f"cpu{b}", "upi") for a in range(layout.sockets) for b in range(a + 1, layout.sockets)]
    for j in range(layout.nics):
        host = (f"pcie{j * switches // layout.nics}" if layout.nic_attach == "switch"
                else f"cpu{j * layout.sockets // layout.nics}")
        edges += [(f"nic{j}", host, "pcie"), (f"nic{j}", FABRIC, layout.nic_kind)]
    return edges


def cluster_graph(layout: NodeLayout, links: dict[str, Link], nodes: int, gpus: int) -> nx.Graph:
    """The whole cluster: each node's edges under the prefix "n{node}.", NICs joined at "fabric"."""
    template = node_edges(layout, gpus)
    graph = nx.Graph()
    for n in range(nodes):
        prefix = f"n{n}."
        graph.add_edges_from(
            (prefix + u, v if v == FABRIC else prefix + v, _attrs(links[kind])) for u, v, kind in template)
    return graph


def _attrs(link: Link) -> dict:
    return {"bandwidth": link.bandwidth, "latency": link.latency, "kind": link.kind}


def _seconds_per_byte(u, v, data) -> float:
    return 1.0 / data["bandwidth"]


def _hops(path: tuple[str, ...]) -> zip:
    """The directed edges of a path: each direction of a link is loaded separately."""
    return zip(path, path[1:])


class NodeModel:
    """Routes and group links on the one-node template graph; memoised per member tuple."""

    def __init__(self, layout: NodeLayout, links: dict[str, Link], gpus: int):
        self.gpus = gpus
        self.nics = layout.nics
        self.graph = nx.Graph()
        self.graph.add_edges_from((u, v, _attrs(links[kind])) for u, v, kind in node_edges(layout, gpus))
        self._inside = self.graph.subgraph(n for n in self.graph if n != FABRIC)
        self.route = functools.cache(self._route)
        self.nic_path = functools.cache(self._nic_path)
        self.intra = functools.cache(self._intra)
        self.inter = functools.cache(self._inter)

    def _route(self, a: int, b: int) -> tuple[str, ...]:
        """GPU a to GPU b inside the node over the widest links, as NCCL prefers NVLink to PCIe."""
        return tuple(nx.shortest_path(self._inside, f"gpu{a}", f"gpu{b}", weight=_seconds_per_byte))

    def _nic_path(self, a: int) -> tuple[str, ...]:
        """GPU a to the fabric through its NIC: the nearest one, ties going to the NIC whose index
        matches the GPU's position (GPU i <-> NIC i on DGX), as NCCL spreads GPUs over NICs."""
        lengths, paths = nx.single_source_dijkstra(self._inside, f"gpu{a}", weight=_seconds_per_byte)
        nic = min(range(self.nics), key=lambda j: (lengths[f"nic{j}"], abs(j - a * self.nics / self.gpus)))
        return (*paths[f"nic{nic}"], FABRIC)

    def _latency(self, path: tuple[str, ...]) -> float:
        return sum(self.graph.edges[edge]["latency"] for edge in _hops(path))

    def _share(self, path: tuple[str, ...], load: Counter) -> tuple[float, str]:
        """The rate one flow on `path` gets when each directed edge is split among `load` flows."""
        edges = self.graph.edges
        return min((edges[edge]["bandwidth"] / load[edge], edges[edge]["kind"]) for edge in _hops(path))

    def _intra(self, members: tuple[int, ...]) -> Link:
        """A ring over the node's members (local indices, rank order)."""
        hops = [self.route(a, b) for a, b in zip(members, members[1:] + members[:1])]
        load = Counter(edge for path in hops for edge in _hops(path))
        bandwidth, kind = min(self._share(path, load) for path in hops)
        return Link(bandwidth, max(map(self._latency, hops)), kind)

    def _inter(self, members: tuple[int, ...]) -> Link:
        """What the node pushes to the fabric: one channel per member through its NIC. A hop to
        the next node crosses this path out and the same path in on the other side."""
        paths = [self.nic_path(m) for m in members]
        load = Counter(edge for path in paths for edge in _hops(path))
        shares = [self._share(path, load) for path in paths]
        return Link(sum(rate for rate, _ in shares), 2 * max(map(self._latency, paths)), min(shares)[1])

    def p2p(self, a: int, stride: int) -> Link:
        """One flow from local GPU a to the GPU `stride` ranks later (maybe on another node)."""
        b = a + stride
        paths = [self.route(a, b)] if b < self.gpus else [self.nic_path(a), self.nic_path(b % self.gpus)]
        rate, kind = min(self._share(path, Counter(_hops(path))) for path in paths)
        return Link(rate, sum(map(self._latency, paths)), kind)


@functools.lru_cache(maxsize=64)
def node_model(layout: NodeLayout, links: tuple[tuple[str, Link], ...], gpus: int) -> NodeModel:
    """Shared by every cluster with this hardware, whatever its node count."""
    return NodeModel(layout, dict(links), gpus)


@functools.lru_cache(maxsize=1 << 16)
def ring_link(model: NodeModel, ranks: int, size: int, stride: int) -> Link:
    """The worst ring among the groups {b, b+stride, ..., b+(size-1)*stride} of an axis."""
    if size == 1:
        return NO_LINK
    worst = None
    for offset in _group_offsets(model.gpus, ranks, size, stride):
        link = _group_link(model, offset, size, stride)
        if worst is None or (link.bandwidth, -link.latency) < (worst.bandwidth, -worst.latency):
            worst = link
    return worst


@functools.lru_cache(maxsize=1 << 12)
def p2p_link(model: NodeModel, ranks: int, stride: int) -> Link:
    """The worst point-to-point link between rank r and r + stride over all r."""
    return min((model.p2p(a, stride) for a in range(min(model.gpus, ranks - stride))),
               key=lambda link: (link.bandwidth, -link.latency))


def _group_offsets(gpus: int, ranks: int, size: int, stride: int) -> set[int]:
    """Distinct in-node offsets (base rank mod gpus per node) of an axis's groups that fit.

    Groups start at q*size*stride + r (r < stride), as in a device mesh. The offset repeats
    after gpus/gcd(size*stride, gpus) values of q and after `gpus` values of r, and the
    smallest base with an offset is the one that fits if any does.
    """
    span = (size - 1) * stride
    period = gpus // math.gcd(size * stride, gpus)
    return {b % gpus for q in range(period) for r in range(min(stride, gpus))
            if (b := q * size * stride + r) + span < ranks}


def _group_link(model: NodeModel, offset: int, size: int, stride: int) -> Link:
    """The link of the group starting at local GPU `offset` of node 0."""
    last = offset + (size - 1) * stride
    per_node = _members_per_node(model.gpus, offset, last, stride)
    links = [model.intra(members) for members in per_node if len(members) > 1]
    if last >= model.gpus:  # spans nodes
        links += [model.inter(members) for members in per_node]
    bandwidth, kind = min((link.bandwidth, link.kind) for link in links)
    return Link(bandwidth, max(link.latency for link in links), kind)


def _members_per_node(gpus: int, first: int, last: int, stride: int) -> set[tuple[int, ...]]:
    """The distinct tuples of local indices the ranks first, first+stride, ..., last hold per node.

    With stride >= gpus each node holds one member, whose local index repeats after gpus
    members. Otherwise a node's tuple depends on where its first member falls, which repeats
    after stride/gcd(gpus, stride) nodes; only the first and last node can be cut short.
    """
    if stride >= gpus:
        count = (last - first) // stride + 1
        return {((first + j * stride) % gpus,) for j in range(min(count, gpus))}
    last_node = last // gpus
    period = stride // math.gcd(gpus, stride)
    nodes = {0, last_node, *range(1, min(last_node, period + 1))}
    tuples = set()
    for n in nodes:
        lo, hi = max(n * gpus, first), min((n + 1) * gpus - 1, last)
        start = first + -(-(lo - first) // stride) * stride
        tuples.add(tuple(m - n * gpus for m in range(start, hi + 1, stride)))
    return tuples
