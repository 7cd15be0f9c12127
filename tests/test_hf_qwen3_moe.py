"""Issue 39, point 3: the published Qwen3-30B-A3B config (tests/data/qwen3_30b_a3b, every layer sparse)
plans with `hf:`. transformers' generic base_model_tp_plan names dense-MLP modules this config lacks:
those entries are dropped; a tp_plan a user wrote that matches nothing is still an error."""

import json
from pathlib import Path

import pytest

import autopar.profile as profile_package
from autopar.cli import main
from autopar.errors import ModelFileError
from autopar.modelfile import load_model_file, resolve_tp_plan
from autopar.profile import profile_model

pytest.importorskip("transformers")

CONFIG = Path(__file__).resolve().parent / "data" / "qwen3_30b_a3b" / "config.json"
REF = f"hf:{CONFIG}"


def test_the_vendored_config_is_the_published_one():
    c = json.loads(CONFIG.read_text())
    assert (c["hidden_size"], c["num_hidden_layers"], c["num_experts"], c["num_experts_per_tok"]) == (2048, 48, 128, 8)
    assert (c["moe_intermediate_size"], c["intermediate_size"], c["num_attention_heads"]) == (768, 6144, 32)
    assert (c["num_key_value_heads"], c["head_dim"], c["vocab_size"], c["max_position_embeddings"]) == (4, 128, 151936,
                                                                                                       40960)
    assert c["mlp_only_layers"] == [] and c["decoder_sparse_step"] == 1 and c["norm_topk_prob"] is True
    assert c["architectures"] == ["Qwen3MoeForCausalLM"] and c["tie_word_embeddings"] is False


def test_the_config_plan_keeps_what_the_model_has_and_drops_what_it_lacks():
    mf = load_model_file(REF)
    model = mf.build(num_hidden_layers=2, seq_len=16)
    plan = mf.tp_plan(model)
    assert plan["layers.1.self_attn.q_proj"] == "colwise" and plan["layers.1.self_attn.o_proj"] == "rowwise"
    assert plan["layers.0.self_attn.k_norm"] == "head_norm" and plan["output"] == "vocab"
    assert not [name for name in plan if ".mlp." in name]  # the dense MLP entries: no such modules
    dense_first = mf.build(num_hidden_layers=2, seq_len=16, mlp_only_layers=[0])
    assert mf.tp_plan(dense_first)["layers.0.mlp.gate_proj"] == "colwise"  # a dense layer keeps its entries
    with pytest.raises(ModelFileError, match="'layers.\\*.mlp.gate_proj' matches no module"):
        resolve_tp_plan(model, {"layers.*.mlp.gate_proj": "colwise"})  # written by a user: still an error


@pytest.fixture(scope="module")
def profiled():
    """The full config profiled once in this process (the CLI would profile it in a child process)."""
    return profile_model(REF)


def test_the_published_config_profiles_at_the_published_size(profiled):
    p = profiled
    assert p.is_moe and p.num_experts == 128 and p.top_k == 8 and p.moe_layers == 48 and p.has_tp_plan
    # the model card: 30.5B parameters in total, 3.3B activated, 29.9B non-embedding (embeddings untied)
    embeddings = 2 * 151936 * 2048
    assert round(p.params / 1e9, 1) == 30.5 and 3.3 <= p.active_params / 1e9 < 3.4
    assert round((p.params - embeddings) / 1e9, 1) == 29.9


def test_search_plans_the_published_config_on_four_dgx_h100_nodes(profiled, capsys, monkeypatch):
    # the CLI profiles an hf: config in a child process (its cache lookup reads no hf: reference): here in this one
    monkeypatch.setattr(profile_package, "profile_isolated", lambda path, args, dtype, timeout: profiled)
    code = main(["search", REF, "--cluster", "dgx-h100", "--nodes", "4", "--method", "rules"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "hf-qwen3_moe on dgx-h100: 4 x 8" in out.out and "30.53 B parameters" in out.out
