"""Runtimes (torch vs Megatron-Core) and their overlaps, per-GPU calibration, the regime note, and the
Blackwell presets."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autopar.axes import padded_vocab
from autopar.cluster import load_cluster
from autopar.cluster.presets import SELENE_IB_EFFICIENCY
from autopar.cost import Coefficients, estimate
from autopar.cost.coefficients import GPU_CALIBRATION, FITTED_BOUNDS, GpuCalibration, gpu_calibration
from autopar.cost.regime import attention_fused, regime_note
from autopar.errors import AutoparError
from autopar.plan import Plan
from autopar.profile import profile_model
from autopar.runtime import NEMO_SWITCHES
from autopar.workload import Workload
from conftest import profile

MODELS = Path(__file__).resolve().parent / "models"
TP_PLAN = Plan(dp=2, tp=4, pp=1, micro_batch_size=1, num_micro_batches=8, zero=1, recompute="full",
               recompute_blocks=24)


def _workload(runtime="torch", switches=(), cluster="dgx-a100-80g", model="gpt", size="1.7b", **kw):
    return Workload(profile(model, size=size), load_cluster(cluster, **kw), 16, runtime=runtime, switches=switches)


def test_megatron_overlaps_hide_communication_and_name_it():
    """With Megatron-Core's overlap switches on, TP collectives hide under GEMMs and the distributed
    optimizer's reduce-scatter / all-gather under backward / forward: less exposed, the hidden
    seconds reported; with them off nothing is hidden."""
    off = estimate(_workload("megatron"), TP_PLAN)
    on = estimate(_workload("megatron", NEMO_SWITCHES), TP_PLAN)
    assert off.hidden == {"tp_comm": 0.0, "dp_comm": 0.0}
    assert on.hidden["tp_comm"] > 0 and on.hidden["dp_comm"] > 0
    assert on.breakdown["tp_comm"] < off.breakdown["tp_comm"]
    assert on.breakdown["dp_comm"] < off.breakdown["dp_comm"]
    assert on.breakdown["tp_comm"] + on.hidden["tp_comm"] == pytest.approx(off.breakdown["tp_comm"], rel=1e-6)
    assert on.to_dict()["hidden"] == on.hidden and on.to_dict()["runtime"] == "megatron"


def test_megatron_runs_its_own_attention_whatever_the_file_writes():
    """The explicit-softmax GPT: torch pays for its seq x seq tensors as written; Megatron with flash
    attention drops them (memory and traffic); without flash, Megatron's unfused softmax is priced from
    the score count, not from the file's ops. (Megatron's loss keeps its own tensors too, an fp32
    softmax of the padded vocabulary where the file's keeps a bf16 log-softmax: set apart here,
    tests/test_cost_loss_memory.py checks it.)"""
    plan = Plan(dp=8, tp=1, pp=1, micro_batch_size=1, num_micro_batches=2)
    torch_w = _workload("torch")
    torch_est = estimate(torch_w, plan)
    flash = estimate(_workload("megatron", ("flash_attn",)), plan)
    unfused = estimate(_workload("megatron"), plan)
    p = torch_w.profile
    loss_gap = p.seq_len * (4 * padded_vocab(p.dims["vocab"], 1, 128) + 9) - p.head.loss_saved_bytes
    assert loss_gap > 0
    assert flash.memory["activations"] < unfused.memory["activations"] <= torch_est.memory["activations"] + loss_gap
    assert flash.breakdown["compute"] < unfused.breakdown["compute"]


def test_bad_runtime_and_switch_are_one_line_errors():
    with pytest.raises(AutoparError, match="unknown runtime 'deepspeed'; use one of torch, megatron"):
        _workload("deepspeed")
    with pytest.raises(AutoparError, match="unknown Megatron switch"):
        _workload("megatron", ("overlap_everything",))
    with pytest.raises(AutoparError, match="need runtime 'megatron'"):
        _workload("torch", ("flash_attn",))


def test_gpu_calibrations_stay_in_physical_bounds():
    """At most four fitted coefficients per GPU type, each inside its bounds, GEMM efficiency below the
    GPU's measured matmul ceiling; a fifth or an out-of-range value is refused."""
    for name, cal in GPU_CALIBRATION.items():
        assert len(cal.fitted) <= 4, name
        for key, value in cal.fitted.items():
            lo, hi = FITTED_BOUNDS[key]
            assert lo <= value <= hi, (name, key)
        assert cal.fitted["gemm_efficiency"] <= cal.gemm_ceiling
    with pytest.raises(ValueError, match="physical range"):
        GpuCalibration(gemm_ceiling=0.8, fitted={"gemm_efficiency": 0.9})
    with pytest.raises(ValueError, match="at most 4"):
        GpuCalibration(fitted=dict.fromkeys(("gemm_efficiency", "gemm_half_flops", "elementwise_traffic",
                                             "link_efficiency.ib", "x"), 0.5))
    assert not gpu_calibration("L40S").calibrated and not gpu_calibration("RTX-4090").calibrated


def test_link_efficiency_stays_with_its_cluster():
    """The IB efficiency fitted to Megatron-LM's runs on Selene lives on the selene preset only: another
    DGX A100 cluster (vTrain's, a user's) keeps the datasheet rate until its own links are measured."""
    selene = Coefficients.for_cluster(load_cluster("selene"))
    assert selene.link("ib") == pytest.approx(SELENE_IB_EFFICIENCY) and SELENE_IB_EFFICIENCY < 1.0
    for other in ("dgx-a100-80g", "dgx-a100-40g", "dgx-h100", "gb200-nvl72"):
        assert Coefficients.for_cluster(load_cluster(other)).link("ib") == Coefficients().link("ib"), other


def test_regime_note_one_line_only_outside():
    inside = _workload("megatron", nodes=1)
    assert regime_note(inside, TP_PLAN) == ""
    torch_note = regime_note(_workload("torch", nodes=1), TP_PLAN)
    assert torch_note.startswith("note: outside the calibrated regime (runtime torch)") and "\n" not in torch_note
    no_recompute = TP_PLAN.with_(recompute="none", recompute_blocks=0)
    assert "recompute none" in regime_note(inside, no_recompute)
    h100 = regime_note(_workload("megatron", cluster="dgx-h100", nodes=1), TP_PLAN)
    assert "scaled from the A100 fit" in h100
    assert "uncalibrated" in regime_note(_workload("megatron", cluster="l40s-pcie", nodes=1), TP_PLAN)


def test_blackwell_presets():
    b200 = load_cluster("dgx-b200", nodes=2)
    assert b200.gpu.name == "B200" and b200.gpus_per_node == 8 and b200.ring(8, 1).kind == "nvlink"
    assert b200.ring(16, 1).kind == "ib"
    nvl72 = load_cluster("gb200-nvl72", nodes=2)
    assert nvl72.gpus_per_node == 72 and nvl72.gpu.memory_bytes == 184.3 * 2**30  # estimated (docs/hardware.md)
    # one NVLink domain of 72 GPUs: a ring of 72 never leaves NVLink, a strided one across domains does
    assert nvl72.ring(72, 1).kind == "nvlink" and nvl72.ring(72, 1).bandwidth == 900e9
    assert nvl72.ring(2, 72).kind == "ib"
    est = estimate(Workload(profile("llama", size="tiny"), nvl72, 144), Plan(dp=144, tp=1, pp=1, micro_batch_size=1,
                                                                          num_micro_batches=1))
    assert est.iteration_time_s > 0


def test_selective_recompute_with_fused_attention_says_why_it_changes_nothing():
    from autopar.cost.regime import selective_note

    plan = Plan(dp=2, tp=1, pp=1, micro_batch_size=1, num_micro_batches=4, recompute="selective")
    flash = Workload(profile("llama", size="tiny"), load_cluster("dgx-a100-80g", nodes=1, gpus_per_node=2), 8)
    assert "fused (flash) kernel" in selective_note(flash, plan)
    explicit = Workload(profile("gpt", size="tiny"), load_cluster("dgx-a100-80g", nodes=1, gpus_per_node=2), 8)
    assert selective_note(explicit, plan) == ""
    sel, none = (estimate(flash, plan.with_(recompute=m)) for m in ("selective", "none"))
    assert sel.memory["activations"] == pytest.approx(none.memory["activations"])
    assert "saves no memory" in selective_note(flash, plan)
    # Transformer Engine's fp8 projection keeps its own copy of the attention's output: selective
    # recompute, rerunning the flash kernel, drops the kernel's saved output, and the note says how much
    te = dataclasses.replace(Workload(profile("llama", size="tiny"), load_cluster("dgx-h100", nodes=1), 8),
                             runtime="megatron", switches=("flash_attn",), fp8=True)
    fp8 = Plan(dp=4, tp=2, pp=1, micro_batch_size=1, num_micro_batches=2, recompute="selective",
               sequence_parallel=True, precision="fp8", fp8_recipe="tensorwise")
    sel, none = (estimate(te, fp8.with_(recompute=m)).memory["activations"] for m in ("selective", "none"))
    assert 0 < none - sel < 0.1 * none
    assert f"saves only {(none - sel) / 1e9:.3g} GB" in selective_note(te, fp8)
    assert selective_note(te, fp8, estimate(te, fp8)) == selective_note(te, fp8)  # the caller's estimate


def test_cli_runtime_flags(capsys):
    """`--runtime megatron --megatron SWITCH` reaches the estimate (hidden overlaps, the note); a bad
    runtime or switch is one line on stderr and exit code 2."""
    import json

    from autopar.cli import main

    gpt = ["estimate", "gpt", "--model-arg", "size=tiny", "--nodes", "1", "--gpus-per-node", "8",
           "--global-batch", "16", "--dp", "2", "--tp", "4", "--micro-batch", "1"]
    assert main([*gpt, "--runtime", "megatron", "--megatron", "tp_comm_overlap", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["runtime"] == "megatron" and d["workload"]["megatron_switches"] == ["tp_comm_overlap"]
    assert d["hidden"]["tp_comm"] > 0 and "recompute none" in d["calibration_note"]
    assert main([*gpt, "--sequence-parallel", "--switch", "async_tp", "--json"]) == 0  # --megatron's new name
    assert json.loads(capsys.readouterr().out)["workload"]["megatron_switches"] == ["async_tp"]
    for bad, message in ((["--runtime", "deepspeed"], "unknown runtime"),
                         (["--megatron", "flash_attn"], "need runtime")):
        assert main([*gpt, *bad]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and err.startswith("autopar: error: ")


def test_note_when_predicted_mfu_beats_every_published_one():
    """A plan predicted above the best MFU published on its GPU type is flagged, saying whether the
    calibration covers it; below it, inside the regime, nothing is printed."""
    w = _workload("megatron", nodes=1)
    est = estimate(w, TP_PLAN)
    assert regime_note(w, TP_PLAN, est) == ""  # 1.7B at tp 4: well below 56.3%
    fake = dataclasses.replace(est, model_flops=est.model_flops * 0.6 / est.mfu)
    assert fake.mfu == pytest.approx(0.6)
    assert regime_note(w, TP_PLAN, fake).startswith("note: MFU 60.0% above the best published on A100-SXM4-80GB "
                                                    "with unfused attention (56.3%); the plan lies inside the "
                                                    "calibrated regime")
    outside = regime_note(_workload("torch", nodes=1), TP_PLAN, fake)
    assert "outside the calibrated regime (MFU 60.0% above" in outside and "runtime torch" in outside


def test_flash_attention_is_held_to_the_best_published_flash_run():
    """A flash kernel skips the causal mask's upper half, which the FLOPs convention counts: FlashAttention-2
    trained a GPT at 72% MFU on A100 (Dao 2023), so 60% there is no record; 75% is."""
    w = _workload("megatron", switches=("flash_attn",), nodes=1)
    est = estimate(w, TP_PLAN)
    at = lambda mfu: dataclasses.replace(est, model_flops=est.model_flops * mfu / est.mfu)  # noqa: E731
    assert regime_note(w, TP_PLAN, at(0.60)) == ""
    note = regime_note(w, TP_PLAN, at(0.75))
    assert "above the best published on A100-SXM4-80GB with flash attention (72.0%)" in note
    sdpa = Workload(profile_model(MODELS / "gpt_sdpa.py", {"size": "1.7b"}), load_cluster("dgx-a100-80g", nodes=1), 16)
    assert "flash attention (72.0%)" in regime_note(sdpa, TP_PLAN, at(0.75))  # torch runs the file's SDPA: flash


def test_megatron_softmax_prices_megatrons_attention_core_under_torch():
    """vTrain's Megatron-DeepSpeed runs: the `megatron_softmax` switch prices the attention core as
    Megatron-LM runs it (baddbmm, fused scale-mask-softmax, dropout, bmm) whatever the file writes,
    under the torch runtime too: the bundled GPT (explicit softmax) and gpt_sdpa.py (SDPA, a flash
    kernel under plain torch) then cost the same, as they do under runtime megatron; without the
    switch the flash file is faster. The rest of the layer stays the file's (torch, not Megatron-Core)."""
    cluster = load_cluster("dgx-a100-80g", nodes=1)
    files = {"bundled": profile("gpt", size="1.7b"), "sdpa": profile_model(MODELS / "gpt_sdpa.py", {"size": "1.7b"})}
    plan = Plan(dp=1, tp=8, pp=1, micro_batch_size=1, num_micro_batches=16, recompute="none")

    def compute(prof, **kw):
        return estimate(Workload(prof, cluster, 16, **kw), plan).breakdown["compute"]

    plain = {k: compute(p) for k, p in files.items()}
    switched = {k: compute(p, switches=("megatron_softmax",)) for k, p in files.items()}
    assert plain["sdpa"] < 0.9 * plain["bundled"]  # torch runs the SDPA file as a flash kernel
    assert switched["sdpa"] == pytest.approx(switched["bundled"], rel=0.03)
    assert switched["sdpa"] > plain["sdpa"]  # the switch puts the seq x seq traffic back
    # the best published MFU it is held to is the unfused one (56.3% on A100), not flash attention's
    assert attention_fused(Workload(files["sdpa"], cluster, 16))
    assert not attention_fused(Workload(files["sdpa"], cluster, 16, switches=("megatron_softmax",)))


def test_megatron_softmax_and_flash_attn_are_two_kernels():
    with pytest.raises(AutoparError, match="two different attention kernels"):
        _workload("megatron", switches=("flash_attn", "megatron_softmax"))
    assert _workload("torch", switches=("megatron_softmax",)).switches == ("megatron_softmax",)


# -- Megatron's eager paths: the softmax fallback and the fp32 vocab-parallel loss ----------------------
def _megatron_gpt(hidden=1024, layers=4):
    from autopar.traces.vtrain import MODEL_FILE, VOCAB

    return profile_model(MODEL_FILE, {"hidden": hidden, "heads": 16, "layers": layers, "vocab": VOCAB,
                                      "seq_len": 1024}, dtype="fp16")


def _vtrain_estimate(prof, plan, switches=("megatron_softmax",), coefficients=None):
    cluster = load_cluster("vtrain-a100", nodes=1)
    if coefficients is not None:
        cluster = dataclasses.replace(cluster, coefficients=coefficients.to_dict())
    return estimate(Workload(prof, cluster, plan.dp * plan.micro_batch_size * plan.num_micro_batches,
                             switches=switches), plan)


def test_megatron_softmax_falls_back_exactly_when_attention_batches_are_not_a_multiple_of_4(monkeypatch):
    """Megatron's fused scale-mask-softmax needs micro-batch x heads per rank to be a multiple of 4;
    otherwise its torch path makes 32 more HBM bytes per score in forward and 34 in backward. With 16
    heads that is tp 8 at micro-batch 1 (2 batches) and nothing else among tp 1-8, micro-batch 1-4;
    the extra compute is exactly those bytes at the HBM rate."""
    from autopar.cost import softmax_fallback

    prof = _megatron_gpt()
    hbm = load_cluster("vtrain-a100", nodes=1).gpu.hbm_bytes_per_s * Coefficients().hbm_efficiency
    scores = prof.layers[0].attn_scores * prof.layers[0].count
    for tp in (1, 2, 4, 8):
        for mb in (1, 2, 4):
            plan = Plan(dp=8 // tp, tp=tp, pp=1, micro_batch_size=mb, num_micro_batches=1, precision="fp16")
            with_fb = _vtrain_estimate(prof, plan).breakdown["compute"]
            monkeypatch.setattr(softmax_fallback, "FALLBACK_IO_BYTES", (0.0, 0.0))
            without = _vtrain_estimate(prof, plan).breakdown["compute"]
            monkeypatch.undo()
            expected = 66.0 * mb * scores / tp / hbm if (tp, mb) == (8, 1) else 0.0
            assert with_fb - without == pytest.approx(expected, rel=1e-9, abs=1e-12), (tp, mb)
    # runtime megatron's unfused core falls back the same way; flash attention never does
    plan = Plan(dp=1, tp=8, pp=1, micro_batch_size=1, num_micro_batches=1, precision="fp16")
    mega = lambda sw: Workload(prof, load_cluster("vtrain-a100", nodes=1), 1, runtime="megatron", switches=sw)  # noqa: E731
    assert softmax_fallback.fallback(mega(()), [1], [8], [True]).tolist() == [[1.0]]
    assert softmax_fallback.fallback(mega(("flash_attn",)), [1], [8], [True]).tolist() == [[0.0]]
    assert softmax_fallback.fallback(mega(()), [1], [8], [False]).tolist() == [[0.0]]  # fp32: no kernel at all


def test_megatron_softmax_fallback_adds_its_launches_to_the_host_time():
    """On a calibrated cluster (host time priced), the fallback's 4 extra operations per layer pass
    over a layer's 18 add that share of a layer's host time; with host_overlap 1 (host and GPU add
    up) the overhead shows it exactly."""
    from autopar.cost import softmax_fallback

    prof = _megatron_gpt(layers=4)
    c = dataclasses.replace(Coefficients(), block_host_s=1e-3, host_overlap=1.0, step_overhead_s=0.0)
    over = {mb: _vtrain_estimate(prof, Plan(dp=1, tp=8, pp=1, micro_batch_size=mb, num_micro_batches=1,
                                            precision="fp16"), coefficients=c).breakdown["overhead"]
            for mb in (1, 2)}
    # layers, and the embedding and head in layers' worth of their launches (cost/launches.py: the file's
    # loss, without the megatron_cross_entropy switch): 3 passes each (forward, backward's two), no recompute
    embed, layer, head = (b.launches for b in (prof.embed, prof.layers[0], prof.head))
    blocks = 4 + (embed + head) / layer
    assert over[2] == pytest.approx(3 * blocks * 1e-3, rel=1e-9)
    share = softmax_fallback.FALLBACK_EXTRA_OPS / softmax_fallback.FUSED_LAYER_OPS
    assert over[1] - over[2] == pytest.approx(3 * 4 * 1e-3 * share, rel=1e-9)


def test_megatron_cross_entropy_is_priced_from_the_logits_not_the_files_loss():
    """The `megatron_cross_entropy` switch prices the loss as Megatron runs it (fp32, unfused: 38 HBM
    bytes per logit forward, 14 backward, sharded by tp over the vocabulary) and drops the file's own
    head traffic: a file whose loss moved ten times the bytes costs the same under the switch."""
    from autopar.cost.cross_entropy import CROSS_ENTROPY_BYTES

    prof = _megatron_gpt()
    heavy = dataclasses.replace(prof, blocks=(*prof.blocks[:-1],
                                              dataclasses.replace(prof.blocks[-1], io_bytes=10 * prof.blocks[-1].io_bytes)))
    silent = dataclasses.replace(prof, blocks=(*prof.blocks[:-1], dataclasses.replace(prof.blocks[-1], io_bytes=0.0)))
    hbm = load_cluster("vtrain-a100", nodes=1).gpu.hbm_bytes_per_s * Coefficients().hbm_efficiency
    on = ("megatron_cross_entropy", "megatron_softmax")
    for tp, mb in ((1, 1), (2, 4), (8, 2)):
        plan = Plan(dp=8 // tp, tp=tp, pp=1, micro_batch_size=mb, num_micro_batches=1, precision="fp16")
        compute = lambda p, sw: _vtrain_estimate(p, plan, switches=sw).breakdown["compute"]  # noqa: E731
        assert compute(heavy, on) == pytest.approx(compute(prof, on), rel=1e-12)
        assert compute(heavy, on[1:]) > compute(prof, on[1:])
        logits = mb * 1024 * prof.dims["vocab"] / tp
        added = sum(CROSS_ENTROPY_BYTES) * logits / hbm
        assert compute(silent, on) - compute(silent, on[1:]) == pytest.approx(added, rel=1e-9)
    assert _workload("torch", ("megatron_cross_entropy",)).switches == ("megatron_cross_entropy",)
