"""Issue 14, points 1-3: the zoo's MoE model (shapes, router, dropless experts), its profile
fields, HF MoE configs through hf:, and the ep knob of the plan space."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar import knobs
from autopar.capability import Target, refusal
from autopar.cluster import load_cluster
from autopar.errors import AutoparError, PlanError
from autopar.plan import Plan
from autopar.profile import profile_model
from autopar.workload import Workload
from autopar.zoo import moe

BILLION = 1e9


def _counts(size: str, **overrides) -> tuple[float, float, float]:
    """(total, active, embedding) parameters of a zoo MoE size, built on meta."""
    with torch.device("meta"):
        model = moe.build_model(size, **overrides)
    cfg = model.config
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    embed = model.tok_embeddings.weight.numel()
    return total, total - routed + routed * cfg.top_k / cfg.experts, embed


@pytest.mark.parametrize("size, total, active, tolerance", [
    ("mixtral-8x7b", 46.7, 12.9, 0.01),  # Mistral AI: 46.7B total, 12.9B active
    ("qwen3-30b-a3b", 30.5, 3.3, 0.02),  # Qwen3 model card: 30.5B total, 3.3B activated
    ("gpt-oss-120b", 116.8, 5.13, 0.01),  # OpenAI model card: 116.8B total, 5.13B active (embedding excluded)
    ("deepseek-v3", 671, 37, 0.09),  # 671B / 37B; MLA simplified to GQA (+24% attention parameters, module doc)
])
def test_published_sizes_have_the_published_parameter_counts(size, total, active, tolerance):
    got_total, got_active, embed = _counts(size)
    if size == "gpt-oss-120b":
        got_active -= embed  # OpenAI counts the active parameters without the embedding table
    assert got_total / BILLION == pytest.approx(total, rel=tolerance)
    assert got_active / BILLION == pytest.approx(active, rel=tolerance)


def test_deepseek_v3_shape():
    cfg = moe.config("deepseek-v3")
    assert (cfg.experts, cfg.top_k, cfg.shared_experts, cfg.expert_ffn) == (256, 8, 1, 2048)
    assert (cfg.layers, cfg.dense_layers, cfg.dense_ffn, cfg.hidden) == (61, 3, 18432, 7168)
    assert (cfg.score, cfg.route_groups, cfg.route_group_limit) == ("sigmoid", 8, 4)


def _reference(layer: moe.MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the weighted sum of its top-k experts' SwiGLU, plus the shared experts."""
    tokens = x.reshape(-1, x.shape[-1])
    weights, index = layer.router(tokens, x.shape[-2])
    e = layer.experts
    b1, b2, b3 = ((b if b is not None else torch.zeros(e.num_experts, 1, dtype=x.dtype)) for b in (e.b1, e.b2, e.b3))

    def expert(i, x):
        return (torch.nn.functional.silu(x @ e.w1[i].T + b1[i]) * (x @ e.w3[i].T + b3[i])) @ e.w2[i].T + b2[i]

    out = []
    for t in range(tokens.shape[0]):
        y = sum(weights[t, j] * expert(i, tokens[t]) for j, i in enumerate(index[t].tolist()))
        out.append(y + (layer.shared_experts(tokens[t]) if layer.shared_experts is not None else 0))
    return torch.stack(out).view(x.shape)


@pytest.mark.parametrize("overrides", [{}, {"router_skew": 0.5}, {"score": "sigmoid", "route_groups": 4,
                                                                  "route_group_limit": 2},
                                       {"expert_bias": True}, {"gate": "balanced"}])
def test_dropless_dispatch_and_combine_equal_the_per_token_sum(overrides):
    torch.manual_seed(0)
    layer = moe.MoE(moe.config("tiny", **overrides))
    layer.router.reset_buffers()
    x = torch.randn(2, 8, 64, dtype=torch.float64)
    layer.double()
    for b in (layer.experts.b1, layer.experts.b2, layer.experts.b3):
        if b is not None:  # zero at init: make them count
            torch.nn.init.normal_(b)
    torch.testing.assert_close(layer(x), _reference(layer, x))
    assert sum(layer.last_counts) == 2 * 8 * 2  # dropless: every token reaches its top-2 experts


@settings(max_examples=25, deadline=None)
@given(experts=st.sampled_from([4, 8, 16]), top_k=st.integers(1, 4), groups=st.sampled_from([1, 2, 4]),
       limit=st.integers(0, 4), score=st.sampled_from(moe.SCORES), seed=st.integers(0, 2**16))
def test_router_invariants(experts, top_k, groups, limit, score, seed):
    """top_k distinct experts a token, weights summing to one, at most route_group_limit groups."""
    limit = min(limit, groups)
    if limit and limit * experts // groups < top_k or top_k > experts:
        return
    torch.manual_seed(seed)
    cfg = moe.MoeConfig(hidden=16, layers=1, heads=2, kv_heads=1, vocab=8, seq_len=4, experts=experts, top_k=top_k,
                        expert_ffn=8, score=score, route_groups=groups, route_group_limit=limit)
    router = moe.Router(cfg)
    weights, index = router(torch.randn(32, 16))
    assert index.shape == (32, top_k) and all(len(set(row)) == top_k for row in index.tolist())
    torch.testing.assert_close(weights.sum(-1), torch.ones(32))
    if limit:
        assert max(len({i * groups // experts for i in row}) for row in index.tolist()) <= limit


@settings(max_examples=40, deadline=None)
@given(experts=st.sampled_from([4, 8, 32, 128]), top_k=st.integers(1, 8), batch=st.integers(1, 3),
       seed=st.integers(0, 99))
def test_balanced_gate_is_the_benchmark_gate(experts, top_k, batch, seed):
    """NeMo AutoModel's fake balanced gate: the token at sequence index i takes experts i*k ... i*k + k - 1
    (mod experts), the same whatever the batch around it, and every expert gets the same load over a
    sequence that is a multiple of experts / gcd(experts, k) long."""
    top_k = min(top_k, experts)
    seq = experts  # a multiple of the gate's period
    torch.manual_seed(seed)
    cfg = moe.MoeConfig(hidden=16, layers=1, heads=2, kv_heads=1, vocab=8, seq_len=seq, experts=experts, top_k=top_k,
                        expert_ffn=8, gate="balanced")
    router = moe.Router(cfg)
    tokens = torch.randn(batch * seq, 16)
    weights, index = router(tokens, seq)
    for t, row in enumerate(index.tolist()):
        assert row == [((t % seq) * top_k + j) % experts for j in range(top_k)]
    assert torch.bincount(index.reshape(-1), minlength=experts).unique().numel() == 1  # balanced
    torch.testing.assert_close(weights.sum(-1), torch.ones(batch * seq))
    alone, _ = router(tokens[:seq], seq)
    torch.testing.assert_close(weights[:seq], alone)  # a sequence routes the same alone or in a batch


def test_balanced_gate_refuses_a_node_limit():
    with pytest.raises(ValueError, match="balanced"):
        moe.config("deepseek-v3", gate="balanced")
    assert moe.config("deepseek-v3", gate="balanced", route_group_limit=0).gate == "balanced"


def test_meta_routing_is_force_balanced():
    index = torch.empty(37, 3, dtype=torch.long, device="meta")
    counts = moe.expert_counts(index, 8)
    assert sum(counts) == 111 and max(counts) - min(counts) <= 1


def test_profile_fields_of_the_tiny_moe(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    p = profile_model("moe", {"size": "tiny"})
    cfg = moe.config("tiny")
    seq, h, k, e, f = cfg.seq_len, cfg.hidden, cfg.top_k, cfg.experts, cfg.expert_ffn
    dense, sparse = p.layers
    assert (dense.count, dense.experts, dense.expert_flops, dense.dispatch_bytes) == (1, 0, 0.0, 0.0)
    assert (sparse.count, sparse.experts, sparse.top_k, sparse.expert_ffn) == (3, e, k, f)
    assert sparse.router_flops == 2 * seq * h * e
    assert sparse.expert_flops == 2 * seq * k * 3 * h * f
    assert sparse.dispatch_bytes == seq * k * h * 2  # bf16
    assert sparse.expert_params == 3 * e * h * f and sparse.shared_params == 3 * h * f
    assert p.is_moe and p.num_experts == e and p.top_k == k and p.moe_layers == 3
    assert p.expert_params == 3 * sparse.expert_params
    assert p.active_params == p.params - p.expert_params + p.expert_params * k // e
    assert p.capacity_factor == 0.0 and p.node_limit == 0  # dropless, no node limit
    # the measured forward FLOPs hold the expert FLOPs the field states: top-4 adds exactly the difference
    p4 = profile_model("moe", {"size": "tiny", "top_k": 4})
    assert p4.layers[1].fwd_flops - sparse.fwd_flops == pytest.approx(p4.layers[1].expert_flops - sparse.expert_flops)
    assert profile_model("moe", {"size": "deepseek-v3"}).node_limit == 4


def test_a_dense_model_has_no_moe_figures(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    p = profile_model("llama", {"size": "tiny"})
    assert not p.is_moe and p.num_experts == 0 and p.active_params == p.params and p.expert_params == 0
    assert all(b.experts == b.expert_flops == b.dispatch_bytes == b.router_flops == 0 for b in p.blocks)


HF_MOE = {
    "mixtral": {"model_type": "mixtral", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 16,
                "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                  "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                  "vocab_size": 128, "max_position_embeddings": 16, "num_experts": 8, "num_experts_per_tok": 2,
                  "mlp_only_layers": [0], "norm_topk_prob": True},
}


@pytest.mark.parametrize("family", HF_MOE)
def test_hf_moe_configs_profile_on_meta(family, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path / "cache"))
    config = HF_MOE[family]
    (tmp_path / "config.json").write_text(json.dumps(config))
    p = profile_model(f"hf:{tmp_path}")
    experts = config.get("num_local_experts") or config["num_experts"]
    ffn = config.get("moe_intermediate_size") or config["intermediate_size"]
    assert p.is_moe and p.num_experts == experts and p.top_k == 2
    assert p.moe_layers == config["num_hidden_layers"] - len(config.get("mlp_only_layers", []))
    assert p.expert_params == p.moe_layers * 3 * experts * 64 * ffn
    assert p.has_tp_plan  # attention (and dense MLPs) tensor-parallel; router and experts replicated


def _workload(profile, batch=16, runtime="torch") -> Workload:
    return Workload(profile, load_cluster("cpu"), batch, runtime=runtime)


@pytest.mark.parametrize("args, dp, want", [({"size": "tiny"}, 4, [1, 2, 4]), ({"size": "tiny", "experts": 6}, 4, [1, 2]),
                                            ({"size": "tiny"}, 2, [1, 2]), ({"size": "tiny"}, 1, [1])])
def test_ep_choices_divide_dp_and_the_experts(args, dp, want, tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    w = _workload(profile_model("moe", args))
    assert knobs.knob("ep").choices(w, {"dp": dp}) == want
    if dp > 1:  # what the executor refuses with ep (ZeRO-1, sequence parallelism) is left out
        assert knobs.knob("zero").choices(w, {"dp": dp, "ep": 2}) == [0, 2, 3]
        assert knobs.knob("zero").choices(w, {"dp": dp, "ep": 1}) == [0, 1, 2, 3]
        # nor sequence parallelism for an MoE model at any ep: tp ranks would route different tokens
        assert knobs.knob("sequence_parallel").choices(w, {"tp": 2}) == [False]
        # the executor splits dp alone for experts: no ep beside context parallelism (autopar.capability's rule
        # for ep; Megatron-Core runs it)
        assert knobs.knob("ep").choices(w, {"dp": dp, "cp": 2}) == [1]
        assert "ep=2 with cp=2: the executor does not combine them" in refusal("ep", Target.of(w), 2, {"cp": 2})
        assert refusal("ep", Target.of(_workload(w.profile, runtime="megatron")), 2, {"cp": 2}) is None


def test_ep_is_one_for_a_dense_model_and_round_trips_in_plan_json(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    w = _workload(profile_model("llama", {"size": "tiny"}))
    assert knobs.knob("ep").choices(w, {"dp": 4}) == [1]
    plan = Plan(dp=4, ep=2, micro_batch_size=4)
    assert Plan.from_json(plan.to_json()) == plan and "ep2" in plan.describe()
    assert Plan.from_dict({k: v for k, v in Plan(dp=4, micro_batch_size=4).to_dict().items() if k != "ep"}).ep == 1


def test_expert_imbalance_is_a_workload_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CACHE_DIR", str(tmp_path))
    p = profile_model("moe", {"size": "tiny"})
    assert _workload(p).expert_imbalance == 1.0
    with pytest.raises(AutoparError, match="at least 1.0"):
        Workload(p, load_cluster("cpu"), 16, expert_imbalance=0.5)
