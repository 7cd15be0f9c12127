"""The Cluster: what hardware the planner plans for, and the link any process group gets on it."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import networkx as nx

from autopar.cluster.gpus import GPUSpec
from autopar.cluster.graph import cluster_graph, node_model, p2p_link, ring_link
from autopar.cluster.hardware import Link, NodeLayout
from autopar.errors import ClusterError

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Cluster:
    """`nodes` identical nodes of `gpus_per_node` GPUs; global rank = node * gpus_per_node + local index.

    `links` holds the rate of one physical edge per kind (one-way bytes/s, seconds per edge);
    group rates are derived from them on the graph. `coefficients` is opaque here: the cost
    model's calibrated coefficients, carried in the cluster JSON.
    """

    name: str
    gpu: GPUSpec
    nodes: int
    gpus_per_node: int
    node: NodeLayout
    links: dict[str, Link] = field(hash=False)
    coefficients: dict = field(default_factory=dict, hash=False)

    def __post_init__(self):
        for key in ("nodes", "gpus_per_node"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ClusterError(f"{key} must be a positive integer, got {value!r}")
        if self.nodes > 1 and not self.node.nics:
            raise ClusterError(f"{self.nodes} nodes but node.nics is 0: nodes need a NIC to talk; set node.nics")
        needed, given = self.node.kinds(), set(self.links)
        if missing := sorted(needed - given):
            raise ClusterError(f"links.{missing[0]} is missing: this node layout has {missing[0]} edges; "
                               f"give links.{missing[0]} {{\"bandwidth\": ..., \"latency\": ...}}")
        if unused := sorted(given - needed):
            raise ClusterError(f"links.{unused[0]} is given but this node layout has no {unused[0]} edges; remove it")
        for kind, link in self.links.items():
            if link.kind != kind:
                raise ClusterError(f"links.{kind} has kind {link.kind!r}; it must be {kind!r}")

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @cached_property
    def graph(self) -> nx.Graph:
        """Every device and link of the cluster (built on first use: 16k GPUs take a moment)."""
        return cluster_graph(self.node, self.links, self.nodes, self.gpus_per_node)

    def _model(self):
        return node_model(self.node, tuple(sorted(self.links.items())), self.gpus_per_node)

    def ring(self, size: int, stride: int) -> Link:
        """The worst ring (one-way bytes/s per GPU) among the groups of `size` ranks spaced
        `stride` apart, i.e. the process groups of one device-mesh axis."""
        if size < 1 or stride < 1 or (size - 1) * stride >= self.num_gpus:
            raise ValueError(f"no group of {size} ranks {stride} apart fits in {self.num_gpus} GPUs")
        return ring_link(self._model(), self.num_gpus, size, stride)

    def p2p(self, stride: int) -> Link:
        """The worst point-to-point link between rank r and r + stride (pipeline neighbours)."""
        if not 1 <= stride < self.num_gpus:
            raise ValueError(f"stride {stride} must be in [1, {self.num_gpus})")
        return p2p_link(self._model(), self.num_gpus, stride)

    def with_nodes(self, nodes: int, gpus_per_node: int | None = None) -> Cluster:
        """The same hardware at another size."""
        return dataclasses.replace(
            self, nodes=nodes, gpus_per_node=self.gpus_per_node if gpus_per_node is None else gpus_per_node)

    def to_dict(self) -> dict:
        return {
            "schema_version": SCHEMA_VERSION,
            "name": self.name,
            "gpu": self.gpu.to_dict(),
            "nodes": self.nodes,
            "gpus_per_node": self.gpus_per_node,
            "node": dataclasses.asdict(self.node),
            "links": {kind: {"bandwidth": link.bandwidth, "latency": link.latency}
                      for kind, link in self.links.items()},
            "coefficients": self.coefficients,
        }

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def describe(self) -> str:
        gpu = self.gpu
        text = (f"{self.name}: {self.nodes} x {self.gpus_per_node} {gpu.name} "
                f"({gpu.memory_bytes / 1e9:.3g} GB = {gpu.memory_bytes / 2**30:.4g} GiB, "
                f"{gpu.peak_flops['bf16'] / 1e12:.3g} TFLOP/s bf16)")
        if self.gpus_per_node > 1:
            node_ring = self.ring(self.gpus_per_node, 1)
            text += f"; node ring {_gb(node_ring.bandwidth)} over {node_ring.kind}"
        if self.node.nics:
            nic = self.links[self.node.nic_kind]
            text += f"; {self.node.nics} x {_gb(nic.bandwidth)} {self.node.nic_kind} NICs per node"
        return text


def _gb(bandwidth: float) -> str:
    return f"{bandwidth / 1e9:.3g} GB/s"
