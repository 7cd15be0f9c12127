"""GPT-2 / GPT-3 / Megatron-LM style decoder: learned positions, pre-LayerNorm, GeLU MLP, dropout.

Laid out as torchtitan lays out its models so a pipeline stage is this model with the other
stages' parts removed: ``tok_embeddings`` (token + position embedding), ``layers`` (a ModuleList
of blocks taking and returning one tensor), ``norm`` and ``output`` (untied), any of which may be
None. Attention is written out (q@kᵀ, scale, causal masked_fill, softmax, dropout, @v) instead of
F.scaled_dot_product_attention so that the tensors saved for backward are the ones Korthikanti
et al. count: s·b·h·(34 + 5·a·s/h) bytes per layer in 16-bit (docs/references.md §2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo import StagedModel, context_keys, next_token_batch, sequence_sharded, sized_config, token_positions


@dataclass(frozen=True)
class GPTConfig:
    hidden: int
    layers: int
    heads: int
    vocab: int
    seq_len: int
    ffn: int = 0  # 0: 4·hidden
    dropout: float = 0.1

    def __post_init__(self):
        if not self.ffn:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")


def _gpt(hidden, layers, heads, vocab=50257, seq_len=2048):
    return dict(hidden=hidden, layers=layers, heads=heads, vocab=vocab, seq_len=seq_len)


def _megatron(heads, hidden, layers):
    """A row of Megatron-LM SC'21 Table 1 / Korthikanti et al. Table 5 (docs/references.md §1, §2)."""
    return _gpt(hidden, layers, heads, vocab=51200, seq_len=2048)


SIZES = {
    "tiny": _gpt(64, 4, 4, vocab=256, seq_len=32),
    # GPT-2 (Radford et al. 2019)
    "gpt2-small": _gpt(768, 12, 12, seq_len=1024),
    "gpt2-medium": _gpt(1024, 24, 16, seq_len=1024),
    "gpt2-large": _gpt(1280, 36, 20, seq_len=1024),
    "gpt2-xl": _gpt(1600, 48, 25, seq_len=1024),
    # GPT-3 (Brown et al. 2020, Table 2.1); 1.3b and 13b use 16 / 40 heads of 128 so heads divide
    # hidden (the paper's 24 heads and d_model 5140 do not).
    "gpt3-125m": _gpt(768, 12, 12),
    "gpt3-350m": _gpt(1024, 24, 16),
    "gpt3-760m": _gpt(1536, 24, 16),
    "gpt3-1.3b": _gpt(2048, 24, 16),
    "gpt3-2.7b": _gpt(2560, 32, 32),
    "gpt3-6.7b": _gpt(4096, 32, 32),
    "gpt3-13b": _gpt(5120, 40, 40),
    "gpt3-175b": _gpt(12288, 96, 96),
    # Megatron-LM SC'21 Table 1 (heads, hidden, layers), vocabulary 51200, sequence 2048
    "1.7b": _megatron(24, 2304, 24),
    "3.6b": _megatron(32, 3072, 30),
    "7.5b": _megatron(32, 4096, 36),
    "18.4b": _megatron(48, 6144, 40),
    "39.1b": _megatron(64, 8192, 48),
    "76.1b": _megatron(80, 10240, 60),
    "145.6b": _megatron(96, 12288, 80),
    "310.1b": _megatron(128, 16384, 96),
    "529.6b": _megatron(128, 20480, 105),
    "1t": _megatron(160, 25600, 128),
    # Korthikanti et al. 2022 Table 5 (530b and 1t are the rows above)
    "22b": _megatron(64, 6144, 48),
    "175b": _megatron(96, 12288, 96),
}
DEFAULT_SIZE = "gpt2-small"


def config(size: str = DEFAULT_SIZE, **overrides) -> GPTConfig:
    return sized_config(GPTConfig, SIZES, size, overrides)


class Embedding(nn.Module):
    """Token plus learned position embedding, then dropout: one module, one tensor out."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens):
        return self.drop(self.tok(tokens) + self.pos(token_positions(tokens)))


class Attention(nn.Module):
    """Multi-head self-attention, optionally causal, written out op by op (see module docstring).

    The fused projection is laid out (heads, 3, head_dim) so that a column-wise tensor-parallel
    split hands each rank whole heads; the number of local heads is read off the tensor shapes.
    """

    def __init__(self, hidden: int, heads: int, dropout: float, causal_len: int = 0):
        super().__init__()
        self.n_heads = heads
        self.head_dim = hidden // heads
        self.wqkv = nn.Linear(hidden, 3 * hidden)
        self.wo = nn.Linear(hidden, hidden)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.causal_len = causal_len
        mask = self._causal_mask() if causal_len else None
        self.register_buffer("mask", mask, persistent=False)  # True above the diagonal: masked

    def _causal_mask(self, device=None):
        return torch.ones(self.causal_len, self.causal_len, dtype=torch.bool, device=device).triu(1)

    def reset_buffers(self):
        if self.causal_len:
            self.mask = self._causal_mask(self.mask.device)

    def forward(self, x):
        b, s, _ = x.shape
        qkv = self.wqkv(x).view(b, s, -1, 3, self.head_dim)
        q, k, v = (qkv[:, :, :, i].transpose(1, 2) for i in range(3))  # (b, heads, s, head_dim)
        mask = self.mask[:s, :s] if self.mask is not None else None
        if sequence_sharded():  # context parallelism: every cp rank's keys, masked by global position
            k, v, mask = context_keys(k, v, causal=self.mask is not None)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        probs = self.attn_drop(scores.softmax(dim=-1))
        y = (probs @ v).transpose(1, 2).reshape(b, s, -1)
        return self.resid_drop(self.wo(y))


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int, dropout: float):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn)
        self.w2 = nn.Linear(ffn, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.drop(self.w2(F.gelu(self.w1(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float, causal_len: int = 0):
        super().__init__()
        self.attention_norm = nn.LayerNorm(hidden)
        self.attention = Attention(hidden, heads, dropout, causal_len)
        self.ffn_norm = nn.LayerNorm(hidden)
        self.feed_forward = MLP(hidden, ffn, dropout)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(StagedModel):
    sequence_shardable = True  # positions and attention through autopar.zoo's helpers: context parallelism runs
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = Embedding(cfg)
        self.layers = nn.ModuleList(
            Block(cfg.hidden, cfg.heads, cfg.ffn, cfg.dropout, causal_len=cfg.seq_len) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)


def build_model(size: str = DEFAULT_SIZE, **overrides) -> GPT:
    return GPT(config(size, **overrides))


def example_batch(batch_size: int, size: str = DEFAULT_SIZE, seq_len: int | None = None, **overrides):
    cfg = config(size, seq_len=seq_len, **overrides)
    return next_token_batch(batch_size, cfg.vocab, cfg.seq_len)


BLOCK_TP_PLAN = {  # Megatron-LM's split of a transformer block (reused by BERT and ViT)
    "layers.*.attention.wqkv": "colwise",
    "layers.*.attention.wo": "rowwise",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
}


def tp_plan(model: GPT) -> dict[str, str]:
    """Fused QKV and MLP-in column-wise, their output projections row-wise, vocab-sharded ends."""
    return {"tok_embeddings.tok": "vocab", **BLOCK_TP_PLAN, "output": "vocab"}


def blocks(model: GPT) -> nn.ModuleList:
    return model.layers
