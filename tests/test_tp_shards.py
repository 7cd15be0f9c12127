"""Issue 39, point 6: a tp_plan that shards a fused q/k/v linear whose output the model splits by sizes
from its config (`split([q, kv, kv])`) crashes every rank at the first step; the profile on the meta
device runs the forward on the shards too and refuses it in one line naming the linear and the fix. A
fused projection laid out per head and split after a view (the zoo's GPT, transformers' GPT-2 as
autopar.hf rebuilds it) is accepted."""

import json

import pytest

import autopar.profile as profile_package
from autopar.cli import main
from autopar.errors import ModelFileError
from autopar.profile.profiler import profile_model
from autopar.profile.tp_shards import smallest_degree

MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, KV, VOCAB, SEQ = 64, 4, 2, 128, 16
HD = HIDDEN // HEADS


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(HIDDEN, (HEADS + 2 * KV) * HD, bias=False)
        self.proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        SPLIT
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, s, -1))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_model():
    return Model()


def example_batch(batch_size):
    t = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return t[:, :-1], t[:, 1:]


def tp_plan(model):
    return {"layers.*.qkv": "colwise", "layers.*.proj": "rowwise"}
'''
# q, k and v cut by the config's sizes: 128 features, 64 per rank at tp=2, split as [64, 32, 32]
BY_SIZES = ("q, k, v = self.qkv(x).split([HEADS * HD, KV * HD, KV * HD], dim=-1); "
            "q, k, v = (t.view(b, s, -1, HD).transpose(1, 2) for t in (q, k, v))")
# per kv group, [group, (2 q heads, k, v), head_dim], split after a view: each rank holds whole groups
PER_GROUP = ("g = self.qkv(x).view(b, s, -1, HEADS // KV + 2, HD); q, k, v = g.split([HEADS // KV, 1, 1], dim=3); "
             "q, k, v = (t.flatten(2, 3).transpose(1, 2) for t in (q, k, v))")


def _model(tmp_path, split: str):
    path = tmp_path / "fused.py"
    path.write_text(MODEL.replace("SPLIT", split))
    return path


def test_a_fused_qkv_split_by_config_sizes_is_refused_naming_the_linear_and_the_fix(tmp_path):
    path = _model(tmp_path, BY_SIZES)
    with pytest.raises(ModelFileError) as refused:
        profile_model(path, cache=False)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"{path}:18: tp_plan shards layers.0.qkv column-wise")
    assert "at tp=2 its output (64 of 128 features per rank) breaks split_with_sizes" in message
    assert "split_sizes=[64, 32, 32]" in message and "per head" in message and "leave it out of tp_plan" in message


def test_estimate_refuses_it_in_one_line_before_any_plan(tmp_path, capsys, monkeypatch):
    path = _model(tmp_path, BY_SIZES)
    # the CLI profiles a model file in a child process: here in this one, as the child would
    monkeypatch.setattr(profile_package, "profile_isolated",
                        lambda ref, args, dtype, timeout: profile_model(ref, args, dtype=dtype))
    code = main(["estimate", str(path), "--cluster", "cpu", "--global-batch", "4", "--dp", "1", "--tp", "2",
                 "--micro-batch-size", "4"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autopar: error")]
    assert code == 2 and len(err) == 1 and "layers.0.qkv" in err[0] and "split_with_sizes" in err[0]


def test_the_same_projection_split_per_group_after_a_view_is_accepted(tmp_path):
    p = profile_model(_model(tmp_path, PER_GROUP), cache=False)
    assert p.has_tp_plan


def test_the_zoo_gpt_and_transformers_gpt2_fused_projections_are_accepted(tmp_path):
    assert profile_model("gpt", {"size": "tiny"}, cache=False).has_tp_plan  # wqkv viewed (heads, 3, head_dim)
    pytest.importorskip("transformers")
    from hf_configs import CONFIGS

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["gpt2"]))
    assert profile_model(f"hf:{tmp_path}", cache=False).has_tp_plan  # c_attn rebuilt per head (PerHeadQKV)


def test_the_degree_tried_is_the_smallest_the_shards_allow():
    assert smallest_degree([128, 64]) == 2 and smallest_degree([96, 36]) == 2 and smallest_degree([9, 27]) == 3
    assert smallest_degree([7, 5]) is None
