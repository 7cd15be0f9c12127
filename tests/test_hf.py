"""hf:PATH models (fast, in-process): the adapter computes what transformers computes, the
model's own tensor-parallel plan is used or refused with its reason, search and estimate work
for five families, and Llama-3 8B's config plans like the bundled Llama of that shape."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from conftest import error_lines  # noqa: E402
from hf_configs import CONFIGS, write_configs  # noqa: E402

from autopar.cli import main  # noqa: E402
from autopar.errors import ModelFileError  # noqa: E402
from autopar.hf import PerHeadQKV  # noqa: E402
from autopar.modelfile import load_model_file, materialize  # noqa: E402
from autopar.profile import profile_model  # noqa: E402

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
             "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
             "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
             "tie_word_embeddings": False, "vocab_size": 128256}  # Meta-Llama-3-8B's config.json


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    return write_configs(tmp_path_factory.mktemp("hf"))


def _ours_and_theirs(ref):
    import transformers

    model_file = load_model_file(ref)
    torch.manual_seed(0)
    ours = materialize(model_file.build(), "cpu").eval()
    config = model_file.module.hf_config({})
    theirs = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
    return model_file, ours, theirs.eval()


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3", "gemma2"])
def test_the_adapter_computes_what_transformers_computes(refs, family):
    model_file, ours, theirs = _ours_and_theirs(refs[family])
    renames = {"model.embed_tokens": "tok_embeddings", "model.layers": "layers", "model.norm": "norm",
               "lm_head": "output"}
    state = ours.state_dict()
    theirs.load_state_dict({k: state[_rename(k, renames)] for k in theirs.state_dict()})
    (tokens,), _ = model_file.example_batch(2, device="cpu")
    torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)


def test_gpt2_per_head_qkv_computes_what_transformers_conv1d_computes(refs):
    model_file, ours, theirs = _ours_and_theirs(refs["gpt2"])
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            target = ours.get_parameter(_rename(name, {"transformer.h": "layers", "transformer.wte": "tok_embeddings.wte",
                                                       "transformer.wpe": "tok_embeddings.wpe",
                                                       "transformer.ln_f": "norm", "lm_head": "output"}))
            if name.endswith("attn.c_attn.weight"):
                p.copy_(_conv1d_from_per_head(target, 4))
            elif name.endswith("attn.c_attn.bias"):
                p.copy_(target.unflatten(0, (4, 3, -1)).transpose(0, 1).flatten())
            elif p.dim() == 2 and ".h." in name:  # Conv1D: [in, out]
                p.copy_(target.t())
            else:
                p.copy_(target)
    (tokens,), _ = model_file.example_batch(2, device="cpu")
    torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=1e-5, atol=1e-5)
    # and a checkpoint's Conv1D c_attn weight loads into the per-head layout
    layer = ours.layers[0].attn.c_attn
    conv = theirs.transformer.h[0].attn.c_attn.weight
    torch.testing.assert_close(layer.from_conv1d_weight(conv), layer.weight)


def _rename(name, renames):
    for old, new in renames.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _conv1d_from_per_head(weight, heads):
    """[3 x hidden (per head), hidden] -> Conv1D [hidden, (q, k, v) x hidden]."""
    return weight.unflatten(0, (heads, 3, -1)).transpose(0, 1).flatten(0, 2).t()


def test_per_head_layout_gives_each_tp_rank_whole_heads():
    layer = PerHeadQKV(64, 4)
    rows = torch.arange(3 * 64).view(3, 4, 16)  # transformers' order: q, k, v, each heads x head_dim
    per_head = layer.from_conv1d_weight(rows.flatten().float()[None].expand(64, -1)).t()[0].long()
    first_half = per_head[: 3 * 64 // 2]  # tp rank 0 of 2
    assert set(first_half.tolist()) == set(rows[:, :2].flatten().tolist())  # q, k and v of heads 0 and 1


def test_the_models_own_tp_plan_is_used_and_qwen3_head_norms_are_mapped(refs):
    model_file = load_model_file(refs["qwen3"])
    model = model_file.build()
    plan = model_file.tp_plan(model)
    assert plan["layers.0.self_attn.q_proj"] == "colwise" and plan["layers.3.mlp.down_proj"] == "rowwise"
    assert plan["layers.1.self_attn.q_norm"] == "head_norm"  # transformers: replicated_with_grad_allreduce
    assert plan["output"] == "vocab" and plan["tok_embeddings"] == "vocab"  # tied: sharded alike


def test_a_style_autopar_cannot_apply_is_refused_with_its_reason(refs):
    model_file = load_model_file(refs["llama"])
    model = model_file.build()
    model.hf_config.base_model_tp_plan = {**model.hf_config.base_model_tp_plan, "layers.*.mlp.gate_proj": "packed_colwise"}
    assert model_file.tp_plan(model) == {}
    assert "packed_colwise" in model_file.module.tp_note and "strided" in model_file.module.tp_note


@pytest.mark.parametrize("family", sorted(CONFIGS))
@pytest.mark.slow
def test_search_and_estimate_every_family(refs, family, capsys, tmp_path):
    common = [refs[family], "--cluster", "cpu", "--nodes", "1", "--gpus-per-node", "4", "--precision", "fp32"]
    assert main(["search", *common, "--global-batch", "8", "-o", str(tmp_path / "p.json"), "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["workload"]["model"] == f"hf-{family}" and found["workload"]["layers"] == 4
    assert main(["estimate", refs[family], "--cluster", "cpu", "--plan", str(tmp_path / "p.json"), "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)
    assert estimate["iteration_time_s"] == pytest.approx(found["estimate"]["iteration_time_s"], rel=1e-9)


def test_gemma_softcapped_attention_is_said_and_priced_as_eager(refs):
    gemma = profile_model(refs["gemma2"], {}, dtype="fp32", cache=False)
    assert gemma.notes[0].startswith("gemma2: attention logits are soft-capped, which flash attention does not do")
    assert all(b.attn_core_bytes > 0 for b in gemma.layers)  # the seq x seq probabilities are saved
    llama = profile_model(refs["llama"], {}, dtype="fp32", cache=False)
    assert all(b.attn_core_bytes < g.attn_core_bytes for b, g in zip(llama.layers, gemma.layers))


@pytest.mark.slow
def test_llama3_8b_config_plans_like_the_bundled_llama(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    results = []
    for model in (["hf:" + str(tmp_path)], ["llama", "--model-arg", "size=llama3-8b"]):
        assert main(["search", *model, "--nodes", "4", "--global-batch", "512", "--method", "exhaustive",
                     "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    hf, zoo = results
    assert hf["plan"] == zoo["plan"]
    assert hf["estimate"]["iteration_time_s"] == pytest.approx(zoo["estimate"]["iteration_time_s"], rel=0.03)
    assert hf["workload"]["params"] == zoo["workload"]["params"]


@pytest.mark.parametrize("content, message", [
    (None, "no such transformers config"),
    ("{not json", "not a readable JSON config"),
    ('{"model_type": "t5"}', "model_type 't5' is not supported"),
])
@pytest.mark.slow
def test_bad_hf_references_are_one_line_errors(tmp_path, capsys, content, message):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    ref = "hf:" + str(tmp_path / ("config.json" if content is not None else "missing"))
    assert main(["search", ref, "--global-batch", "8"]) == 2
    err = error_lines(capsys.readouterr().err)
    assert len(err) == 1 and message in err[0], err
    with pytest.raises(ModelFileError):
        load_model_file(ref)


def test_unknown_model_arguments_name_the_config_class(refs):
    with pytest.raises(ModelFileError, match="not fields of a LlamaConfig"):
        load_model_file(refs["llama"]).build(num_layerz=2)


def test_the_pipeline_split_follows_base_model_pp_plan(refs):
    from autopar.executor.limits import model_limits

    model_file = load_model_file(refs["llama"])
    model = model_file.build()
    assert model_file.blocks(model) is model.layers  # embed_tokens -> layers -> norm
    model.hf_config.base_model_pp_plan = {"embed_tokens": None, "layers": None, "extra": None, "norm": None}
    assert model_file.blocks(model) is None
    assert "pp" in model_limits(model, model_file.blocks(model), {})


@pytest.mark.parametrize("family, tied", [("llama", False), ("qwen3", True), ("gemma2", True), ("gpt2", True)])
def test_tied_word_embeddings_are_one_weight_in_the_profile(refs, family, tied):
    """tie_word_embeddings (gpt2 and gemma2 by default): the head's weight is the embedding's, counted
    once, and priced as a copy on the last pipeline stage (tests/test_cost_tied.py)."""
    p = profile_model(refs[family], {}, dtype="fp32", cache=False)
    vocab, hidden = p.dims["vocab"], p.dims["hidden"]
    assert (p.tied_params, p.tied_tp_params) == ((vocab * hidden,) * 2 if tied else (0, 0))
    assert p.head.params < vocab * hidden if tied else p.head.params >= vocab * hidden


def test_a_profiled_config_is_found_in_the_cache_from_its_bytes(tmp_path):
    """`autopar search hf:...` then `autopar estimate hf:...`: the second finds the first's profile from the
    config's bytes (no transformers import, no profiling); an edited config or another dtype is a miss."""
    from autopar.profile import cache

    config = {**CONFIGS["llama"], "vocab_size": CONFIGS["llama"]["vocab_size"] + 8}  # in no other test's cache
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    ref = f"hf:{tmp_path / 'a'}"
    assert cache.lookup(ref, {}, "fp32") is None
    measured = profile_model(ref, {}, dtype="fp32")
    hit = cache.lookup(ref, {}, "fp32")
    assert hit is not None and hit.digest == measured.digest and hit.params == measured.params
    assert cache.lookup(f"hf:{tmp_path / 'a' / 'config.json'}", {}, "fp32").digest == measured.digest
    assert cache.lookup(ref, {}, "bf16") is None
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    assert cache.lookup(f"hf:{tmp_path / 'b'}", {}, "fp32") is None
    assert cache.lookup(f"hf:{tmp_path / 'missing'}", {}, "fp32") is None  # the loader says what is wrong
