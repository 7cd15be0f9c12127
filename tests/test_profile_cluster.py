"""`autopar profile-cluster`: local gloo all-reduce and matmul measurements into a cluster JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest

from autopar.calibrate.cluster_profile import fit_shm
from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.cost.model import all_reduce_time


def test_fit_shm_recovers_a_ring():
    rows = [(b, n, float(all_reduce_time(b, n, 2e9, 2e-5, 5e-5))) for n in (2, 4) for b in 4.0 ** np.arange(6, 14)]
    fit = fit_shm(rows)
    assert fit["bandwidth"] == pytest.approx(2e9, rel=0.01)
    assert fit["hop_latency"] == pytest.approx(2e-5, rel=0.05)
    assert fit["collective_latency_s"] == pytest.approx(5e-5, rel=0.05)
    assert fit["mape"] < 1e-3


def test_profile_cluster_writes_a_usable_cluster(tmp_path, capsys):
    """Two gloo processes, three small messages: seconds, not minutes."""
    out = tmp_path / "cpu.json"
    code = main(["profile-cluster", "-o", str(out), "--ranks", "2", "--min-bytes", "4K", "--max-bytes", "64K",
                 "--backend", "gloo", "--timeout", "120", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["measurements"]["allreduce"]
    assert [(r["bytes"], r["ranks"]) for r in rows] == [(4096, 2), (16384, 2), (65536, 2)]
    assert all(r["seconds"] > 0 for r in rows)
    assert report["measurements"]["matmul_flops"]["fp32"] and report["measurements"]["memory_bytes_per_s"] > 0
    cluster = load_cluster(str(out))
    assert cluster.node.intra == "shm" and cluster.name == "local-cpu-profiled"
    assert cluster.gpu.peak_flops["fp32"] == pytest.approx(max(report["measurements"]["matmul_flops"]["fp32"].values()))
    assert cluster.links["shm"].bandwidth == pytest.approx(report["measurements"]["fit"]["bandwidth"])
    assert cluster.coefficients["collective_latency_s"] >= 0
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
