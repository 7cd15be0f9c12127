"""Fine-grained mixture-of-experts as the runtimes run it (issue 40, point 3; docs/moe-cost.md): expert GEMMs
by their shapes and launches, the dispatchers' permutations and bytes, the all-to-all by EP span, and the
published MoE rows of both frameworks (AutoModel, Megatron-Bridge 25.11) pinned to today's figures."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from autopar.cluster import load_cluster
from autopar.cost import estimate
from autopar.cost import moe as moe_cost
from autopar.cost.coefficients import Coefficients
from autopar.cost.moe import (
    MoeKind,
    alltoall_permute,
    expert_gemm_efficiency,
    fused_permute,
    grouped_efficiency,
)
from autopar.cost.moe import TE_STREAMS, wave_efficiency
from autopar.plan import Plan
from autopar.profile import profile_model
from autopar.workload import Workload
from autopar.zoo import path as zoo_path

SMS = 132  # H100 SXM


def test_expert_gemm_efficiency_falls_with_expert_ffn_and_under_a_per_expert_loop():
    """Same tokens per expert (4096) and hidden (2048), 16 local experts: Qwen3's ffn 768 runs below
    GPT-OSS's ffn 2880 (fewer FLOPs on the size curve, more wave waste), and Megatron-Core's per-expert
    loop (at most 4 experts' tiles in a wave) below one grouped problem; few tokens per expert worst."""
    c = Coefficients.for_cluster(load_cluster("dgx-h100"), "megatron")
    local = np.array([16.0])

    def eff(ffn, loop, rows=4096.0):
        return expert_gemm_efficiency(np.array([rows]), MoeKind(128, 8, 2048, ffn, 0.0, 0.0), local, SMS, c, loop)[0]

    assert eff(768, True) < eff(2880, True) and eff(768, False) < eff(2880, False)
    assert eff(768, True) < 0.92 * eff(768, False)
    assert eff(768, True, rows=512.0) < 0.5 * eff(768, True)


def test_per_expert_loop_matches_the_public_cublas_loop_microbenchmark():
    """grouped_gemm PR #37 (tgale96/grouped_gemm, H100): Qwen3-30B-A3B's up_proj, 128 experts of 512 tokens
    (K 2048, N 1536), a cuBLAS call per expert: 129.5 TFLOP/s, 24.9 us a GEMM. The tile/wave model with
    one expert per wave (24 of 132 SMs busy) and the H100's GEMM efficiency gives it within 5%; 4 streams
    (TE) or one grouped problem fill the waves."""
    c = Coefficients.for_cluster(load_cluster("dgx-h100"), "megatron")
    fwd = lambda share: float(wave_efficiency(512.0, 1536.0, share, SMS))  # noqa: E731
    per_gemm = 2 * 512 * 1536 * 2048 / (c.gemm_efficiency * fwd(1) * 989e12)
    assert per_gemm == pytest.approx(2 * 512 * 1536 * 2048 / 129.5e12, rel=0.05)
    assert fwd(1) < 0.3 < fwd(TE_STREAMS) <= fwd(128)


def test_alltoall_dispatcher_permutes_more_bytes_than_deepep_and_sorts_only_across_ranks():
    """The plain dispatcher permutes top_k copies on the sender and sorts them by expert after the exchange
    (2 x (1 + k + 2k) token bytes a forward); DeepEP's fused permute touches k + ranks copies; ep 1 skips
    the sort."""
    tb, hbm = 1e8, 2e12
    assert alltoall_permute(tb, 8, 8, hbm) == pytest.approx(2 * tb * (1 + 8 + 16) / hbm)
    assert alltoall_permute(tb, 8, 1, hbm) == pytest.approx(2 * tb * 9 / hbm)
    assert fused_permute(tb, 8, 1.0, hbm) < alltoall_permute(tb, 8, 8, hbm)


@pytest.fixture(scope="module")
def qwen_layers():
    """Qwen3-30B-A3B's shape with 4 layers (the experts' shapes as published, a quick profile)."""
    return profile_model(zoo_path("moe"), {"size": "qwen3-30b-a3b", "layers": 4}, dtype="bf16")


def _terms(profile, nodes, ep, runtime="torch", switches=()):
    w = Workload(profile, load_cluster("dgx-h100", nodes=nodes), 8 * nodes * 2, runtime=runtime, switches=switches)
    plan = Plan(dp=8 * nodes, ep=ep, micro_batch_size=2, num_micro_batches=1, zero=2)
    return w, plan, estimate(w, plan)


def test_all_to_all_grows_when_the_ep_group_spans_nodes(qwen_layers):
    """Same tokens per rank: ep 8 inside one DGX rides NVLink; ep 16 over two nodes sends half its bytes
    through one 400 Gb/s NIC per GPU, several times slower."""
    _, _, inside = _terms(qwen_layers, 2, 8)
    _, _, across = _terms(qwen_layers, 2, 16)
    assert across.breakdown["ep_comm"] > 3 * inside.breakdown["ep_comm"] > 0


def test_deepep_sends_fewer_bytes_than_the_plain_dispatcher_with_the_balanced_gate():
    """Under the balanced gate a token's 8 consecutive experts sit on one rank at ep 8: DeepEP sends it
    once, the plain all-to-all 8 times."""
    profile = profile_model(zoo_path("moe"), {"size": "qwen3-30b-a3b", "layers": 2, "gate": "balanced"}, dtype="bf16")
    _, _, plain = _terms(profile, 1, 8)
    _, _, deepep = _terms(profile, 1, 8, switches=("deepep",))
    assert deepep.breakdown["ep_comm"] < plain.breakdown["ep_comm"] / 4


def test_megatron_runs_small_experts_slower_than_one_grouped_problem(qwen_layers, monkeypatch):
    """Under runtime megatron the per-expert loop shares the waves among 4 of the 16 local experts (ffn 768,
    2048 tokens each at micro-batch 1): the step is slower than the same plan priced as one grouped GEMM."""
    w = Workload(qwen_layers, load_cluster("dgx-h100", nodes=1), 64, runtime="megatron", switches=("flash_attn",))
    plan = Plan(dp=8, ep=8, micro_batch_size=1, num_micro_batches=8, zero=1)
    loop = estimate(w, plan).iteration_time_s
    monkeypatch.setattr(moe_cost, "per_expert_loop", lambda workload: False)
    grouped = estimate(w, plan).iteration_time_s
    assert loop > 1.02 * grouped


def test_expert_time_grows_as_the_expert_ffn_shrinks_at_fixed_flops():
    """The same routed FLOPs and tokens per expert (4096) split finer: 16 local experts of ffn 768 at top-8
    against 4 of ffn 3072 at top-2 (Qwen3's granularity against a coarse MoE): the small problems take
    longer under the per-expert loop (4 problems share a wave: 16 narrow ones waste more of it); one grouped
    kernel fills the same waves with the same tiles either way (its per-problem cost is `MoeFit.problem_s`)."""
    c = Coefficients.for_cluster(load_cluster("dgx-h100"), "megatron")
    tokens = 8192.0

    def seconds(ffn, top_k, local, loop):
        kind = MoeKind(8 * local, top_k, 2048, ffn, 0.0, 0.0)
        flops = 2.0 * 3.0 * tokens * top_k * ffn * 2048
        rows = np.array([tokens * top_k / local])
        return flops / (989e12 * expert_gemm_efficiency(rows, kind, np.array([float(local)]), SMS, c, loop)[0])

    fine, coarse = (768, 8, 16), (3072, 2, 4)
    assert seconds(*fine, True) > 1.1 * seconds(*coarse, True)
    assert seconds(*fine, False) == pytest.approx(seconds(*coarse, False), rel=1e-6)


def _capacity_workload(profile, capacity, skew, switches=("flash_attn",)):
    profile = dataclasses.replace(profile, capacity_factor=capacity)
    return Workload(profile, load_cluster("dgx-h100", nodes=1), 64, runtime="megatron", switches=switches,
                    expert_imbalance=skew)


def test_capacity_factor_drops_and_padding_computes_the_whole_capacity(qwen_layers):
    """Capacity factor 1.25: an imbalance of 2 is cut to 1.25x the balanced share (the rest dropped), and
    balanced routing computes its share; padded to capacity (`moe_pad_to_capacity`), every expert computes
    and receives 1.25x whatever the routing: the experts' time and the all-to-all grow by that factor."""
    assert moe_cost.imbalance(_capacity_workload(qwen_layers, 1.25, 2.0)) == 1.25
    assert moe_cost.imbalance(_capacity_workload(qwen_layers, 1.25, 1.0)) == 1.0
    assert moe_cost.imbalance(_capacity_workload(qwen_layers, 0.0, 2.0)) == 2.0  # dropless
    padded = ("flash_attn", moe_cost.PAD_SWITCH)
    assert moe_cost.imbalance(_capacity_workload(qwen_layers, 1.25, 1.0, padded)) == 1.25
    assert moe_cost.imbalance(_capacity_workload(qwen_layers, 0.0, 1.0, padded)) == 1.0  # nothing to pad to
    plan = Plan(dp=8, ep=8, micro_batch_size=2, num_micro_batches=4, zero=1)
    even = estimate(_capacity_workload(qwen_layers, 1.25, 1.0), plan).breakdown
    pad = estimate(_capacity_workload(qwen_layers, 1.25, 1.0, padded), plan).breakdown
    assert pad["ep_comm"] == pytest.approx(1.25 * even["ep_comm"], rel=0.02)
    assert pad["compute"] > even["compute"]


def test_the_per_expert_loop_is_host_paced_where_its_launches_outlast_the_gpu(qwen_layers, monkeypatch):
    """Megatron-Core's loop with TE fp8 current scaling launches 8 kernels a local expert forward and 10
    backward (2 and 4 GEMMs, 3 quantize kernels per GEMM input or output gradient); at the H100's launch
    cost (9.4 us) 16 local experts of Qwen3's shape at micro-batch 1 (2048 tokens an expert) wait on the
    host, so the step slows; at micro-batch 8 the GPU outlasts the launches. Padded to a capacity the
    dispatcher does not sync, and the loop is not host-paced. A grouped kernel pays problem_s per expert GEMM
    problem instead."""
    assert [list(x) for x in moe_cost.loop_launches(np.array([0.0, 1.0]))] == [[2, 8], [4, 10]]
    gpu = np.array([[3e-3], [1e-4]])
    fit = moe_cost.MoeFit(problem_s=5e-6)
    assert list(moe_cost.expert_section(gpu, 16.0, 8.0, True, 20e-6, fit)[:, 0]) == pytest.approx([3e-3, 16 * 8 * 20e-6])
    assert list(moe_cost.expert_section(gpu, 16.0, 2.0, False, 20e-6, fit)[:, 0]) == pytest.approx(
        [3e-3 + 16 * 2 * 5e-6, 1e-4 + 16 * 2 * 5e-6])
    w = Workload(qwen_layers, load_cluster("dgx-h100", nodes=1), 64, runtime="megatron", switches=("flash_attn",),
                 fp8=True)
    launches = moe_cost.loop_launches

    def step(mb, launched=True):
        monkeypatch.setattr(moe_cost, "loop_launches", launches if launched else lambda te_fp8: (0.0, 0.0))
        plan = Plan(dp=8, ep=8, micro_batch_size=mb, num_micro_batches=8 // mb, zero=1, precision="fp8",
                    fp8_recipe="tensorwise")
        return estimate(w, plan).iteration_time_s

    assert step(1) > 1.05 * step(1, launched=False)
    assert step(8) == pytest.approx(step(8, launched=False), rel=1e-9)
    # padded to a capacity, the dispatcher knows every split on the host (no sync): the loop runs ahead
    padded = dataclasses.replace(w, profile=dataclasses.replace(qwen_layers, capacity_factor=1.0),
                                 switches=("flash_attn", moe_cost.PAD_SWITCH))
    assert moe_cost.dispatcher_syncs(w) and not moe_cost.dispatcher_syncs(padded)
    assert list(moe_cost.expert_section(gpu, 16.0, 8.0, True, 20e-6, fit, synced=False)[:, 0]) == pytest.approx(
        [3e-3, 1e-4])
    w = padded
    assert step(1) == pytest.approx(step(1, launched=False), rel=1e-9)


# Megatron-Bridge's 25.09 H100 table ran Qwen3-30B-A3B FP8-CS with the same columns as the 25.11 row (16 GPUs,
# GBS 512, MBS 2, pp 2, vp 24, ep 8) with token drop (capacity factor 1, padded: `--use_tokendrop`), at 10,494
# tokens/s per GPU (docs/performance-summary.md at commit 5776a6d; data/published/megatron_bridge_25.11_h100.
# SOURCE.md): a check, not fitted.
BRIDGE_2509_TOKENDROP = 10_494


def test_the_bridge_qwen3_plan_padded_to_capacity_matches_the_25_09_token_drop_run():
    """The cost model prices the Megatron-Bridge Qwen3 plan padded to capacity 1 (no host sync: every expert
    computes exactly its balanced share, as under the forced balance) within 20% of 25.09's token-drop run of
    the same columns (+17.8%), where the 25.11 dropless row is more than twice as fast as published: what the
    25.11 row adds is the dropless path's, not the plan's GPU work (docs/moe-cost.md)."""
    from autopar.search.published_moe import BRIDGE_ROWS, bridge_plan, bridge_workload

    row = next(r for r in BRIDGE_ROWS if r.model == "Qwen3_30B_a3B")
    w = bridge_workload(row)
    padded = dataclasses.replace(w, profile=dataclasses.replace(w.profile, capacity_factor=1.0),
                                 switches=(*w.switches, moe_cost.PAD_SWITCH))
    per_gpu = lambda wl: wl.global_batch * wl.profile.seq_len / estimate(wl, bridge_plan(row, wl)).iteration_time_s / row.gpus  # noqa: E731
    assert abs(per_gpu(padded) / BRIDGE_2509_TOKENDROP - 1) < 0.20
    assert per_gpu(w) > 2 * row.tokens_per_s_per_gpu


# -- the published rows, leave-one-row-out (issue 40 acceptance 2; experiments/fit_moe.py) ----------------
spec = importlib.util.spec_from_file_location("fit_moe", Path(__file__).parent.parent / "experiments" / "fit_moe.py")
fit_moe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fit_moe)


@pytest.fixture(scope="module")
def held_out():
    fits = fit_moe.grid(steps=3)  # the script's grid has 7 a coefficient; its corners and middles decide alike
    err = fit_moe.errors(fits)
    return fits, err, fit_moe.leave_one_out(fits, err)


def test_leave_one_row_out_over_both_frameworks(held_out):
    """Measured (docs/moe-cost.md): held out, every row but the Megatron-Bridge Qwen3-30B-A3B one is within
    21% (AutoModel's Qwen3 row -21% under the others' problem_s at its bound), the Megatron-Bridge GPT-OSS row
    within 12%, the Megatron-Bridge Qwen3 row far outside acceptance 2's 20% (+131%); median under 15%.
    The shipped fit is the fit over all rows (problem_s 0: the rows do not support a grouped kernel's cost
    per problem), inside its bound."""
    from autopar.search.published_moe import ROWS

    fits, err, held = held_out
    by_label = {row.label: e for row, (_, e) in zip(ROWS, held)}
    qwen_label = "Qwen3_30B_a3B on 16 GPUs (FP8-CS)"
    assert abs(by_label["GPT OSS 120B on 64 GPUs (BF16)"]) < 0.12
    assert by_label[qwen_label] > 0.5
    assert all(abs(e) < 0.21 for label, e in by_label.items() if label != qwen_label)
    assert np.median(np.abs(list(by_label.values()))) < 0.15
    assert fits[fit_moe.best(err, list(range(len(ROWS))))] == moe_cost.FIT
    for name, (lo, hi) in moe_cost.FIT_BOUNDS.items():
        assert lo <= getattr(moe_cost.FIT, name) <= hi


PINNED = {  # each row's error under the shipped fit, today (issue 40 acceptance 4: none moves by more than a point)
    "DeepSeek-V3-671B on 256 GPUs": 0.066,
    "Qwen3-30B-A3B on 8 GPUs": -0.163,
    "GPT-OSS-20B on 8 GPUs": 0.143,
    "GPT-OSS-120B on 64 GPUs": 0.063,
    "GPT OSS 120B on 64 GPUs (BF16)": 0.115,
    "Qwen3_30B_a3B on 16 GPUs (FP8-CS)": 1.320,
}


def test_published_moe_rows_of_both_frameworks_hold_their_figures(held_out):
    """Every MoE row of both frameworks within one point of its pinned error under the shipped fit (the
    Megatron-Bridge Qwen3 row, +132%, is what docs/moe-cost.md says is not explained: the dropless path of
    Megatron-Core 0.15, against 25.09's token-drop run of the same columns)."""
    from autopar.search.published_moe import ROWS

    fits, err, _ = held_out
    shipped = err[fits.index(moe_cost.FIT)]
    assert {row.label for row in ROWS} == set(PINNED)
    for row, e in zip(ROWS, shipped):
        assert e == pytest.approx(PINNED[row.label], abs=0.01), (row.label, e)


def test_megatron_bridge_rows_carry_their_configs_settings():
    """The two MoE rows of Megatron-Bridge 25.11's H100 table, with what their scripts set: the alltoall
    dispatcher (no deepep on H100), Qwen3's 1F1B A2A overlap and overlapped p2p (pp 2, vp 24), FP8 current
    scaling for Qwen3 only, the table's micro-batch (8 and 32 micro-batches a step)."""
    from autopar.search.published_moe import BRIDGE_PRECISION, BRIDGE_ROWS, settings

    rows = {row.model: row for row in BRIDGE_ROWS}
    assert set(rows) == {"GPT OSS 120B", "Qwen3_30B_a3B"}
    qwen, oss = rows["Qwen3_30B_a3B"], rows["GPT OSS 120B"]
    assert {"moe_a2a_overlap", "overlap_p2p_comm"} <= set(qwen.switches) and "deepep" not in qwen.switches
    assert not {"moe_a2a_overlap", "overlap_p2p_comm", "deepep"} & set(oss.switches)
    assert (BRIDGE_PRECISION[qwen.precision], BRIDGE_PRECISION[oss.precision]) == ("fp8", "bf16")
    assert (qwen.pp, qwen.vp, qwen.ep, qwen.dp, qwen.global_batch // (qwen.dp * qwen.micro_batch)) == (2, 24, 8, 8, 32)
    assert (oss.pp, oss.vp, oss.ep, oss.dp, oss.global_batch // (oss.dp * oss.micro_batch)) == (4, 1, 8, 16, 8)
    assert "alltoall dispatcher" in settings(qwen)
