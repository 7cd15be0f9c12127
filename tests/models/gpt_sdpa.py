"""A GPT written differently from autopar's bundled one: separate q/k/v projections, torch SDPA
(causal, attention dropout inside the kernel), GeLU MLP as a Sequential, the tensor-parallel plan
written as torch ``ParallelStyle`` objects and converted to autopar's strings. Same architecture,
parameters and FLOPs as ``autopar/zoo/gpt.py`` (the Megatron-LM sizes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autopar.zoo import gpt as zoo_gpt


class SelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.num_heads, self.head_dim, self.p = c.heads, c.hidden // c.heads, c.dropout
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(c.hidden, c.hidden) for _ in range(3))
        self.out_proj = nn.Linear(c.hidden, c.hidden)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (p(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        return self.out_proj(y.transpose(1, 2).flatten(2))


class DecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(c.hidden), nn.LayerNorm(c.hidden)
        self.attn = SelfAttention(c)
        self.mlp = nn.Sequential(nn.Linear(c.hidden, c.ffn), nn.GELU(), nn.Linear(c.ffn, c.hidden))
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class Embeddings(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab, c.hidden), nn.Embedding(c.seq_len, c.hidden)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, tokens):
        return self.drop(self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1], device=tokens.device)))


class Decoder(nn.Module):
    """Top-level names as pipeline stages need them (tok_embeddings, norm, output); blocks in ``h``."""

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.tok_embeddings = Embeddings(c)
        self.h = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.hidden)
        self.output = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        for layer in self.h:
            x = layer(x)
        return self.output(self.norm(x))


def build_model(size: str = "tiny", **overrides):
    return Decoder(zoo_gpt.config(size, **overrides))


def example_batch(batch_size: int, size: str = "tiny", **overrides):
    return zoo_gpt.example_batch(batch_size, size, **overrides)


PARALLEL_PLAN = {"h.*.attn.q_proj": ColwiseParallel(), "h.*.attn.k_proj": ColwiseParallel(),
                 "h.*.attn.v_proj": ColwiseParallel(), "h.*.attn.out_proj": RowwiseParallel(),
                 "h.*.mlp.0": ColwiseParallel(), "h.*.mlp.2": RowwiseParallel()}


def tp_plan(model) -> dict[str, str]:
    """torch's ParallelStyle plan as autopar's style names, with vocab-sharded ends."""
    styles = {ColwiseParallel: "colwise", RowwiseParallel: "rowwise"}
    return {"tok_embeddings.wte": "vocab", **{k: styles[type(v)] for k, v in PARALLEL_PLAN.items()}, "output": "vocab"}


def blocks(model):
    return model.h
