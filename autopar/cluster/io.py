"""Cluster JSON: reading, validating, and `load_cluster` (a preset name or a file).

A cluster JSON is either complete (what `Cluster.to_json` writes) or a preset plus overrides,
merged key by key, e.g. {"preset": "dgx-a100-80g", "nodes": 16, "links": {"ib": {"bandwidth": 12.5e9}}}.
Calibration writes `coefficients` and per-kind `links` (rate and latency of one edge of that
kind, bandwidth in one-way bytes/s) into such a file. Every problem is a one-line ClusterError
that names the key.
"""

from __future__ import annotations

from pathlib import Path

from autopar.cluster.gpus import DTYPES, GPUS, OPTIONAL_DTYPES, GPUSpec
from autopar.cluster.hardware import LINK_KINDS, Link, NodeLayout
from autopar.cluster.measured import measurement
from autopar.cluster.presets import PRESETS, preset_names
from autopar.cluster.topology import SCHEMA_VERSION, Cluster
from autopar.errors import ClusterError
from autopar.schema import MAX_GPUS, Anything, Int, Map, Num, check, check_gpus, loads, read_file

_REQUIRED = ("name", "gpu", "gpus_per_node", "node", "links")
_OPTIONAL = ("schema_version", "preset", "nodes", "coefficients")
_GPU_KEYS = ("name", "peak_flops", "memory_bytes", "hbm_bytes_per_s")
_GPU_OPTIONAL = ("sms",)
_NODE_KEYS = ("intra", "sockets", "gpus_per_pcie_switch", "nics", "nic_attach", "nic_kind")
_LINK_KEYS = ("bandwidth", "latency")


def load_cluster(spec: str, nodes: int | None = None, gpus_per_node: int | None = None) -> Cluster:
    """A preset by name, or a cluster JSON file by path; `nodes` / `gpus_per_node` resize it. The `cpu`
    preset takes this machine's figures when `autopar profile-cluster` has measured them (cluster/measured.py)."""
    if spec in PRESETS:
        measured = measurement() if spec == "cpu" else None
        cluster = cluster_from_dict({"preset": spec, **(measured or {})}, f"preset {spec!r}")
    else:
        cluster = cluster_from_dict(_read_json(spec), spec)
    if nodes is not None or gpus_per_node is not None:
        cluster = cluster.with_nodes(cluster.nodes if nodes is None else nodes, gpus_per_node)
    check_gpus(cluster.nodes, cluster.gpus_per_node, f"cluster {spec!r}")
    return cluster


def spec_identity(spec: str) -> str:
    """A --cluster as a plan file records it and compares it: a preset as named, a file by its absolute path."""
    return str(Path(spec).resolve()) if Path(spec).is_file() else spec


def _read_json(path: str) -> object:
    file = Path(path)
    if not file.is_file():
        if file.suffix == ".json" or "/" in path:
            raise ClusterError(f"cluster file {path!r} not found; give an existing .json path or a preset name")
        raise ClusterError(f"unknown cluster {path!r}: use a preset ({', '.join(preset_names())}) "
                           "or the path of a cluster .json file")
    return loads(read_file(path, "cluster file", ClusterError), path, ClusterError)


def cluster_from_dict(d: object, source: str = "cluster JSON") -> Cluster:
    """Validate a cluster document and build the Cluster; errors name `source` and the key."""
    try:
        return _cluster(d)
    except ClusterError as e:
        raise ClusterError(f"{source}: {e}") from None


def _cluster(d: object) -> Cluster:
    check(d, Anything(), "the cluster document", ClusterError)  # depth and sizes, before any recursion
    d = _object(d, "the cluster document")
    if "groups" in d:  # autopar/cluster/mixed.py reads those, where a command plans for several GPU types
        raise ClusterError("groups: this is a mixed cluster of several GPU groups, which is not taken here; give one "
                           "preset or a cluster JSON without groups")
    given_links = _object(d.get("links", {}), "links")
    if "preset" in d:
        d = _merge(_preset(d["preset"]), {k: v for k, v in d.items() if k != "preset"})
    elif "name" not in d and set(d) <= set(_OPTIONAL):  # e.g. {"nodes": 2}: a preset's overrides alone
        raise ClusterError(f"no preset and no cluster of its own: add \"preset\": one of {', '.join(preset_names())} "
                           f"(its keys then override the preset's), or give every key of a cluster: "
                           f"{', '.join(_REQUIRED)}")
    _check_keys(d, "", _REQUIRED, _OPTIONAL)
    version = d.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise ClusterError(f"schema_version is {version!r}; this autopar reads version {SCHEMA_VERSION}")
    if not isinstance(d["name"], str) or not d["name"]:
        raise ClusterError(f"name must be a non-empty string, got {d['name']!r}")
    node = _node(d["node"])
    # A preset's rates for links that an overridden layout no longer has are dropped, not errors.
    links = {kind: link for kind, link in _links(d["links"]).items() if kind in node.kinds() or kind in given_links}
    return Cluster(
        name=d["name"],
        gpu=_gpu(d["gpu"]),
        nodes=_count(d.get("nodes", 1), "nodes", 1),
        gpus_per_node=_count(d["gpus_per_node"], "gpus_per_node", 1),
        node=node,
        links=links,
        # the cost model's; opaque here, its values are checked by autopar/cost/coefficients.py
        coefficients=check(d.get("coefficients", {}), Map(Anything()), "coefficients", ClusterError),
    )


def _preset(name: object) -> dict:
    """A preset's document with its GPU written out, so that overrides can change one figure."""
    if not isinstance(name, str) or name not in PRESETS:
        raise ClusterError(f"preset is {name!r}; use one of {', '.join(preset_names())}")
    preset = PRESETS[name]
    return {**preset, "name": name, "gpu": GPUS[preset["gpu"]].to_dict()}


def _merge(base: dict, override: dict) -> dict:
    merged = dict(base)
    for key, value in override.items():
        both_dicts = isinstance(value, dict) and isinstance(base.get(key), dict)
        merged[key] = _merge(base[key], value) if both_dicts else value
    return merged


def _gpu(value: object) -> GPUSpec:
    if isinstance(value, str):
        if value not in GPUS:
            raise ClusterError(f"gpu is {value!r}; use one of {', '.join(GPUS)} "
                               f"or an inline spec with {', '.join(_GPU_KEYS)}")
        return GPUS[value]
    d = _object(value, "gpu")
    _check_keys(d, "gpu", _GPU_KEYS, _GPU_OPTIONAL)
    flops = _object(d["peak_flops"], "gpu.peak_flops")
    _check_keys(flops, "gpu.peak_flops", DTYPES, OPTIONAL_DTYPES)
    if not isinstance(d["name"], str) or not d["name"]:
        raise ClusterError(f"gpu.name must be a non-empty string, got {d['name']!r}")
    return GPUSpec(
        name=d["name"],
        peak_flops={dtype: _number(flops[dtype], f"gpu.peak_flops.{dtype}") for dtype in DTYPES + OPTIONAL_DTYPES
                    if dtype in flops},
        memory_bytes=_number(d["memory_bytes"], "gpu.memory_bytes"),
        hbm_bytes_per_s=_number(d["hbm_bytes_per_s"], "gpu.hbm_bytes_per_s"),
        sms=_count(d.get("sms", 0), "gpu.sms", 0),
    )


def _node(value: object) -> NodeLayout:
    if isinstance(value, int) and not isinstance(value, bool):
        raise ClusterError(f"node is the layout of one node (an object with {', '.join(_NODE_KEYS)}), got {value}; "
                           f"the number of nodes is \"nodes\"")
    d = _object(value, "node")
    _check_keys(d, "node", _NODE_KEYS)
    return NodeLayout(
        intra=d["intra"],
        sockets=_count(d["sockets"], "node.sockets", 1),
        gpus_per_pcie_switch=_count(d["gpus_per_pcie_switch"], "node.gpus_per_pcie_switch", 0),
        nics=_count(d["nics"], "node.nics", 0),
        nic_attach=d["nic_attach"],
        nic_kind=d["nic_kind"],
    )


def _links(value: object) -> dict[str, Link]:
    d = _object(value, "links")
    _check_keys(d, "links", (), LINK_KINDS)
    links = {}
    for kind, rate in d.items():
        rate = _object(rate, f"links.{kind}")
        _check_keys(rate, f"links.{kind}", _LINK_KEYS)
        links[kind] = Link(_number(rate["bandwidth"], f"links.{kind}.bandwidth"),
                           _number(rate["latency"], f"links.{kind}.latency", allow_zero=True), kind)
    return links


def _object(value: object, where: str) -> dict:
    if not isinstance(value, dict):
        raise ClusterError(f"{where} must be a JSON object, got {type(value).__name__}")
    return value


def _check_keys(d: dict, where: str, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    prefix = f"{where}." if where else ""
    for key in d:
        if key not in required and key not in optional:
            raise ClusterError(f"unknown key {prefix}{key}; valid keys here: {', '.join(required + optional)}")
    for key in required:
        if key not in d:
            raise ClusterError(f"missing key {prefix}{key}")


def _number(value: object, where: str, allow_zero: bool = False) -> float:
    return check(value, Num(open_lo=not allow_zero), where, ClusterError)


def _count(value: object, where: str, minimum: int) -> int:
    return check(value, Int(minimum, MAX_GPUS), where, ClusterError)
