"""The built-in models: every size is consistent, builds on meta, and the tiny ones train and split."""

import pytest
import torch

from autopar import zoo
from autopar.errors import ModelFileError
from autopar.modelfile import load_model_file, materialize

MODELS = {name: load_model_file(name) for name in zoo.MODELS}


@pytest.mark.parametrize("name", zoo.MODELS)
def test_every_size_has_a_valid_config(name):
    module = MODELS[name].module
    assert module.DEFAULT_SIZE in module.SIZES and "tiny" in module.SIZES
    for size in module.SIZES:
        cfg = module.config(size)
        if hasattr(cfg, "heads"):
            assert cfg.hidden % cfg.heads == 0, size


@pytest.mark.parametrize("name", zoo.MODELS)
@pytest.mark.parametrize("size", ["tiny", None])
def test_builds_on_meta_with_a_working_example_batch(name, size):
    mf = MODELS[name]
    args = {"size": size} if size else {}
    model = mf.build(**args)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert mf.blocks(model) is model.layers and len(model.layers) == model.config.layers
    inputs, targets = mf.example_batch(2, **args)
    loss = mf.loss_fn(model(*inputs), targets)
    assert loss.shape == () and loss.device.type == "meta"
    assert mf.has_tp_plan == (name != "resnet")
    mf.tp_plan(model)  # every entry names a module of the model


@pytest.mark.parametrize("name", zoo.MODELS)
def test_pipeline_stages_compose_to_the_whole_model(name):
    """A stage is the model with the other stages' parts set to None (the torchtitan convention)."""
    mf = MODELS[name]
    torch.manual_seed(0)
    model = materialize(mf.build(size="tiny", **({"dropout": 0.0} if name in ("gpt", "bert") else {})), "cpu")
    model.eval()
    inputs, _ = mf.example_batch(2, device="cpu", size="tiny")
    with torch.no_grad():
        whole = model(*inputs)
        parts = {k: getattr(model, k) for k in ("tok_embeddings", "layers", "norm", "output")}
        model.output, model.norm = None, None
        model.layers = torch.nn.ModuleList(parts["layers"][:2])
        hidden = model(*inputs)
        model.tok_embeddings, model.norm, model.output = None, parts["norm"], parts["output"]
        model.layers = torch.nn.ModuleList(parts["layers"][2:])
        assert torch.allclose(model(hidden), whole, atol=1e-5)


def test_tiny_gpt_trains_on_cpu():
    mf = MODELS["gpt"]
    torch.manual_seed(0)
    model = materialize(mf.build(size="tiny"), "cpu")
    inputs, targets = mf.example_batch(8, device="cpu", size="tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = mf.loss_fn(model(*inputs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_gpt_attention_split_by_heads_matches_the_whole():
    """Column-wise split of the fused QKV projection hands each rank whole heads (layout heads, 3, d)."""
    from autopar.zoo.gpt import Attention

    torch.manual_seed(0)
    full = Attention(64, 4, dropout=0.0, causal_len=16)
    x = torch.randn(2, 16, 64)
    halves = []
    for rank in range(2):
        part = Attention(64, 4, dropout=0.0, causal_len=16)
        part.wqkv, part.wo = torch.nn.Linear(64, 96), torch.nn.Linear(32, 64)  # this rank's shards
        rows = slice(rank * 96, (rank + 1) * 96)  # 2 of 4 heads x (q, k, v) x 16
        cols = slice(rank * 32, (rank + 1) * 32)
        with torch.no_grad():
            part.wqkv.weight.copy_(full.wqkv.weight[rows])
            part.wqkv.bias.copy_(full.wqkv.bias[rows])
            part.wo.weight.copy_(full.wo.weight[:, cols])
            part.wo.bias.zero_()
        halves.append(part(x))
    assert torch.allclose(halves[0] + halves[1] + full.wo.bias, full(x), atol=1e-5)


def test_llama_gqa_shapes_and_bert_masking():
    llama = MODELS["llama"].build(size="tiny")
    attn = llama.layers[0].attention
    assert (attn.n_heads, attn.n_kv_heads, attn.wk.out_features) == (4, 2, 32)
    (tokens,), targets = MODELS["bert"].example_batch(4, device="cpu", size="tiny", seq_len=64)
    predicted = targets != -100
    assert 0 < predicted.float().mean() < 0.5
    assert (tokens[predicted] == 3).all() and (targets[~predicted] == -100).all()


def test_llama_squared_relu_mlp_is_nemotrons():
    """`mlp="squared_relu"`: w2(relu(w1 x)^2), two matrices and no gate, nothing of w3 in the plan."""
    llama = MODELS["llama"]
    model = materialize(llama.build(size="tiny", mlp="squared_relu"), "cpu")
    ff = model.layers[0].feed_forward
    assert not hasattr(ff, "w3") and sum(p.numel() for p in ff.parameters()) == 2 * 64 * 192
    x = torch.randn(2, 64)
    assert torch.allclose(ff(x), ff.w2(torch.relu(ff.w1(x)) ** 2))
    assert not any(".w3" in name for name in llama.tp_plan(model))
    with pytest.raises(ModelFileError, match="squared_relu"):
        llama.build(size="tiny", mlp="geglu")


def test_resnet50_layout():
    model = MODELS["resnet"].build()
    assert len(model.layers) == 16
    assert [b.downsample is not None for b in model.layers].count(True) == 4
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(25.56e6, rel=0.01)  # torchvision


def test_vit_sequence_and_size_errors():
    vit = MODELS["vit"].module
    assert vit.config("vit-b16").seq_len == 197 and vit.config("vit-h14").seq_len == 257
    with pytest.raises(ValueError, match="197"):
        vit.config("vit-b16", seq_len=1024)
    with pytest.raises(ValueError, match="unknown size"):
        vit.config("vit-x")
    with pytest.raises(TypeError, match="unknown model argument"):
        MODELS["gpt"].module.config(hiddne=3)
    with pytest.raises(ValueError, match="model argument layers=-1: layers must be at least 1"):
        MODELS["gpt"].module.config(layers=-1)  # named, not a tensor-parallel plan that then matches nothing
    assert MODELS["gpt"].module.config(layers=2).layers == 2


def test_zoo_paths():
    assert zoo.path("llama").name == "llama.py"
    with pytest.raises(ValueError):
        zoo.path("alexnet")
