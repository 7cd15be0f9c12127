"""The mixture-of-experts terms of the cost model (autopar/cost/moe.py) and the published MoE rows."""

from __future__ import annotations

import re
from dataclasses import replace

import numpy as np
import pytest
from conftest import workload
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar import axes
from autopar.cluster import load_cluster
from autopar.cost import estimate
from autopar.cost.coefficients import Coefficients
from autopar.cost.collectives import all_to_all_time
from autopar.cost.moe import (
    MoeKind,
    consecutive_span,
    destinations,
    distinct,
    ep_links,
    fused_permute,
    grouped_efficiency,
    moe_kinds,
)
from autopar.plan import Plan
from autopar.workload import Workload

H100 = load_cluster("dgx-h100", nodes=4)
COEFFS = Coefficients.for_cluster(H100, "torch")


def test_ep_group_inside_a_node_rides_nvlink_and_across_nodes_one_nic_per_gpu():
    """ep 8 of one DGX H100: NVLink 4 (450 GB/s one way, the preset's efficiency), no NIC. ep 32 over 4 nodes:
    each GPU's off-node share through its own 400 Gb/s NIC (50 GB/s), not the ring's 8 NICs."""
    intra, inter, _, per_node = ep_links(H100, 8, 1, COEFFS)
    assert (intra, inter, per_node) == (pytest.approx(450e9 * COEFFS.link("nvlink")), np.inf, 8)
    intra, inter, _, per_node = ep_links(H100, 32, 1, COEFFS)
    assert (inter, per_node) == (pytest.approx(50e9 * COEFFS.link("ib")), 8)
    # ep ranks 4 apart (dp innermost is not where they sit: tp 4 inside): 2 per node
    assert ep_links(H100, 8, 4, COEFFS)[3] == 2
    nbytes = 1e9
    inside = all_to_all_time(nbytes, 8, 8, 370e9, np.inf, 0.0)
    across = all_to_all_time(nbytes, 32, 8, 370e9, 50e9, 0.0)
    assert inside == pytest.approx(nbytes * 7 / 8 / 370e9)
    assert across == pytest.approx(nbytes * 24 / 32 / 50e9)  # the NIC is the bottleneck


@settings(max_examples=60, deadline=None)
@given(st.floats(1e3, 1e10), st.sampled_from([1, 2, 4, 8, 16, 64]), st.floats(1.0, 4.0))
def test_all_to_all_grows_with_bytes_and_is_free_on_one_rank(nbytes, n, more):
    per_node = min(n, 8)
    t = all_to_all_time(nbytes, n, per_node, 400e9, 50e9, 2e-6, 5e-6)
    if n == 1:
        assert t == 0.0
    else:
        assert 0 < t < all_to_all_time(nbytes * more + 1, n, per_node, 400e9, 50e9, 2e-6, 5e-6)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 64), st.floats(1.0, 4096.0))
def test_distinct_destinations_between_one_and_top_k(top_k, bins):
    d = float(distinct(top_k, bins))
    assert 1.0 - 1e-9 <= d <= min(top_k, bins) + 1e-9


@settings(max_examples=80, deadline=None)
@given(st.sampled_from([8, 16, 32, 64, 128, 256]), st.integers(1, 16), st.sampled_from([1, 2, 4, 8, 16, 32, 64]))
def test_consecutive_span_counts_the_bins_of_k_consecutive_experts(experts, top_k, bins):
    """The balanced gate's token i takes experts i*k ... i*k + k - 1 (mod experts): the span over bins of
    experts / bins consecutive experts is the mean over one period of the distinct bins, counted here
    token by token; between 1 and min(k, bins); one bin holds them all at per_bin = experts."""
    top_k, bins = min(top_k, experts), min(bins, experts)
    per_bin = experts // bins
    want = np.mean([len({((i * top_k + j) % experts) // per_bin for j in range(top_k)}) for i in range(experts)])
    got = float(consecutive_span(top_k, experts, per_bin))
    assert got == pytest.approx(want)
    assert 1.0 <= got <= min(top_k, bins)
    assert float(consecutive_span(top_k, experts, experts)) == 1.0


def test_learned_gate_destinations_are_the_uniform_expectation_capped_by_the_node_limit():
    from types import SimpleNamespace

    kind = MoeKind(experts=256, top_k=8, hidden=7168, ffn=2048, params=0.0, flops=0.0)
    ep, per_node = np.array([64.0]), np.array([8.0])
    free = SimpleNamespace(gate="learned", node_limit=0)
    ranks, nodes = destinations(kind, ep, per_node, free)
    assert float(ranks[0]) == pytest.approx(float(distinct(8, 64)))
    assert float(nodes[0]) == pytest.approx(float(distinct(8, 8)))
    ranks, nodes = destinations(kind, ep, per_node, SimpleNamespace(gate="learned", node_limit=4))
    assert float(nodes[0]) == 4.0 and float(ranks[0]) == pytest.approx(float(distinct(8, 32)))
    ranks, nodes = destinations(kind, ep, per_node, SimpleNamespace(gate="balanced", node_limit=0))
    assert (float(ranks[0]), float(nodes[0])) == (2.0, 1.0)  # 8 consecutive of 4 per rank


def test_fused_permute_moves_the_routed_copies_and_the_delivered_tokens_twice():
    """TE's fused permute writes top_k copies of each token and reads the `ranks` copies DeepEP
    delivered; the unpermute reads the top_k copies and writes the delivered ones back."""
    assert fused_permute(1.0, 8, 1.0, 1.0) == 18.0
    assert fused_permute(2e6, 4, 2.0, 1e12) == pytest.approx(2 * 2e6 * 6 / 1e12)


def test_grouped_gemm_pays_whole_tiles_per_expert():
    """Tile quantisation per expert: 8 tokens per expert fill 8 of a 128-row tile; a tile-multiple of
    tokens over enough experts to fill the waves is near 1; more tokens per expert never hurts."""
    sms = 132
    few = grouped_efficiency(np.array([8.0]), 2048, 7168, np.array([32.0]), sms)[0]
    many = grouped_efficiency(np.array([4096.0]), 2048, 7168, np.array([32.0]), sms)[0]
    assert few < 0.2 < 0.9 < many <= 1.0
    m = np.array([16.0, 64.0, 128.0, 512.0, 2048.0])
    eff = grouped_efficiency(m, 768, 2048, np.full(5, 16.0), sms)
    assert np.all(np.diff(eff) >= -1e-12)


# -- the whole cost model on the zoo's MoE --------------------------------------------------------------
@pytest.fixture(scope="module")
def moe16():
    """The zoo's small MoE (16 experts, top-2) on 2 DGX H100 nodes, torch runtime."""
    return workload("moe", cluster="dgx-h100", nodes=2, global_batch=64, size="small")


def _plan(ep: int, **kw) -> Plan:
    return Plan(dp=16, tp=1, pp=1, ep=ep, micro_batch_size=2, num_micro_batches=2, **kw)


def test_expert_parallelism_pays_all_to_all_and_shards_the_experts(moe16):
    one, eight = estimate(moe16, _plan(1)), estimate(moe16, _plan(8))
    assert one.breakdown["ep_comm"] == 0.0 < eight.breakdown["ep_comm"]
    experts = moe16.profile.expert_params
    # ZeRO 0: each rank holds its 1/ep of the experts' 16-bit weights and gradients
    assert one.memory["expert_weights"] == pytest.approx(2 * 2 * experts)
    assert eight.memory["expert_weights"] == pytest.approx(2 * 2 * experts / 8)
    assert eight.memory["dispatch_buffers"] == one.memory["dispatch_buffers"] > 0  # balanced: the same pair
    # across nodes (ep 16) the all-to-all is NIC-bound: slower than inside one node (ep 8)
    assert estimate(moe16, _plan(16)).breakdown["ep_comm"] > eight.breakdown["ep_comm"]


def test_optimizer_states_shard_over_the_expert_data_parallel_group(moe16):
    """ZeRO-2 (FSDP2's sharding; the executor refuses ZeRO-1 with ep > 1): expert Adam moments and
    master weights over edp = dp / ep; ep = dp leaves them whole on each rank (1/ep of the experts, no
    edp sharding), ep 1 shards them over all 16."""
    experts = moe16.profile.expert_params
    for ep in (1, 4, 16):
        est = estimate(moe16, _plan(ep, zero=2))
        assert est.memory["expert_optimizer"] == pytest.approx(12 * experts / ep / (16 // ep))


@settings(max_examples=20, deadline=None)
@given(zero=st.sampled_from([0, 1, 2, 3]), micro_batch=st.sampled_from([1, 2, 4]))
def test_memory_never_grows_with_ep(moe16, zero, micro_batch):
    """The RL masks complete a partial plan with the largest ep as the leanest (the ep knob's `lean`):
    at balance, a larger ep never needs more memory per GPU. ZeRO-1 beside ep runs under Megatron-Core only
    (autopar.capability: autopar's executor refuses it), so it is priced there."""
    w = replace(moe16, runtime="megatron") if zero == 1 else moe16
    peaks = [estimate(w, Plan(dp=16, tp=1, pp=1, ep=ep, zero=zero, micro_batch_size=micro_batch,
                                  num_micro_batches=4 // micro_batch)).peak_memory_bytes for ep in (1, 2, 4, 8, 16)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(peaks, peaks[1:])), peaks


def test_fp8_runs_the_experts_in_fp8_under_megatron_only(monkeypatch):
    """Megatron-Core's fp8 runs the experts as TE's grouped linear in fp8 (faster GEMMs, plus casts);
    autopar's executor converts nn.Linear modules with torchao, which leaves the stacked experts bf16.
    Mixtral's experts (2 layers) on one DGX H100: GEMMs large enough for fp8 to pay."""
    from autopar.cost import moe

    mixtral = workload("moe", cluster="dgx-h100", nodes=1, global_batch=32, size="mixtral-8x7b", layers=2)

    seen = []
    real = moe.pipeline_terms
    monkeypatch.setattr(moe, "pipeline_terms", lambda *a: seen.append(real(*a)) or seen[-1])
    expert_s = {}
    for runtime in ("megatron", "torch"):
        w = replace(mixtral, runtime=runtime)
        for precision in ("bf16", "fp8"):
            seen.clear()
            estimate(w, Plan(dp=8, ep=8, micro_batch_size=2, num_micro_batches=2, precision=precision,
                             fp8_recipe="tensorwise" if precision == "fp8" else "none",
                             compile=precision == "fp8" and runtime == "torch"))
            expert_s[runtime, precision] = float(sum(t["expert_f"].sum() + t["expert_b"].sum() for t in seen))
    assert expert_s["megatron", "fp8"] < expert_s["megatron", "bf16"]
    assert expert_s["torch", "fp8"] == pytest.approx(expert_s["torch", "bf16"])


def test_imbalance_slows_the_busiest_rank(moe16):
    skewed = Workload(moe16.profile, moe16.cluster, moe16.global_batch, expert_imbalance=1.5)
    even, busy = estimate(moe16, _plan(8)), estimate(skewed, _plan(8))
    # the bytes scale by 1.5; the per-call latency does not
    assert 1.3 * even.breakdown["ep_comm"] < busy.breakdown["ep_comm"] <= 1.5 * even.breakdown["ep_comm"]
    assert busy.breakdown["compute"] > even.breakdown["compute"]


def test_a_capacity_factor_caps_the_busiest_rank(moe16):
    """With capacity factor 1.25 an expert drops what exceeds 1.25x its balanced share: an imbalance
    of 2 costs what 1.25 does."""
    import dataclasses

    capped = dataclasses.replace(moe16.profile, capacity_factor=1.25)
    at = lambda profile, skew: estimate(Workload(profile, moe16.cluster, moe16.global_batch,  # noqa: E731
                                                 expert_imbalance=skew), _plan(8)).iteration_time_s
    assert at(capped, 2.0) == pytest.approx(at(capped, 1.25)) == pytest.approx(at(moe16.profile, 1.25))
    assert at(moe16.profile, 2.0) > at(capped, 2.0)


def test_deepep_and_the_a2a_overlap_switch_shrink_the_exposed_all_to_all(moe16):
    """Megatron-Core runtime: DeepEP sends a token once per destination rank (top-2 of 16 experts: fewer
    copies across the 2 nodes), and --overlap-moe-expert-parallel-comm hides it under expert compute."""
    def ep_comm(*switches):
        w = Workload(moe16.profile, moe16.cluster, moe16.global_batch, runtime="megatron", switches=switches)
        return estimate(w, _plan(16)).breakdown["ep_comm"]

    plain = ep_comm()
    assert 0 < ep_comm("deepep") < plain
    assert ep_comm("moe_a2a_overlap") < plain


def test_dense_models_have_no_expert_terms():
    dense = workload("llama", cluster="dgx-h100", nodes=1, global_batch=16, size="tiny")
    est = estimate(dense, Plan(dp=8, tp=1, pp=1, micro_batch_size=1, num_micro_batches=2))
    assert est.breakdown["ep_comm"] == 0.0
    assert all(est.memory[p] == 0.0 for p in ("expert_weights", "expert_optimizer", "dispatch_buffers"))


# -- published rows ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def published_errors():
    from autopar.search.published_moe import MOE_ROWS, predicted_tokens_per_s

    return {row.label: predicted_tokens_per_s(row)[2] / row.tokens_per_s_per_gpu - 1 for row in MOE_ROWS}


@pytest.mark.heavy
def test_published_moe_rows(published_errors):
    """NeMo AutoModel DGX-H100 BF16 (docs/references.md §11), 4 rows, nothing fitted. Issue 14 asks a
    median |error| <= 15% and max <= 25%: the bounds asserted are those that hold today (see
    docs/moe-cost.md for what is left)."""
    errors = np.abs(list(published_errors.values()))
    assert len(errors) >= 4
    assert np.median(errors) <= 0.15, published_errors  # 11.3% today
    assert errors.max() <= 0.25, published_errors  # 18.6% today (GPT-OSS-20B)


def test_published_rows_route_with_the_benchmarks_gate():
    """Every row's config sets fake_balanced_gate: the rows are priced with the zoo's balanced gate, whose
    consecutive experts DeepEP sends a token to once per rank: Qwen3-30B-A3B and GPT-OSS-20B at EP 8 one
    rank; GPT-OSS-120B and DeepSeek-V3 at EP 64 two ranks of one node."""
    from autopar.search.published_moe import MOE_ROWS, moe_workload

    want = {"Qwen3-30B-A3B": (1, 1), "GPT-OSS-20B": (1, 1), "GPT-OSS-120B": (2, 1), "DeepSeek-V3-671B": (2, 1)}
    for row in MOE_ROWS:
        profile = moe_workload(row).profile
        assert profile.gate == "balanced"
        kind = next(k for k in moe_kinds(profile) if k)
        ranks, nodes = destinations(kind, np.array([float(row.ep)]), np.array([min(row.ep, 8.0)]), profile)
        assert (float(ranks[0]), float(nodes[0])) == want[row.model], row.label


# -- search and the Why table -----------------------------------------------------------------------------
@pytest.mark.heavy
def test_search_deepseek_v3_on_32_dgx_h100_picks_expert_parallelism_and_says_why(capsys):
    """Issue 14's acceptance: `autopar search` on the zoo's DeepSeek-V3-like model on 32 DGX H100 nodes
    (256 GPUs) returns a plan with ep > 1, and its Why table compares that degree with ep 1 and the next
    one. Exhaustive method: the acceptance names the plan the cost model ranks first."""
    import json

    from autopar.cli import main

    assert main(["search", "moe", "--model-arg", "size=deepseek-v3", "--cluster", "dgx-h100", "--nodes", "32",
                 "--method", "exhaustive", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    ep = out["plan"]["ep"]
    assert ep > 1
    row = next(r for r in out["why"] if r["knob"] == "ep")
    assert row["chosen"] == f"ep{ep}"
    compared = [int(d) for d in re.findall(r"\bep(\d+) (?:is [+-]|does not fit)", row["instead"])]
    degrees = [d for d in axes.divisors(out["plan"]["dp"]) if 256 % d == 0]  # the experts' divisors too
    nxt = min((d for d in degrees if d > ep), default=max(d for d in degrees if d < ep))
    assert compared == [1, nxt], row
