"""`autopar profile-cluster`: local gloo all-reduce and matmul measurements into a cluster JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from autopar.calibrate.cluster_profile import collective_efficiency, fit_shm
from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.cost.collectives import all_reduce_time


def test_fit_shm_recovers_a_ring():
    rows = [(b, n, float(all_reduce_time(b, n, 2e9, 2e-5, 5e-5))) for n in (2, 4) for b in 4.0 ** np.arange(6, 14)]
    fit = fit_shm(rows)
    assert fit["bandwidth"] == pytest.approx(2e9, rel=0.01)
    assert fit["hop_latency"] == pytest.approx(2e-5, rel=0.05)
    assert fit["collective_latency_s"] == pytest.approx(5e-5, rel=0.05)
    assert fit["mape"] < 1e-3


def test_collective_efficiency_is_half_the_all_reduce_over_the_measured_time():
    allreduce = [(2**20, 2, 1e-3), (2**22, 2, 4e-3), (2**20, 4, 2e-3)]
    collectives = [("reduce_scatter", 2**20, 2, 1.5e-3), ("reduce_scatter", 2**22, 2, 6e-3),
                   ("all_gather", 2**20, 2, 0.5e-3), ("broadcast", 2**20, 4, 0.5e-3),
                   ("all_gather", 2**24, 2, 1.0)]  # no all-reduce of that size: not compared
    assert collective_efficiency(allreduce, collectives) == pytest.approx(
        {"all_gather": 1.0, "broadcast": 2.0, "reduce_scatter": 1 / 3})


@pytest.mark.slow
def test_profile_cluster_writes_a_usable_cluster(tmp_path, capsys, monkeypatch):
    """Two gloo processes, four small messages and one of 1 MiB (where the ZeRO collectives are
    timed too): seconds, not minutes. The measurement is cached in this test's own cache folder, so
    no later test's `--cluster cpu` takes it."""
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "cpu.json"
    code = main(["profile-cluster", "-o", str(out), "--ranks", "2", "--min-bytes", "4K", "--max-bytes", "1M",
                 "--backend", "gloo", "--timeout", "120", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["measurements"]["allreduce"]
    assert [(r["bytes"], r["ranks"]) for r in rows] == [(4 ** k * 1024, 2) for k in range(1, 6)]
    zero = report["measurements"]["collectives"]
    assert sorted((r["op"], r["bytes"]) for r in zero) == [(op, 2**20) for op in ("all_gather", "broadcast",
                                                                                  "reduce_scatter")]
    assert set(report["cluster"]["coefficients"]["collective_efficiency"]) == {"all_gather", "broadcast",
                                                                               "reduce_scatter"}
    assert all(r["seconds"] > 0 for r in rows)
    assert report["measurements"]["matmul_flops"]["fp32"] and report["measurements"]["memory_bytes_per_s"] > 0
    cluster = load_cluster(str(out))
    assert cluster.node.intra == "shm" and cluster.name == "local-cpu-profiled"
    assert cluster.gpu.peak_flops["fp32"] == pytest.approx(max(report["measurements"]["matmul_flops"]["fp32"].values()))
    assert cluster.links["shm"].bandwidth == pytest.approx(report["measurements"]["fit"]["bandwidth"])
    assert cluster.coefficients["collective_latency_s"] >= 0
    assert report["cached"].startswith(str(tmp_path / "cache"))  # the cpu preset now uses this machine's figures
    assert load_cluster("cpu").gpu == cluster.gpu
    # the planner takes it
    assert main(["estimate", "gpt", "--cluster", str(out), "--model-arg", "size=tiny", "--global-batch", "4",
                 "--gpus-per-node", "2", "--dp", "2", "--tp", "1", "--pp", "1", "--micro-batch", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["breakdown"]["dp_comm"] > 0


def test_profile_cluster_bad_flags(tmp_path, capsys):
    out = tmp_path / "x.json"
    assert main(["profile-cluster", "-o", str(out), "--ranks", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err
    assert main(["profile-cluster", "-o", str(out), "--ranks", "two"]) == 2
    assert main(["profile-cluster", "-o", str(out), "--min-bytes", "1M", "--max-bytes", "4K"]) == 2
    assert not out.exists()
