"""Issue 39 point 2: CPU estimates say they are rough until this machine is measured, and the
credibility note holds a prediction to the best MFU published for its GPU, runtime and precision,
whatever calibration the cluster carries."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from autopar.cli import main
from autopar.cluster import load_cluster
from autopar.cluster.measured import measured_here, measurement, measurement_path, store_measurement
from autopar.cost import estimate
from autopar.cost.published_mfu import PUBLISHED_MFU, best_published
from autopar.cost.regime import CPU_ROUGH_NOTE, regime_note
from autopar.plan import Plan
from autopar.workload import Workload
from conftest import profile

CPU_PLAN = Plan(dp=2, tp=1, pp=1, micro_batch_size=4, num_micro_batches=2)
GPT_TINY = ["gpt", "--model-arg", "size=tiny", "--cluster", "cpu", "--gpus-per-node", "2", "--global-batch", "16"]


def _measured_cpu(flops=3.1e9) -> object:
    """A cluster as profile-cluster writes it on CPU (figures that are not the preset's)."""
    base = load_cluster("cpu", gpus_per_node=2)
    gpu = dataclasses.replace(base.gpu, name="cpu-process (profiled)",
                              peak_flops={"fp32": flops, "bf16": flops / 3, "fp16": flops / 3}, hbm_bytes_per_s=4.2e9)
    coeffs = {"gemm_efficiency": 1.0, "gemm_half_flops": 2.5e6, "host_overlap": 1.0, "collective_latency_s": 3e-5}
    return dataclasses.replace(base, name="local-cpu-profiled", gpu=gpu, coefficients=coeffs)


@pytest.fixture
def no_measurement():
    path = measurement_path()
    path.unlink(missing_ok=True)
    yield
    path.unlink(missing_ok=True)


def test_cpu_preset_estimates_say_rough_until_this_machine_is_measured(no_measurement):
    w = Workload(profile("gpt", size="tiny"), load_cluster("cpu", gpus_per_node=2), 16)
    assert measurement() is None and regime_note(w, CPU_PLAN, estimate(w, CPU_PLAN)) == CPU_ROUGH_NOTE
    assert "profile-cluster" in CPU_ROUGH_NOTE and "rough" in CPU_ROUGH_NOTE

    store_measurement(_measured_cpu())  # what profile-cluster caches on this machine
    cluster = load_cluster("cpu", gpus_per_node=2)  # the preset takes the measured figures
    assert cluster.gpu.name == "cpu-process (profiled)" and cluster.gpu.peak_flops["fp32"] == 3.1e9
    assert cluster.gpus_per_node == 2 and measured_here(cluster)
    w = Workload(profile("gpt", size="tiny"), cluster, 16)
    assert regime_note(w, CPU_PLAN, estimate(w, CPU_PLAN)) == ""
    # a profiled cluster from another machine (other figures) is still rough here
    other = Workload(profile("gpt", size="tiny"), _measured_cpu(flops=9e9), 16)
    assert regime_note(other, CPU_PLAN, estimate(other, CPU_PLAN)) == CPU_ROUGH_NOTE


def test_cache_of_another_machine_is_not_used(no_measurement):
    store_measurement(_measured_cpu())
    doc = json.loads(measurement_path().read_text())
    measurement_path().write_text(json.dumps({**doc, "machine": "0000000000000000"}))
    assert measurement() is None and load_cluster("cpu").gpu.name == "cpu-process"


def test_every_cpu_command_prints_the_rough_note(no_measurement, capsys, tmp_path):
    plan = tmp_path / "plan.json"
    for command in (["search", *GPT_TINY, "--method", "exhaustive", "-o", str(plan)],
                    ["estimate", *GPT_TINY, "--plan", str(plan)],
                    ["explain", str(plan), *GPT_TINY]):
        assert main(command) == 0, command
        captured = capsys.readouterr()
        assert CPU_ROUGH_NOTE in " ".join((captured.out + captured.err).split()), command[0]  # rich wraps lines
        assert main([*command, "--json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert CPU_ROUGH_NOTE in d["notes"] and d["calibration_note"] == CPU_ROUGH_NOTE, command[0]


def test_profile_cluster_caches_the_measurement(no_measurement, monkeypatch, capsys):
    """The command caches what it measured on CPU (the measuring itself is stubbed: it takes minutes)."""
    from autopar.calibrate.cluster_profile import ProfileResult
    from autopar.cli import profile_cluster as cli

    monkeypatch.setattr(cli, "profile_cluster", lambda *a, **k: (_measured_cpu(), ProfileResult("gloo", "cpu")))
    assert main(["profile-cluster", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cached"] == str(measurement_path())
    assert measured_here(load_cluster("cpu"))


def _at_mfu(est, mfu):
    return dataclasses.replace(est, model_flops=est.model_flops * mfu / est.mfu)


def test_calibrated_cluster_does_not_silence_an_mfu_beyond_every_published_one(tmp_path):
    """A cluster calibrated on its own traces gets no regime note, but a plan predicted at 72.6% MFU on
    A100 with flash attention (best published: 72%) is flagged."""
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps({"preset": "dgx-a100-80g", "nodes": 1,
                                "coefficients": {"gemm_efficiency": 0.7, "block_host_s": 1e-4}}))
    w = Workload(profile("gpt", size="1.7b"), load_cluster(str(path)), 16, runtime="megatron", switches=("flash_attn",))
    plan = Plan(dp=2, tp=4, pp=1, micro_batch_size=1, num_micro_batches=8, zero=1, recompute="full",
                recompute_blocks=24)
    est = estimate(w, plan)
    assert regime_note(w, plan, _at_mfu(est, 0.60)) == ""
    note = regime_note(w, plan, _at_mfu(est, 0.726))
    assert note.startswith("note: MFU 72.6% above the best published on A100-SXM4-80GB with flash attention (72.0%)")
    assert "calibration" in note and "Dao 2023" in note


def test_mfu_note_compares_with_the_gpu_runtime_and_precision_published(no_measurement):
    """H100 had no published reference: Llama 3's 430 TFLOP/s (43.5% of bf16 peak) now holds bf16 plans
    there; fp8 plans are held to NeMo's FP8 rows."""
    w = Workload(profile("gpt", size="1.7b"), load_cluster("dgx-h100", nodes=1), 16, runtime="megatron",
                 switches=("flash_attn",))
    plan = Plan(dp=2, tp=4, pp=1, micro_batch_size=1, num_micro_batches=8, zero=1, recompute="full",
                recompute_blocks=24)
    est = estimate(w, plan)
    assert "above the best published" not in regime_note(w, plan, _at_mfu(est, 0.40))
    note = regime_note(w, plan, _at_mfu(est, 0.50))
    assert "MFU 50.0% above the best published on H100-SXM5-80GB with flash attention (43.5%)" in note
    assert "Llama 3 Table 4" in note
    assert best_published("H100-SXM5-80GB", "megatron", "fp8", "flash").source.startswith("NeMo 24.07")
    assert best_published("A100-SXM4-80GB", "torch", "bf16", "unfused").mfu == pytest.approx(0.563)
    assert best_published("L40S", "torch", "bf16", "flash") is None


def test_every_published_mfu_names_its_source():
    for row in PUBLISHED_MFU:
        assert 0 < row.mfu < 1 and row.attention in ("flash", "unfused") and row.precisions
        assert re.search(r"docs/references\.md §\d+", row.source), row


def test_autopar_run_says_its_cpu_prediction_is_rough(no_measurement, monkeypatch):
    """`autopar run` prints the prediction beside the measurement: on the unmeasured cpu preset its note
    says the prediction is rough; measured here, nothing (the profile is stubbed: no child process)."""
    import autopar.traces.run_plan as rp

    monkeypatch.setattr(rp, "profile_model", lambda *a, **k: profile("gpt", size="tiny"))
    plan = Plan(dp=2, tp=1, pp=1, micro_batch_size=4, num_micro_batches=2, precision="fp32")
    predicted, _, note = rp.prediction("gpt", {"size": "tiny"}, plan, load_cluster("cpu", gpus_per_node=2), 10.0)
    assert predicted["iteration_time_s"] > 0 and note == CPU_ROUGH_NOTE
    store_measurement(_measured_cpu())
    predicted, _, note = rp.prediction("gpt", {"size": "tiny"}, plan, load_cluster("cpu", gpus_per_node=2), 10.0)
    assert predicted["iteration_time_s"] > 0 and note == ""
    _, _, note = rp.prediction("gpt", {"size": "tiny"}, plan, load_cluster("dgx-a100-80g", nodes=1, gpus_per_node=2), 10.0)
    assert note == ""  # GPU runs keep their table as before
