"""A Llama written differently from autopar's bundled one: one fused q/k/v projection split by
head counts, SDPA called with ``enable_gqa=True`` (no repeated K/V), rotary by complex multiply,
RMSNorm and SwiGLU by hand. Same architecture, parameters and FLOPs as ``autopar/zoo/llama.py``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo import llama as zoo_llama


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim), rotated as complex pairs."""
    s, d = x.shape[-2], x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), freqs)
    rot = torch.polar(torch.ones_like(angles), angles)
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(xc * rot).flatten(-2).type_as(x)


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = c.heads, c.kv_heads, c.hidden // c.heads, c.rope_theta
        self.norm1, self.norm2 = RMSNorm(c.hidden, c.norm_eps), RMSNorm(c.hidden, c.norm_eps)
        self.qkv = nn.Linear(c.hidden, (c.heads + 2 * c.kv_heads) * self.head_dim, bias=False)
        self.proj = nn.Linear(c.hidden, c.hidden, bias=False)
        self.gate_up = nn.Linear(c.hidden, 2 * c.ffn, bias=False)
        self.down = nn.Linear(c.ffn, c.hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, -1, self.head_dim).transpose(1, 2)
        kv = (qkv.shape[1] * self.kv_heads) // (self.heads + 2 * self.kv_heads)  # local heads under TP
        q, k, v = qkv.split([qkv.shape[1] - 2 * kv, kv, kv], dim=1)
        y = F.scaled_dot_product_attention(rope(q, self.theta), rope(k, self.theta), v, is_causal=True,
                                           enable_gqa=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Model(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.layers))
        self.final_norm = RMSNorm(c.hidden, c.norm_eps)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.final_norm(x))


def build_model(size: str = "tiny", **overrides):
    return Model(zoo_llama.config(size, **overrides))


def example_batch(batch_size: int, size: str = "tiny", **overrides):
    return zoo_llama.example_batch(batch_size, size, **overrides)


def tp_plan(model) -> dict[str, str]:
    return {"embed": "vocab", "layers.*.qkv": "colwise", "layers.*.proj": "rowwise",
            "layers.*.gate_up": "colwise", "layers.*.down": "rowwise", "lm_head": "vocab"}


def blocks(model):
    return model.layers
