"""``hf:PATH`` model references: a transformers ``config.json`` (or a local model directory) as a model.py.

The model is built from its config on the meta device (no hub access, no weights) and laid out
as torchtitan lays models out, so the executor's pipeline and tensor parallelism apply unchanged:
``tok_embeddings`` (embed_tokens), ``layers`` (the decoder layers: the pipeline blocks),
``norm`` and ``output`` (lm_head). Parameter names are the base model's, so the model's own
``base_model_tp_plan`` applies as written; transformers' style names are mapped onto autopar's
(:data:`HF_STYLES`) or the plan is refused with the reason (:data:`REFUSED_STYLES`: tensor
parallelism is then off, the profile's note says why).

Families: Llama, Mistral, Qwen2, Qwen3 and Gemma/Gemma2 (decoder layers called with rotary
position embeddings), and GPT-2, whose fused ``c_attn`` is rebuilt per head (:class:`PerHeadQKV`).
Mixtral and Qwen3-MoE: each sparse MoE block (``mlp``) becomes the zoo's MoE layer
(`autopar.zoo.moe.MoE`: softmax router, top-k, renormalised as Mixtral and Qwen3-MoE's
``norm_topk_prob``, dropless SwiGLU experts), the same maths as transformers' block with the
experts stacked as ``w1``/``w2``/``w3``; transformers' block cannot run on the meta device (its
expert loop reads the routing's values), and expert parallelism shards the stacked layout. Their
router and experts are replicated over tp (the config's fused expert styles are left out).
Tied input/output embeddings stay one parameter in one process; across pipeline stages the
executor sums their gradients (:mod:`autopar.executor.tied`).

Imports transformers only when an ``hf:`` reference is loaded: it is an optional extra.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import ModelFileError
from autopar.hf_ref import PREFIX, config_file, is_reference, source_digest  # noqa: F401 (autopar.hf's names too)
from autopar.zoo import moe as zoo_moe
from autopar.zoo import next_token_batch

MOE_FAMILIES = ("mixtral", "qwen3_moe")  # sparse MoE blocks replaced by autopar.zoo.moe.MoE
ROTARY_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", *MOE_FAMILIES)
FAMILIES = (*ROTARY_FAMILIES, "gpt2")

#: transformers' tensor-parallel style names that mean one of autopar's styles (modelfile.TP_STYLES)
HF_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_rep",
    "rowwise_split_input": "rowwise_in",
    "replicated_with_grad_allreduce": "head_norm",
}
#: transformers' style names autopar cannot apply, and why (tensor parallelism is then refused)
REFUSED_STYLES = {
    "packed_colwise": "a fused [gate; up] projection needs a strided column split, which torch's ColwiseParallel "
                      "does not do",
    "packed_rowwise": "a fused projection needs a strided row split, which torch's RowwiseParallel does not do",
    "grouped_gemm": "expert weights are expert-parallel, which is not in autopar's plan space",
    "ep_dispatch_experts": "expert parallelism is not in autopar's plan space",
    "moe_tp_experts": "tensor-parallel experts are not in autopar's plan space",
    "mla_kv_a_proj": "multi-head latent attention's compressed kv projection has no torch ParallelStyle",
    "isolated": "isolated (per-rank) modules have no torch ParallelStyle",
}


def _read_config(path: Path) -> tuple[dict, bytes]:
    try:
        raw = path.read_bytes()
        config = json.loads(raw)
    except (OSError, ValueError) as exc:
        raise ModelFileError(f"{path}: not a readable JSON config ({type(exc).__name__}: {exc})") from exc
    if not isinstance(config, dict):
        raise ModelFileError(f"{path}: a transformers config must be a JSON object")
    family = config.get("model_type")
    if family not in FAMILIES:
        raise ModelFileError(f"{path}: model_type {family!r} is not supported; supported: {', '.join(FAMILIES)} "
                             "(or write a model.py)")
    return config, raw


def _transformers():
    try:
        import transformers  # transformers: heavy, imported on first use
    except ImportError as exc:
        raise ModelFileError("hf: models need the transformers package; pip install transformers "
                             "(README: 'Adding transformers, torchvision or timm')") from exc
    return transformers


def load(ref: str) -> tuple[Path, HFSource, str, str]:
    """What `autopar.modelfile.load_model_file` makes an ``hf:`` reference's ModelFile of: the config's
    path, the model source, its digest and its name."""
    path = config_file(ref)
    config, raw = _read_config(path)
    _transformers()  # installed, or one line saying how
    return path, HFSource(config), source_digest(raw), f"hf-{config['model_type']}"


# -- the model -------------------------------------------------------------------------------------
class HFCausalLM(nn.Module):
    """A transformers causal LM in torchtitan's layout (module doc). ``config`` holds the dims
    the profiler and cost model read; ``seq_len`` is fixed at build time, so a pipeline stage or a
    sequence-parallel shard still knows the positions of the whole sequence."""

    def __init__(self, hf_model, hf_config, seq_len: int, family: str):
        super().__init__()
        self.family, self.seq_len, self.hf_config = family, seq_len, hf_config
        self.embed_scale = None
        self.config = {"hidden": hf_config.hidden_size, "heads": hf_config.num_attention_heads,
                       "kv_heads": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
                       "layers": hf_config.num_hidden_layers, "vocab": hf_config.vocab_size,
                       "ffn": getattr(hf_config, "intermediate_size", None) or 4 * hf_config.hidden_size,
                       "seq_len": seq_len}
        self.std = getattr(hf_config, "initializer_range", 0.02)
        self.final_softcap = getattr(hf_config, "final_logit_softcapping", None)
        if family == "gpt2":
            base = hf_model.transformer
            self.tok_embeddings = GPT2Embeddings(base.wte, base.wpe, base.drop)
            self.layers = base.h
            self.norm = base.ln_f
            for block in self.layers:
                block.attn.__class__ = PerHeadAttention
                block.attn.c_attn = PerHeadQKV(hf_config.n_embd, hf_config.n_head, bias=True)
                block.attn.c_proj = _linear(block.attn.c_proj)
                block.mlp.c_fc, block.mlp.c_proj = _linear(block.mlp.c_fc), _linear(block.mlp.c_proj)
        else:
            base = hf_model.model
            self.tok_embeddings, self.layers, self.norm = base.embed_tokens, base.layers, base.norm
            if hasattr(base.embed_tokens, "embed_scale"):  # Gemma: a plain embedding, scaled in forward
                e = base.embed_tokens  # (tensor parallelism would make its scale buffer a DTensor)
                self.tok_embeddings = nn.Embedding(e.num_embeddings, e.embedding_dim, e.padding_idx)
                self.embed_scale = hf_config.hidden_size ** 0.5
            self.rotary_emb = base.rotary_emb
            for layer in self.layers:  # what the profiler reads tensor-parallel head units from
                layer.self_attn.num_heads = self.config["heads"]
                layer.self_attn.num_key_value_heads = self.config["kv_heads"]
            if not family.startswith("gemma"):  # Gemma's norms scale by (1 + w): keep them
                _torch_rms_norms(self)
            if family in MOE_FAMILIES:
                _zoo_moe_blocks(self, hf_config)
        self.output = hf_model.lm_head
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        self._tie()

    def _tie(self):
        if self.tied:
            self.output.weight = _embedding(self.tok_embeddings).weight

    def init_weights(self):
        """N(0, initializer_range) weights, zero biases, norms reset, rotary tables rebuilt and the
        embeddings re-tied (``to_empty`` gives every module its own new tensors)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=self.std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
            elif type(module).__name__.endswith("RMSNorm"):  # transformers' own: (1 + w) zeros, else ones
                nn.init.zeros_(module.weight) if self.family.startswith("gemma") else nn.init.ones_(module.weight)
        if getattr(self, "rotary_emb", None) is not None:
            with torch.device("cpu"):
                fresh = type(self.rotary_emb)(config=self.hf_config)
            for name, buffer in fresh.named_buffers():
                getattr(self.rotary_emb, name).copy_(buffer)
        self._tie()

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
            if self.embed_scale is not None:  # as transformers: the scale rounded to the weight's dtype
                x = x * x.new_tensor(self.embed_scale)
        layer_args = self._layer_args(x)
        for layer in self.layers:
            if isinstance(layer, nn.Identity):  # another pipeline stage's block
                continue
            if self.family != "gpt2":
                window = _window(layer.self_attn)
                masked = self.hf_config._attn_implementation == "eager" or (window and window < self.seq_len)
                layer_args["attention_mask"] = self._mask(x, window) if masked else None
            x = layer(x, **layer_args)
        if self.norm is not None:
            x = self.norm(x)
        if self.output is None:
            return x
        logits = self.output(x)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def _layer_args(self, x) -> dict:
        if self.family == "gpt2":
            return {}
        positions = torch.arange(self.seq_len, device=x.device)[None]
        return {"position_embeddings": self.rotary_emb(x, positions), "position_ids": positions}

    def _mask(self, x, window: int | None) -> torch.Tensor:
        """The additive causal mask eager attention applies (within ``window`` past tokens if set)."""
        i = torch.arange(self.seq_len, device=x.device)
        keep = i[:, None] >= i[None, :]
        if window:
            keep &= i[:, None] - i[None, :] < window
        return torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(~keep, float("-inf"))[None, None]


def _zoo_moe_blocks(model: HFCausalLM, hf_config) -> None:
    """Each layer's sparse MoE block as the zoo's MoE layer (module doc); dense layers (Qwen3-MoE's
    ``mlp_only_layers``) keep their MLP."""
    experts = getattr(hf_config, "num_local_experts", None) or hf_config.num_experts
    ffn = getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size
    cfg = zoo_moe.MoeConfig(hidden=hf_config.hidden_size, layers=1, heads=model.config["heads"],
                            kv_heads=model.config["kv_heads"], vocab=hf_config.vocab_size, seq_len=model.seq_len,
                            experts=experts, top_k=hf_config.num_experts_per_tok, expert_ffn=ffn,
                            head_dim=getattr(hf_config, "head_dim", None) or 0,
                            norm_topk=bool(getattr(hf_config, "norm_topk_prob", True)))
    for layer in model.layers:
        if type(layer.mlp).__name__.endswith("SparseMoeBlock"):
            layer.mlp = zoo_moe.MoE(cfg)


def _window(attention: nn.Module) -> int | None:
    """The sliding window of a layer's attention (None: attends to the whole past). Narrower than
    the sequence, SDPA needs an explicit mask, so it runs (and is priced) without flash."""
    if hasattr(attention, "sliding_window"):  # Gemma 2, Qwen2: per layer type
        return attention.sliding_window
    return getattr(attention.config, "sliding_window", None)  # Mistral: every layer


def _embedding(module: nn.Module) -> nn.Embedding:
    return module.wte if isinstance(module, GPT2Embeddings) else module


def _linear(conv1d) -> nn.Linear:
    """transformers' Conv1D (weight stored [in, out]) as an nn.Linear (weight [out, in]): what torch's
    ColwiseParallel/RowwiseParallel shard. A checkpoint's Conv1D weight loads transposed."""
    n_in, n_out = conv1d.weight.shape
    return nn.Linear(n_in, n_out, bias=conv1d.bias is not None)


def _torch_rms_norms(model: nn.Module) -> None:
    """transformers' Llama-style RMSNorm (x in fp32, times w) as torch's nn.RMSNorm, the same formula,
    which runs as one fused kernel on a GPU, as the zoo's Llama does."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RMSNorm") and hasattr(child, "variance_epsilon"):
                setattr(parent, name, nn.RMSNorm(child.weight.shape, eps=child.variance_epsilon))


class GPT2Embeddings(nn.Module):
    """GPT-2's token + position embeddings and dropout: one input module for the first stage."""

    def __init__(self, wte, wpe, drop):
        super().__init__()
        self.wte, self.wpe, self.drop = wte, wpe, drop

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.drop(self.wte(tokens) + self.wpe(positions))


class PerHeadQKV(nn.Linear):
    """GPT-2's fused q/k/v projection with output features ordered per head, [head, (q, k, v),
    head_dim], as Megatron-LM stores it: a contiguous column split then gives each tensor-parallel
    rank whole heads with their q, k and v. transformers' Conv1D stores [in, (q, k, v) x hidden]:
    :meth:`from_conv1d_weight` reorders a checkpoint's weight."""

    def __init__(self, hidden: int, heads: int, bias: bool = True):
        super().__init__(hidden, 3 * hidden, bias=bias)
        self.heads = heads

    def from_conv1d_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """A Conv1D c_attn weight [hidden, 3 x hidden] in this layer's [3 x hidden, hidden] order."""
        hidden = weight.shape[0]
        return weight.t().unflatten(0, (3, self.heads, hidden // self.heads)).transpose(0, 1).flatten(0, 2)


class PerHeadAttention(nn.Module):
    """The training forward of transformers' GPT2Attention over a :class:`PerHeadQKV` projection:
    the heads present are whatever this rank holds; causal SDPA as transformers' sdpa path calls it."""

    def forward(self, hidden_states, *args, **kwargs):
        b, s, _ = hidden_states.shape
        q, k, v = self.c_attn(hidden_states).unflatten(-1, (-1, 3, self.head_dim)).unbind(-2)
        p = self.attn_dropout.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           dropout_p=p, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, s, -1))), None


# -- the model.py functions ------------------------------------------------------------------------
class HFSource:
    """build_model / example_batch / tp_plan / blocks of a transformers config, as a model.py
    defines them. Model arguments: ``seq_len`` (default the config's max_position_embeddings /
    n_positions) and any config field, e.g. ``num_hidden_layers=2``."""

    def __init__(self, config: dict):
        self.raw = config
        self.family = config["model_type"]
        self.tp_note = ""
        #: tp_plan entries taken from the config's generic ``base_model_tp_plan``: one naming a module this
        #: config lacks (Qwen3-MoE's dense ``mlp.gate_proj`` with ``mlp_only_layers: []``) is dropped
        self.config_entries: frozenset[str] = frozenset()

    def hf_config(self, overrides: dict):
        config_cls = _transformers().AutoConfig.for_model(self.family).__class__
        known = set(config_cls().to_dict())
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown model argument(s) {', '.join(unknown)}: not fields of a "
                            f"{config_cls.__name__}; use seq_len or config fields such as num_hidden_layers")
        fields = {k: v for k, v in self.raw.items() if k not in ("architectures", "transformers_version")}
        config = config_cls(**{**fields, **overrides})
        softcap = getattr(config, "attn_logit_softcapping", None)
        config._attn_implementation = "eager" if softcap else "sdpa"
        return config

    def seq_len(self, config, seq_len=None) -> int:
        if seq_len is not None:
            return int(seq_len)
        return getattr(config, "max_position_embeddings", None) or config.n_positions

    def build_model(self, seq_len: int | None = None, **overrides) -> HFCausalLM:
        transformers = _transformers()
        config = self.hf_config(overrides)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=config._attn_implementation)
        return HFCausalLM(model, config, self.seq_len(config, seq_len), self.family)

    def example_batch(self, batch_size: int, seq_len: int | None = None, **overrides):
        config = self.hf_config(overrides)
        return next_token_batch(batch_size, config.vocab_size, self.seq_len(config, seq_len))

    def tp_plan(self, model: HFCausalLM) -> dict[str, str]:
        """The config's ``base_model_tp_plan`` (GPT-2: Megatron's plan over the per-head layout) in
        autopar's style names, the head's column split gathered for the loss; {} with ``tp_note``
        set when a style cannot be applied."""
        if self.family == "gpt2":
            plan = {"layers.*.attn.c_attn": "colwise", "layers.*.attn.c_proj": "rowwise",
                    "layers.*.mlp.c_fc": "colwise", "layers.*.mlp.c_proj": "rowwise"}
        else:
            plan = dict(getattr(model.hf_config, "base_model_tp_plan", None) or {})
        if self.family in MOE_FAMILIES:  # the zoo's MoE layer: router and experts replicated over tp
            plan = {k: v for k, v in plan.items() if ".mlp.experts" not in k and not k.endswith(".mlp.gate")}
        refused = {k: v for k, v in plan.items() if v not in HF_STYLES}
        if refused:
            key, style = next(iter(refused.items()))
            why = REFUSED_STYLES.get(style, "no torch ParallelStyle is known for it")
            self.tp_note = f"base_model_tp_plan entry {key!r} has style {style!r}: {why}; planned with tp = 1"
            return {}
        out = {k: HF_STYLES[v] for k, v in plan.items()}
        self.config_entries = frozenset(out)
        if out:
            out["output"] = "vocab"  # transformers' lm_head: colwise_gather_output
            if model.tied:  # one weight: sharded alike at both ends (executor.tied.retie)
                out["tok_embeddings.wte" if self.family == "gpt2" else "tok_embeddings"] = "vocab"
        return out

    def blocks(self, model: HFCausalLM) -> nn.ModuleList | None:
        """The decoder layers, where the config's ``base_model_pp_plan`` (if any) runs embed_tokens,
        then the layers, then norm, as the pipeline stages are cut; None (no pipelining) otherwise."""
        pp_plan = getattr(model.hf_config, "base_model_pp_plan", None)
        if pp_plan and list(pp_plan) != ["embed_tokens", "layers", "norm"]:
            return None
        return model.layers

    @property
    def notes(self) -> list[str]:
        """What the plan prices that a user should know."""
        config = self.hf_config({})
        if getattr(config, "attn_logit_softcapping", None):
            return [f"{self.family}: attention logits are soft-capped, which flash attention does not do: "
                    "attention runs (and is priced) as eager attention that saves the seq x seq "
                    "probabilities"]
        return []

