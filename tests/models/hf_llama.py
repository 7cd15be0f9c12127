"""HF transformers' LlamaForCausalLM as a model.py: the same architecture as autopar's bundled
Llama, written as HF writes it (``self_attn.q_proj``..., SDPA with ``enable_gqa``, HF's rotary and
RMSNorm classes), with its own ``base_model_tp_plan`` converted to autopar's style strings."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from autopar.zoo import llama as zoo_llama

# HF's ParallelStyle names -> autopar's tp_plan styles
_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_gather_output": "colwise_rep",
           "embedding_rowwise": "vocab"}


def config(size: str = "tiny", **overrides) -> LlamaConfig:
    c = zoo_llama.config(size, **overrides)
    return LlamaConfig(hidden_size=c.hidden, num_hidden_layers=c.layers, num_attention_heads=c.heads,
                       num_key_value_heads=c.kv_heads, intermediate_size=c.ffn, vocab_size=c.vocab,
                       max_position_embeddings=c.seq_len, rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps,
                       attention_dropout=0.0, tie_word_embeddings=False, attn_implementation="sdpa")


def build_model(size: str = "tiny", **overrides):
    return LlamaForCausalLM(config(size, **overrides))


def example_batch(batch_size: int, size: str = "tiny", **overrides):
    return zoo_llama.example_batch(batch_size, size, **overrides)


def loss_fn(output, target):
    logits = output.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def tp_plan(model) -> dict[str, str]:
    """HF's own base_model_tp_plan (prefixed by the base model's attribute), plus the vocab-sharded head."""
    plan = {f"model.{k}": _STYLES[v] for k, v in model.config.base_model_tp_plan.items() if v in _STYLES}
    return {**plan, "lm_head": "vocab"}


def blocks(model):
    return model.model.layers
