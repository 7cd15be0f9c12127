"""Mixed clusters: several homogeneous groups of different GPUs, joined by one inter-group link.

A `MixedCluster` composes homogeneous `Cluster`s (each with its own GPU, node layout, links and
calibrated `coefficients`), so everything that prices one group is today's code on that group's
hardware. It is written `PRESET:NODES,PRESET:NODES[,...]` on the command line (a part may also
name a homogeneous cluster JSON file, e.g. a calibrated one) or as a cluster JSON with `groups`:

  {"schema_version": 1, "name": "lab", "groups": [{"name": "a100", "preset": "dgx-a100-80g", "nodes": 2},
   {"preset": "dgx-h100", "nodes": 2, "links": {"ib": {"bandwidth": 25e9}}}],
   "link": {"bandwidth": 25e9, "latency": 1.1e-5, "kind": "ib"}}

Each group is any cluster document (a preset plus overrides, or complete) whose `name` labels the
group; `link` (optional, and any of its keys) defaults to `default_link`. Data only: nothing in a
document runs code, and every problem is one ClusterError line naming the key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import networkx as nx

from autopar import capability
from autopar.cluster.graph import FABRIC, node_model
from autopar.cluster.hardware import NIC_KINDS, Link
from autopar.cluster.io import _check_keys, _number, _object, _read_json, cluster_from_dict, load_cluster
from autopar.cluster.topology import SCHEMA_VERSION, Cluster
from autopar.errors import AutoparError, ClusterError, PlanError
from autopar.schema import MAX_GPUS, Anything, check, check_gpus

MAX_GROUPS = 16  # groups of one mixed cluster: the mixed searches enumerate placements over them
SPEC_FORM = "PRESET:NODES,PRESET:NODES (e.g. dgx-a100-80g:2,dgx-h100:2)"
RESIZE_REFUSED = ("--nodes/--gpus-per-node cannot resize a mixed cluster; give each group's nodes in "
                  "--cluster A:N,B:M")
_GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._#+-]*")  # no '/' (graph labels), ',' or ':' (the spec)
_LINK_KEYS = ("bandwidth", "latency", "kind")


@dataclass(frozen=True)
class MixedCluster:
    """Groups of homogeneous hardware planned as one job. `link`: what a GPU of one group gets to a
    GPU of another (one-way bytes/s per GPU, seconds per hop, kind ib|ethernet)."""

    name: str
    groups: tuple[Cluster, ...]
    group_names: tuple[str, ...]
    link: Link

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ClusterError(f"a mixed cluster's name must be a non-empty string, got {self.name!r}")
        if not 2 <= len(self.groups) <= MAX_GROUPS:
            raise ClusterError(f"a mixed cluster has 2 to {MAX_GROUPS} groups, got {len(self.groups)}; "
                               f"write {SPEC_FORM}")
        if len(self.group_names) != len(self.groups):
            raise ClusterError(f"{len(self.groups)} groups but {len(self.group_names)} group names")
        seen = set()
        for name, group in zip(self.group_names, self.groups):
            if not isinstance(name, str) or not _GROUP_NAME.fullmatch(name):
                raise ClusterError(f"group name {name!r} must be letters, digits and . _ # + - (no '/', ',' or ':')")
            if name in seen:
                raise ClusterError(f"group name {name!r} is used twice; give each group its own name")
            seen.add(name)
            _check_nics(name, group)
        if self.num_gpus > MAX_GPUS:
            raise ClusterError(f"the mixed cluster has {self.num_gpus} GPUs; autopar plans for at most {MAX_GPUS}")
        if self.link.kind not in NIC_KINDS:
            raise ClusterError(f"link.kind is {self.link.kind!r}; use one of {', '.join(NIC_KINDS)}")
        if not self.link.bandwidth > 0 or not self.link.latency >= 0:
            raise ClusterError("link.bandwidth must be > 0 and link.latency >= 0")

    @property
    def num_gpus(self) -> int:
        return sum(group.num_gpus for group in self.groups)

    def index(self, name: str) -> int:
        """The position of the group labelled `name`."""
        if name not in self.group_names:
            raise ClusterError(f"unknown group {name!r}; this cluster's groups are {', '.join(self.group_names)}")
        return self.group_names.index(name)

    def group(self, key: str | int) -> Cluster:
        """A group by label or position."""
        if isinstance(key, int) and not isinstance(key, bool):
            if not 0 <= key < len(self.groups):
                raise ClusterError(f"group {key} is out of range: this cluster has {len(self.groups)} groups")
            return self.groups[key]
        return self.groups[self.index(key)]

    @cached_property
    def graph(self) -> nx.Graph:
        """Every group's devices and links (labels prefixed "<group>/"), and the inter-group fabric:
        a node "fabric" joined to every NIC of every group at the link's rate (a NIC's share of its
        node's GPUs x the per-GPU rate, so each GPU gets `link.bandwidth`; half the hop latency per
        edge), beside each group's own fabric "<group>/fabric"."""
        graph = nx.Graph()
        link = self.link
        for name, group in zip(self.group_names, self.groups):
            graph.update(nx.relabel_nodes(group.graph, lambda node, g=name: f"{g}/{node}"))
            per_nic = link.bandwidth * group.gpus_per_node / group.node.nics
            graph.add_edges_from(((f"{name}/n{n}.nic{j}", FABRIC) for n in range(group.nodes)
                                  for j in range(group.node.nics)),
                                 bandwidth=per_nic, latency=link.latency / 2, kind=link.kind)
        return graph

    # -- what each group's GPU can run: the capability declaration applied group by group ----------------
    def target(self, group: str | int, runtime: str = "torch", layout: capability.Layout | None = None
               ) -> capability.Target:
        """The capability target of one group: its hardware under `runtime`, for the model `layout`."""
        return capability.Target(runtime=runtime, layout=layout, cluster=self.group(group))

    def refusals(self, plan, groups=None, runtime: str = "torch", layout: capability.Layout | None = None
                 ) -> list[str]:
        """Why `plan` (a homogeneous Plan: a lane's knobs) cannot run on each of `groups` (default all),
        every reason naming its group and GPU."""
        out = []
        for name in self.group_names if groups is None else groups:
            group = self.group(name)
            out += [f"group {name} ({group.gpu.name}): {why}"
                    for why in capability.refusals(plan, self.target(name, runtime, layout))]
        return out

    def check(self, plan, groups=None, runtime: str = "torch", layout: capability.Layout | None = None) -> None:
        """PlanError with the first reason `plan` cannot run on one of `groups`."""
        reasons = self.refusals(plan, groups, runtime, layout)
        if reasons:
            raise PlanError(reasons[0])

    def precision_problem(self, precision: str, recipe: str | None = None, groups=None) -> str | None:
        """Why a run in `precision` cannot use every one of `groups` (default all): one line naming
        the first group whose GPU cannot (fp8 through the fp8_recipe rule, with `recipe` or
        tensorwise, the recipe every fp8 GPU runs), or None."""
        if precision != "fp8":
            return None
        for name in self.group_names if groups is None else groups:
            group = self.group(name)
            why = capability.refusal("fp8_recipe", self.target(name), recipe or "tensorwise")
            if why:
                return f"group {name} ({group.gpu.name}): {why}"
        return None

    def default_precision(self) -> str:
        """The precision a mixed run trains in when none is asked for: the first of bf16 and fp16 that
        every group's GPU runs faster than fp32 (A100 with V100: fp16), else fp32; each group alone
        would take `autopar.knobs.default_precision` of its GPU."""
        rates = [group.gpu.peak_flops for group in self.groups]
        return next((p for p in ("bf16", "fp16") if all(r.get(p, 0.0) > r["fp32"] for r in rates)), "fp32")

    def to_dict(self) -> dict:
        """The cluster JSON with groups; each group complete, with its own calibrated coefficients."""
        groups = []
        for name, group in zip(self.group_names, self.groups):
            d = group.to_dict()
            d.pop("schema_version")
            groups.append({**d, "name": name})
        return {"schema_version": SCHEMA_VERSION, "name": self.name, "groups": groups,
                "link": {"bandwidth": self.link.bandwidth, "latency": self.link.latency, "kind": self.link.kind}}

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def describe(self) -> str:
        """One line for the whole, then one per group."""
        head = (f"{self.name}: {self.num_gpus} GPUs in {len(self.groups)} groups, linked at "
                f"{self.link.bandwidth / 1e9:.3g} GB/s per GPU over {self.link.kind}")
        return "\n".join([head, *(f"  {group.describe()}" for group in self.groups)])  # a group's name is its label


def _check_nics(name: str, group: Cluster) -> None:
    if not group.node.nics:
        raise ClusterError(f"group {name} has no NIC (node.nics 0): a group of a mixed cluster reaches the others "
                           "through its NICs; set node.nics")


def mixed_cluster(groups: list[Cluster] | tuple[Cluster, ...], names: list[str] | tuple[str, ...] | None = None,
                  link: Link | None = None, name: str | None = None) -> MixedCluster:
    """A MixedCluster from its groups: labels default to the groups' names ("name#2" for a repeat),
    the link to `default_link`, the name to the spec that would build it."""
    names = tuple(names) if names is not None else unique_names([group.name for group in groups])
    groups = tuple(replace(group, name=label) for group, label in zip(groups, names))
    if name is None:
        name = ",".join(f"{label}:{group.nodes}" for label, group in zip(names, groups))
    if link is None:
        for label, group in zip(names, groups):
            _check_nics(label, group)
        link = default_link(groups)
    return MixedCluster(name, groups, names, link)


def unique_names(names: list[str]) -> tuple[str, ...]:
    """Labels for groups: each name, the k-th repeat of a name as "name#k"."""
    out, counts = [], {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
        label = name if counts[name] == 1 else f"{name}#{counts[name]}"
        while label in out or (label != name and label in names):  # a given "name#2" already taken
            counts[name] += 1
            label = f"{name}#{counts[name]}"
        out.append(label)
    return tuple(out)


def nic_rate(group: Cluster) -> float:
    """One-way bytes/s each GPU of the group gets from its node's NICs when all push at once."""
    return group.node.nics * group.links[group.node.nic_kind].bandwidth / group.gpus_per_node


def nic_hop_latency(group: Cluster) -> float:
    """Seconds of a GPU-to-GPU hop between two of the group's nodes, as its own cross-node p2p pays
    (out through the slowest GPU -> NIC -> fabric path and in again): what a hop into it pays."""
    model = node_model(group.node, tuple(sorted(group.links.items())), group.gpus_per_node)
    edges = model.graph.edges

    def seconds(path):
        return sum(edges[u, v]["latency"] for u, v in zip(path, path[1:]))

    return 2 * max(seconds(model.nic_path(a)) for a in range(group.gpus_per_node))


def default_link(groups) -> Link:
    """The inter-group link when none is given: each group's own NICs. A GPU sending to another group
    gets the slower group's per-GPU NIC rate (nics x per-NIC bandwidth / gpus_per_node) over that
    group's NIC kind, and a hop pays the larger of the groups' cross-node hop latencies."""
    slowest = min(groups, key=nic_rate)
    return Link(nic_rate(slowest), max(nic_hop_latency(group) for group in groups), slowest.node.nic_kind)


def parse_mixed_spec(spec: str) -> MixedCluster | None:
    """`PRESET:NODES,PRESET:NODES[,...]` (a part may name a homogeneous cluster JSON file instead of a
    preset, and leave out `:NODES` for the preset's or file's own); None when `spec` is not of that form
    (no comma, or an existing file). A malformed part is one ClusterError line."""
    if not isinstance(spec, str) or "," not in spec or Path(spec).is_file():
        return None
    groups = [_spec_group(part.strip(), spec) for part in spec.split(",")]
    if len(groups) > MAX_GROUPS:
        raise ClusterError(f"--cluster {spec!r} has {len(groups)} groups; a mixed cluster has at most {MAX_GROUPS}")
    mixed = mixed_cluster(groups)
    return replace(mixed, name=",".join(part.strip() for part in spec.split(",")))


def _spec_group(part: str, spec: str) -> Cluster:
    if not part:
        raise ClusterError(f"--cluster {spec!r} has an empty group; write {SPEC_FORM}")
    name, sep, count = part.rpartition(":") if ":" in part else (part, "", "")
    if sep and not (count.isdigit() and int(count) >= 1):
        raise ClusterError(f"--cluster {spec!r}: nodes {count!r} of {name!r} must be a positive integer; "
                           f"write {SPEC_FORM}")
    if not name:
        raise ClusterError(f"--cluster {spec!r}: {part!r} names no preset; write {SPEC_FORM}")
    try:
        return load_cluster(name, nodes=int(count) if sep else None)
    except AutoparError as e:
        raise ClusterError(f"--cluster {spec!r}: {e}") from None


def single_spec(spec: str) -> tuple[str, int] | None:
    """`PRESET:NODES` of one group (a homogeneous cluster): (preset, nodes), or None if not that form."""
    if not isinstance(spec, str) or "," in spec or ":" not in spec or Path(spec).is_file():
        return None
    name, _, count = spec.rpartition(":")
    if not (count.isdigit() and int(count) >= 1):
        raise ClusterError(f"--cluster {spec!r}: nodes {count!r} must be a positive integer; write PRESET:NODES "
                           f"or {SPEC_FORM}")
    return name, int(count)


def load_any_cluster(spec: str, nodes: int | None = None, gpus_per_node: int | None = None) -> Cluster | MixedCluster:
    """What `--cluster` names: a preset or cluster JSON (a Cluster, as `load_cluster`), `PRESET:NODES`
    (a Cluster of that size), or a mixed spec / a cluster JSON with `groups` (a MixedCluster, which
    `nodes` / `gpus_per_node` cannot resize: each group's nodes are in the spec)."""
    mixed = parse_mixed_spec(spec)
    if mixed is None and Path(spec).is_file() and Path(spec).suffix == ".json":
        document = _read_json(spec)
        if isinstance(document, dict) and "groups" in document:
            mixed = mixed_from_dict(document, spec)
    if mixed is not None:
        if nodes is not None or gpus_per_node is not None:
            raise ClusterError(RESIZE_REFUSED)
        return mixed
    single = single_spec(spec)
    if single is not None:
        if nodes is not None:
            raise ClusterError(f"--cluster {spec!r} gives the nodes and so does --nodes {nodes}; give them once")
        return load_cluster(single[0], nodes=single[1], gpus_per_node=gpus_per_node)
    return load_cluster(spec, nodes=nodes, gpus_per_node=gpus_per_node)


def mixed_from_dict(d: object, source: str = "cluster JSON") -> MixedCluster:
    """Validate a cluster document with groups and build the MixedCluster; errors name `source` and the key."""
    try:
        return _mixed(d, source)
    except AutoparError as e:
        message = str(e)
        raise ClusterError(message if message.startswith(f"{source}: ") else f"{source}: {message}") from None


def _mixed(d: object, source: str) -> MixedCluster:
    check(d, Anything(), "the cluster document", ClusterError)  # depth and sizes, before any recursion
    d = _object(d, "the cluster document")
    _check_keys(d, "", ("groups",), ("schema_version", "name", "link"))
    version = d.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ClusterError(f"schema_version is {version!r}; this autopar reads version {SCHEMA_VERSION}")
    entries = d["groups"]
    if not isinstance(entries, list) or not 2 <= len(entries) <= MAX_GROUPS:
        raise ClusterError(f"groups must be a list of 2 to {MAX_GROUPS} cluster documents, got "
                           f"{len(entries) if isinstance(entries, list) else type(entries).__name__}")
    groups, given = [], []
    for i, entry in enumerate(entries):
        entry = _object(entry, f"groups[{i}]")
        if "groups" in entry:
            raise ClusterError(f"groups[{i}] has groups of its own; a group is one homogeneous cluster")
        label = entry.get("name", entry.get("preset"))
        group = cluster_from_dict({**entry, "name": label} if "name" not in entry and label else entry,
                                  f"{source}: groups[{i}]")
        check_gpus(group.nodes, group.gpus_per_node, f"groups[{i}]")  # as load_cluster bounds one cluster
        groups.append(group)
        given.append("name" in entry)
    names = unique_names([group.name for group in groups])
    for i, (label, group) in enumerate(zip(names, groups)):
        if given[i] and label != group.name:
            first = next(j for j in range(i) if groups[j].name == group.name)
            raise ClusterError(f"groups[{i}].name {group.name!r} is groups[{first}]'s too; give each group its own name")
    name = d.get("name")
    if name is not None and (not isinstance(name, str) or not name):
        raise ClusterError(f"name must be a non-empty string, got {name!r}")
    for label, group in zip(names, groups):
        _check_nics(label, group)
    link = default_link(groups)
    if "link" in d:
        link = _link(d["link"], link)
    return mixed_cluster(groups, names, link, name)


def _link(value: object, default: Link) -> Link:
    """`link`, any key left out taken from the default (each group's own NICs)."""
    d = _object(value, "link")
    _check_keys(d, "link", (), _LINK_KEYS)
    kind = d.get("kind", default.kind)
    if kind not in NIC_KINDS:
        raise ClusterError(f"link.kind is {kind!r}; use one of {', '.join(NIC_KINDS)}")
    bandwidth = _number(d["bandwidth"], "link.bandwidth") if "bandwidth" in d else default.bandwidth
    latency = _number(d["latency"], "link.latency", allow_zero=True) if "latency" in d else default.latency
    return Link(bandwidth, latency, kind)
