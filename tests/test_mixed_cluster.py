"""Mixed clusters (issue 42): the PRESET:NODES,PRESET:NODES spec, the cluster JSON with groups, the
inter-group link, the spanning graph, per-group coefficients and capability, and --cluster in the CLI."""

from __future__ import annotations

import json

import networkx as nx
import pytest

from autopar.cli import build_parser, main
from autopar.cli.common import load_workload
from autopar.cluster import load_cluster
from autopar.cluster.hardware import Link
from autopar.cluster.mixed import (RESIZE_REFUSED, MixedCluster, default_link, load_any_cluster, mixed_from_dict,
                                   parse_mixed_spec)
from autopar.cost.coefficients import Coefficients
from autopar.errors import AutoparError, ClusterError, PlanError
from autopar.mixed.workload import MixedWorkload
from autopar.plan import Plan
from autopar.workload import Workload


def test_spec_builds_groups_in_order_with_their_own_hardware():
    mixed = parse_mixed_spec("dgx-a100-80g:2, dgx-h100:1")
    assert isinstance(mixed, MixedCluster)
    assert mixed.name == "dgx-a100-80g:2,dgx-h100:1"
    assert mixed.group_names == ("dgx-a100-80g", "dgx-h100")
    assert [g.nodes for g in mixed.groups] == [2, 1] and mixed.num_gpus == 24
    assert mixed.group("dgx-h100").gpu == load_cluster("dgx-h100").gpu and mixed.group(0).gpu.name.startswith("A100")
    assert mixed.index("dgx-h100") == 1
    # a preset twice: the repeat gets its own label; no ":NODES" takes the preset's own
    twice = parse_mixed_spec("dgx-h100:1,dgx-h100")
    assert twice.group_names == ("dgx-h100", "dgx-h100#2") and twice.groups[1].nodes == 1


def test_not_a_mixed_spec_is_none_and_single_groups_stay_homogeneous(tmp_path):
    assert parse_mixed_spec("dgx-h100") is None and parse_mixed_spec("dgx-h100:4") is None
    path = tmp_path / "a,b.json"  # an existing file, even with a comma in its name, is a file
    load_cluster("dgx-h100").to_json(path)
    assert parse_mixed_spec(str(path)) is None
    assert load_any_cluster(str(path)) == load_cluster(str(path))
    assert load_any_cluster("dgx-h100") == load_cluster("dgx-h100")
    assert load_any_cluster("dgx-h100:4") == load_cluster("dgx-h100", nodes=4)
    assert load_any_cluster("dgx-h100:4", gpus_per_node=4) == load_cluster("dgx-h100", nodes=4, gpus_per_node=4)


@pytest.mark.parametrize("spec, link", [
    # each group's own NICs: the slower group's per-GPU rate (8 x 25 GB/s HDR over 8 GPUs) and kind
    ("dgx-a100-80g:2,dgx-h100:2", Link(25e9, 11e-6, "ib")),
    # 2 x 12.5 GB/s Ethernet over 8 GPUs; the 4090 box's hop (PCIe switch, socket, NIC, fabric, twice) is longer
    ("pcie-4090x8:2,dgx-a100-80g:2", Link(3.125e9, 19e-6, "ethernet")),
])
def test_default_link_is_each_groups_own_nics(spec, link):
    mixed = parse_mixed_spec(spec)
    assert mixed.link.kind == link.kind
    assert mixed.link.bandwidth == pytest.approx(link.bandwidth)
    assert mixed.link.latency == pytest.approx(link.latency)
    assert default_link(tuple(reversed(mixed.groups))) == mixed.link  # the order of the groups does not matter


@pytest.mark.parametrize("spec", ["dgx-a100-80g:2,dgx-h100:2", "pcie-4090x8:2,dgx-a100-80g:1,cpu:1"])
def test_graph_spans_every_gpu_and_joins_groups_at_the_link(spec):
    mixed = parse_mixed_spec(spec)
    graph = mixed.graph
    assert nx.is_connected(graph)
    gpus = [n for n in graph if ".gpu" in n]
    assert len(gpus) == mixed.num_gpus
    for name, group in zip(mixed.group_names, mixed.groups):
        assert sum(n.startswith(f"{name}/") for n in gpus) == group.num_gpus
    # the widest path between two groups' GPUs is held to the link's rate, and crosses the inter-group fabric
    a, b = f"{mixed.group_names[0]}/n0.gpu0", f"{mixed.group_names[1]}/n0.gpu1"
    path = nx.shortest_path(graph, a, b, weight=lambda u, v, d: 1 / d["bandwidth"])
    assert "fabric" in path
    per_node = mixed.groups[0].gpus_per_node / mixed.groups[0].node.nics
    assert min(graph.edges[e]["bandwidth"] for e in zip(path, path[1:])) <= mixed.link.bandwidth * per_node


def test_json_round_trip_keeps_each_groups_coefficients(tmp_path):
    mixed = parse_mixed_spec("dgx-a100-80g:2,dgx-h100:1")
    calibrated = {"link_efficiency": {"nvlink": 0.7, "ib": 0.6}, "gemm_efficiency": 0.55}
    groups = list(mixed.groups)
    groups[1] = type(groups[1])(**{**groups[1].__dict__, "coefficients": calibrated})
    mixed = MixedCluster(mixed.name, tuple(groups), mixed.group_names, Link(12.5e9, 2e-5, "ethernet"))
    path = tmp_path / "mixed.json"
    mixed.to_json(path)
    back = load_any_cluster(str(path))
    assert back == mixed and back.graph.number_of_edges() == mixed.graph.number_of_edges()
    assert json.loads(path.read_text())["groups"][1]["coefficients"] == calibrated
    # the cost model builds each group's coefficients from its own calibration
    assert Coefficients.for_cluster(back.group("dgx-h100")).gemm_efficiency == 0.55
    assert Coefficients.for_cluster(back.group("dgx-a100-80g")).gemm_efficiency != 0.55


def test_json_groups_as_preset_overrides_with_names_and_a_partial_link():
    doc = {"name": "lab", "groups": [{"name": "old", "preset": "dgx-a100-80g", "nodes": 3},
                                     {"preset": "dgx-h100", "links": {"ib": {"bandwidth": 12.5e9}}}],
           "link": {"latency": 3e-5}}
    mixed = mixed_from_dict(doc)
    assert mixed.name == "lab" and mixed.group_names == ("old", "dgx-h100")
    assert mixed.group("old").nodes == 3 and mixed.group("dgx-h100").links["ib"].bandwidth == 12.5e9
    # the H100 nodes' NICs are now the slower: 8 x 12.5 GB/s over 8 GPUs; the given latency kept
    assert mixed.link == Link(12.5e9, 3e-5, "ib")


@pytest.mark.parametrize("doc, words", [
    ({"groups": [{"preset": "dgx-h100"}]}, "groups must be a list of 2 to"),
    ({"groups": [{"preset": "dgx-h100"}, {"preset": "dgx-a100-80g"}], "nodes": 2}, "unknown key nodes"),
    ({"groups": [{"preset": "dgx-h100"}, {"preset": "dgx-a100-80g", "nodez": 2}]}, "groups[1]: unknown key nodez"),
    ({"groups": [{"preset": "dgx-h100"}, {"preset": "nope"}]}, "groups[1]: preset is 'nope'"),
    ({"groups": [{"name": "a", "preset": "dgx-h100"}, {"name": "a", "preset": "dgx-a100-80g"}]},
     "groups[1].name 'a' is groups[0]'s too"),
    ({"groups": [{"preset": "dgx-h100"}, {"preset": "dgx-a100-80g"}], "link": {"kind": "nvlink"}},
     "link.kind is 'nvlink'"),
    ({"groups": [{"preset": "dgx-h100"}, {"preset": "dgx-a100-80g"}], "link": {"bandwidth": -1}},
     "link.bandwidth"),
    ({"groups": [{"name": "a/b", "preset": "dgx-h100"}, {"preset": "dgx-a100-80g"}]}, "group name 'a/b'"),
    ({"groups": [{"preset": "dgx-h100", "node": {"nics": 0}}, {"preset": "dgx-a100-80g"}]}, "has no NIC"),
    ({"groups": [{"preset": "dgx-h100"}, {"preset": "dgx-a100-80g"}], "schema_version": 9}, "schema_version is 9"),
    ({"groups": [{"preset": "dgx-h100", "gpus_per_node": 2000}, {"preset": "dgx-a100-80g"}]},
     "groups[0] has 2000 GPUs per node"),
])
def test_bad_documents_are_one_line_naming_the_key(doc, words):
    with pytest.raises(ClusterError) as e:
        mixed_from_dict(doc, "lab.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("lab.json: ") and words in str(e.value)


@pytest.mark.parametrize("spec, words", [
    ("dgx-h100:0,dgx-a100-80g:1", "nodes '0' of 'dgx-h100' must be a positive integer"),
    ("dgx-h100:x,dgx-a100-80g:1", "nodes 'x'"),
    ("dgx-h100:1,", "empty group"),
    ("dgx-h100:1,nope:2", "unknown cluster 'nope'"),
    ("dgx-h100:1,missing.json:2", "cluster file 'missing.json' not found"),
    (",".join(["dgx-h100:1"] * 17), "at most 16"),
])
def test_bad_specs_are_one_line(spec, words):
    with pytest.raises(ClusterError) as e:
        load_any_cluster(spec)
    assert "\n" not in str(e.value) and words in str(e.value)


def test_a_spec_part_may_be_a_calibrated_cluster_file(tmp_path):
    calibrated = load_cluster("dgx-a100-80g")
    calibrated = type(calibrated)(**{**calibrated.__dict__, "name": "a100-lab", "coefficients": {"gemm_efficiency": 0.5}})
    calibrated.to_json(tmp_path / "a100.json")
    mixed = load_any_cluster(f"{tmp_path / 'a100.json'}:2,dgx-h100:1")
    assert mixed.group_names == ("a100-lab", "dgx-h100")
    assert mixed.group("a100-lab").nodes == 2 and mixed.group("a100-lab").coefficients == {"gemm_efficiency": 0.5}


def test_resizing_a_mixed_cluster_is_refused(tmp_path):
    for kwargs in ({"nodes": 2}, {"gpus_per_node": 4}):
        with pytest.raises(ClusterError, match="^" + RESIZE_REFUSED.replace("/", ".") + "$"):
            load_any_cluster("dgx-a100-80g:1,dgx-h100:1", **kwargs)
    path = tmp_path / "mixed.json"
    parse_mixed_spec("dgx-a100-80g:1,dgx-h100:1").to_json(path)
    with pytest.raises(ClusterError, match="cannot resize a mixed cluster"):
        load_any_cluster(str(path), nodes=2)
    with pytest.raises(ClusterError, match="give them once"):
        load_any_cluster("dgx-h100:2", nodes=4)
    # where one homogeneous cluster is read, a document with groups is one line, not "unknown key"
    with pytest.raises(ClusterError, match=r"mixed.json: groups: this is a mixed cluster of several GPU groups"):
        load_cluster(str(path))


def test_per_group_capability_names_the_group():
    mixed = parse_mixed_spec("dgx-a100-80g:1,dgx-h100:1")
    why = mixed.precision_problem("fp8")
    assert why.startswith("group dgx-a100-80g (A100-SXM4-80GB): precision fp8 needs a GPU with fp8 tensor cores")
    assert mixed.precision_problem("fp8", groups=["dgx-h100"]) is None  # a run on the H100s alone can
    assert mixed.precision_problem("bf16") is None
    fp8 = Plan(dp=8, precision="fp8", fp8_recipe="tensorwise")
    assert mixed.refusals(fp8) == [why]
    with pytest.raises(PlanError, match="^group dgx-a100-80g "):
        mixed.check(fp8)
    mx = Plan(dp=8, precision="fp8", fp8_recipe="mxfp8")
    assert mixed.refusals(mx, groups=["dgx-h100"])[0].startswith(
        "group dgx-h100 (H100-SXM5-80GB): fp8 recipe mxfp8 needs block-scaled")
    assert parse_mixed_spec("dgx-h100:1,dgx-b200:1").precision_problem("fp8") is None
    # the default precision is one every group runs faster than fp32: V100 has no bf16 tensor cores
    assert mixed.default_precision() == "bf16"
    assert parse_mixed_spec("dgx-v100:1,dgx-a100-80g:1").default_precision() == "fp16"


def _args(*flags):
    return build_parser().parse_args(["search", "gpt", "--model-arg", "size=tiny", "--global-batch", "32", *flags])


def test_cli_builds_a_mixed_workload_where_the_command_plans_one():
    mixed = load_workload(_args("--cluster", "dgx-a100-80g:2,dgx-h100:1"), mixed=True)
    assert isinstance(mixed, MixedWorkload) and mixed.cluster == parse_mixed_spec("dgx-a100-80g:2,dgx-h100:1")
    assert mixed.precision == "bf16" and mixed.global_batch == 32
    sized = load_workload(_args("--cluster", "dgx-h100:2"), nodes=8)  # the spec's nodes win over the command's
    assert isinstance(sized, Workload) and sized.cluster.nodes == 2
    with pytest.raises(AutoparError, match="^group dgx-a100-80g .*precision fp8"):
        load_workload(_args("--cluster", "dgx-a100-80g:1,dgx-h100:1", "--precision", "fp8"), mixed=True)
    with pytest.raises(AutoparError, match="is a mixed cluster of groups dgx-a100-80g, dgx-h100; this command"):
        load_workload(_args("--cluster", "dgx-a100-80g:1,dgx-h100:1"))


@pytest.mark.parametrize("flags, words", [
    (("--nodes", "2"), RESIZE_REFUSED),
    (("--gpus-per-node", "4"), RESIZE_REFUSED),
])
def test_cli_refuses_resizing_a_mixed_cluster_in_one_line(capsys, flags, words):
    assert main(["search", "gpt", "--model-arg", "size=tiny", "--cluster", "dgx-a100-80g:1,dgx-h100:1", *flags]) == 2
    out, err = capsys.readouterr()
    assert err == f"autopar: error: {words}\n" and out == ""
