"""Llama-style decoder: RMSNorm, SwiGLU MLP, rotary positions, grouped-query attention.

`mlp="squared_relu"` swaps the SwiGLU for Nemotron-4's MLP (w2(relu(w1 x)^2), two matrices, no
gate; Parmar et al. 2024). The rest of Nemotron-4 (LayerNorm with zero-centred gamma, rotary on half
of each head) is not written here: under runtime megatron a layer's traffic and saved tensors come
from its dims (autopar/cost/fused.py), which this file gives right.

Module names follow torchtitan's Llama (``tok_embeddings``, ``layers.*.attention.wq/wk/wv/wo``,
``layers.*.feed_forward.w1/w2/w3``, ``norm``, ``output``). Attention calls
F.scaled_dot_product_attention after repeating the key/value heads (as torchtitan's repeat_kv).
On a GPU that runs the flash kernel, which saves no seq x seq tensor (only the output and a
per-row log-sum-exp), and the profiler accounts it that way (autopar/profile/kernels.py). Rotary
tables are computed in forward, so the model holds no buffer that meta building would leave empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo import StagedModel, causal_sdpa, next_token_batch, sized_config, token_positions


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    mlp: str = "swiglu"  # or "squared_relu" (Nemotron-4)

    def __post_init__(self):
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} must divide hidden {self.hidden} and be a multiple of "
                             f"kv_heads {self.kv_heads}")
        if self.mlp not in MLPS:
            raise ValueError(f"mlp {self.mlp!r} is not one of {', '.join(MLPS)}")


def _llama(hidden, layers, heads, kv_heads, ffn, vocab, seq_len, rope_theta=10000.0):
    return dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                seq_len=seq_len, rope_theta=rope_theta)


SIZES = {
    "tiny": _llama(64, 4, 4, 2, 192, 256, 32),
    "small": _llama(768, 12, 12, 4, 2048, 32000, 2048),
    # Touvron et al. 2023 (LLaMA, Llama 2); Llama 3 herd (Dubey et al. 2024)
    "llama-7b": _llama(4096, 32, 32, 32, 11008, 32000, 2048),
    "llama2-7b": _llama(4096, 32, 32, 32, 11008, 32000, 4096),
    "llama2-13b": _llama(5120, 40, 40, 40, 13824, 32000, 4096),
    "llama2-70b": _llama(8192, 80, 64, 8, 28672, 32000, 4096),
    "llama3-8b": _llama(4096, 32, 32, 8, 14336, 128256, 8192, 500000.0),
    "llama3-70b": _llama(8192, 80, 64, 8, 28672, 128256, 8192, 500000.0),
    "llama3-405b": _llama(16384, 126, 128, 8, 53248, 128256, 8192, 500000.0),
}
DEFAULT_SIZE = "small"


def config(size: str = DEFAULT_SIZE, **overrides) -> LlamaConfig:
    return sized_config(LlamaConfig, SIZES, size, overrides)


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate pairs of channels of ``x`` (batch, seq, heads, head_dim) by position-dependent angles.
    The angles are computed in fp32 and the rotation applied in ``x``'s dtype, as HF transformers'
    Llama does: an fp32 rotation of 16-bit activations would move twice their bytes through HBM."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = torch.outer(token_positions(x).to(torch.float32), freqs)[:, None, :]  # global positions under cp
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = getattr(cfg, "head_dim", 0) or cfg.hidden // cfg.heads  # GPT-OSS: 64 x 64 != 2880
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = rotary(q, self.rope_theta), rotary(k, self.rope_theta)
        repeats = q.shape[2] // k.shape[2]  # local heads under tensor parallelism
        k, v = (t.repeat_interleave(repeats, dim=2) if repeats > 1 else t for t in (k, v))
        y = causal_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SquaredReLU(nn.Module):
    """Nemotron-4's MLP: w2(relu(w1 x)^2)."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)).square())


MLPS = {"swiglu": FeedForward, "squared_relu": SquaredReLU}


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.feed_forward = MLPS[cfg.mlp](cfg.hidden, cfg.ffn)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(StagedModel):
    sequence_shardable = True  # positions and attention through autopar.zoo's helpers: context parallelism runs
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)


def build_model(size: str = DEFAULT_SIZE, **overrides) -> Llama:
    return Llama(config(size, **overrides))


def example_batch(batch_size: int, size: str = DEFAULT_SIZE, seq_len: int | None = None, **overrides):
    cfg = config(size, seq_len=seq_len, **overrides)
    return next_token_batch(batch_size, cfg.vocab, cfg.seq_len)


def tp_plan(model: Llama) -> dict[str, str]:
    """torchtitan's Llama plan: q/k/v and w1/w3 column-wise, wo and w2 row-wise, vocab-sharded ends."""
    plan = {
        "tok_embeddings": "vocab",
        "layers.*.attention.wq": "colwise",
        "layers.*.attention.wk": "colwise",
        "layers.*.attention.wv": "colwise",
        "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w1": "colwise",
        "layers.*.feed_forward.w3": "colwise",
        "layers.*.feed_forward.w2": "rowwise",
        "output": "vocab",
    }
    if model.config.mlp != "swiglu":  # no gate
        del plan["layers.*.feed_forward.w3"]
    return plan


def blocks(model: Llama) -> nn.ModuleList:
    return model.layers
