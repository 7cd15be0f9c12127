"""CUDA graphs as a knob (issue 40 point 4): Megatron-Core's per-layer graphs (`--enable-cuda-graph`)
under a Megatron runtime, torch.compile's mode="reduce-overhead" on the compiled blocks under torch;
priced as removing the layers' launch time; refused off CUDA in one line by autopar.capability; every
exporter maps it or says why not. Its CUDA path is not exercised here (no GPU in CI)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import profile

from autopar.capability import Device, Target, refusal
from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.cost import Coefficients, PlanArrays, evaluate
from autopar.cost.launches import MEGATRON_LAYER_LAUNCHES, block_weights
from autopar.cost.model import _kind_arrays
from autopar.executor.facts import device_facts
from autopar.executor.precision import compile_blocks
from autopar.executor.support import refusal as executor_refusal
from autopar.export import export_plan
from autopar.plan import Plan
from autopar.search.space import enumerate_plans
from autopar.workload import Workload

BASE = dict(dp=1, tp=1, pp=1, micro_batch_size=4, num_micro_batches=2)


def _workload(runtime: str, cluster: str = "dgx-h100") -> Workload:
    p = profile("gpt", hidden=256, heads=4, layers=4, vocab=1024, seq_len=128)
    return Workload(p, load_cluster(cluster, nodes=1, gpus_per_node=1), 8, runtime=runtime)


def test_the_rule_refuses_cpu_and_eager_torch_and_allows_cuda():
    on_cpu = refusal("cuda_graphs", Target(device=Device("cpu")), True, {"compile": True})
    on_gloo = refusal("cuda_graphs", Target(backend="gloo"), True, {"compile": True})
    assert "needs CUDA GPUs" in on_cpu and "needs CUDA GPUs" in on_gloo
    assert "set compile true" in refusal("cuda_graphs", Target(backend="nccl"), True, {"compile": False})
    assert refusal("cuda_graphs", Target(backend="nccl", device=Device("cuda", (9, 0))), True, {"compile": True}) is None
    assert refusal("cuda_graphs", Target(runtime="megatron-core"), True, {"compile": False}) is None  # Megatron's own
    assert refusal("cuda_graphs", Target(device=Device("cpu")), False, {}) is None


def test_the_space_offers_it_on_cuda_only_and_under_torch_with_compile():
    torch_h100 = enumerate_plans(_workload("torch"))
    assert {(bool(c), bool(g)) for c, g in zip(torch_h100.compile, torch_h100.cuda_graphs)} == {
        (False, False), (True, False), (True, True)}
    assert set(enumerate_plans(_workload("megatron")).cuda_graphs.tolist()) == {0, 1}
    assert set(enumerate_plans(_workload("torch", "cpu")).cuda_graphs.tolist()) == {0}


def _refused(capsys, argv, words):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err and words in err, err


def test_estimate_and_run_refuse_it_on_cpu_in_one_line(capsys, tmp_path):
    _refused(capsys, ["estimate", "gpt", "--model-arg", "size=tiny", "--cluster", "cpu", "--nodes", "1",
                      "--gpus-per-node", "1", "--global-batch", "8", "--dp", "1", "--micro-batch-size", "8",
                      "--compile", "--cuda-graphs"], "cuda_graphs needs CUDA GPUs")
    path = tmp_path / "plan.json"
    Plan(**BASE, compile=True, cuda_graphs=True).save(path)
    _refused(capsys, ["run", str(path), "gpt", "--model-arg", "size=tiny", "--nproc-per-node", "1",
                      "--backend", "gloo"], "cuda_graphs needs CUDA GPUs")
    assert list(tmp_path.iterdir()) == [path]  # nothing launched, nothing written
    plan = Plan(**BASE, compile=True, cuda_graphs=True)
    assert "this run is on cpu" in executor_refusal(plan, "nccl", device=device_facts(torch.device("cpu")))


def test_graphs_remove_the_layers_launch_time():
    """Host and GPU time added (host_overlap 1): with graphs a micro-batch launches only the ends'
    kernels, Megatron's 18 a layer at the H100's per-kernel cost times their launch weights, 3 passes."""
    w = _workload("megatron")
    c = dataclasses.replace(Coefficients.for_cluster(w.cluster, "megatron"), host_overlap=1.0)
    plans = [Plan(**BASE), Plan(**BASE, cuda_graphs=True)]
    res = evaluate(w, PlanArrays.from_plans(plans, w.profile), c)
    off = dataclasses.replace(c, launch_s=0.0)
    bare = evaluate(w, PlanArrays.from_plans(plans, w.profile), off)["iteration_time"]
    weights = block_weights(_kind_arrays(w.profile), w)
    per_mb = c.launch_s * MEGATRON_LAYER_LAUNCHES * 3
    eager = per_mb * (weights[0] + w.profile.num_layers * weights[1] + weights[-1])
    graphed = per_mb * (weights[0] + weights[-1])
    m = BASE["num_micro_batches"]
    assert res["iteration_time"][0] - bare[0] == pytest.approx(m * eager, rel=1e-6)
    assert res["iteration_time"][1] - bare[1] == pytest.approx(m * graphed, rel=1e-6)
    assert bare[0] == pytest.approx(bare[1])  # nothing else changes


def test_every_exporter_maps_it_or_says_why():
    plan = Plan(dp=8, micro_batch_size=1, num_micro_batches=4, compile=True, cuda_graphs=True)
    assert "--enable-cuda-graph" in export_plan(plan, "megatron").text
    assert "--enable-cuda-graph" not in export_plan(plan.with_(cuda_graphs=False), "megatron").text
    for framework in ("torchtitan", "deepspeed", "accelerate"):
        assert any(line.startswith("cuda_graphs:") for line in export_plan(plan, framework).unexpressed), framework


def test_the_executor_compiles_the_blocks_in_reduce_overhead_mode(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, *a, **kw: calls.append(kw))
    blocks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    compile_blocks(blocks, Plan(**BASE, compile=True, cuda_graphs=True))
    compile_blocks(blocks, Plan(**BASE, compile=True))
    assert calls == [{"mode": "reduce-overhead"}] * 2 + [{}] * 2
