"""Decoder-only mixture-of-experts transformer: Llama attention, a top-k router, SwiGLU experts.

Shapes (`size=`), checked against the published Hugging Face configs:

- ``mixtral-8x7b``: 8 experts top-2, hidden 4096, expert ffn 14336, 32 layers, 32 q / 8 kv heads,
  vocab 32000, rope 1e6 (huggingface.co/mistralai/Mixtral-8x7B-v0.1, config.json).
- ``qwen3-30b-a3b``: 128 experts top-8, hidden 2048, moe ffn 768, 48 layers, 32 q / 4 kv heads of
  dim 128, vocab 151936, rope 1e6 (huggingface.co/Qwen/Qwen3-30B-A3B, config.json).
- ``gpt-oss-120b``: 128 experts top-4, hidden 2880, expert ffn 2880, 36 layers, 64 q / 8 kv heads of
  dim 64, vocab 201088, rope 150000 (huggingface.co/openai/gpt-oss-120b, original/config.json;
  docs.nvidia.com/nemo/megatron-bridge/latest/models/llm/gpt-oss.html), with the experts' biases.
  Simplified: no attention sinks (64 parameters a layer), no sliding-window layers (every layer
  attends to the whole causal context: the profile prices the windowed layers' attention as full),
  no attention biases (a fused GEMM epilogue: no time), unclamped SwiGLU.
- ``deepseek-v3``: 1 shared + 256 routed experts top-8 (sigmoid scores, 8 groups, at most 4 groups
  per token), hidden 7168, moe ffn 2048, 61 layers of which the first 3 dense (ffn 18432), vocab
  129280 (huggingface.co/deepseek-ai/DeepSeek-V3, config.json). Simplified: multi-head latent
  attention (MLA, 187M parameters a layer) is replaced by GQA with 128 heads of dim 112 and 16 kv
  heads, chosen so the attention FLOPs per token at sequence 4096 match MLA's within 2% (697 vs
  709 MFLOP forward: projections plus scores and values); its parameters are 231M a layer (+24%),
  so the model has 674B parameters, 40.2B active (DeepSeek-V3: 671B, 37B). No multi-token
  prediction module, no routed scaling factor.

Routing is dropless: every token goes to its top-k experts whatever their load. The router is a
linear map, softmax (or sigmoid, DeepSeek-V3) scores, an optional node-limited choice (experts in
``route_groups`` groups, one per node under expert parallelism; each token keeps the best
``route_group_limit`` groups, scored by their two best experts as DeepSeek-V3 does), top-k and,
with ``norm_topk``, weights renormalised to sum 1. ``router_skew`` sets the non-trainable
selection bias (DeepSeek-V3's aux-loss-free balancing bias) to favour the first experts: tests use
it for uneven expert loads. ``gate="balanced"`` replaces the learned choice by NeMo AutoModel's
benchmark gate (``fake_balanced_gate``, nemo_automodel/components/moe/layers.py; the gate of the
published rows in `data/published/moe_automodel_dgx_h100_bf16.csv`): the token at index i of the
rank's sequence goes to experts i·k, ..., i·k + k − 1 (mod the expert count), so every expert gets
the same load and a token's k experts are consecutive (on one or two expert-parallel ranks); its
weights are still the router's scores of those experts, so the router trains. The experts compute
with ``torch._grouped_mm`` on CUDA (bf16) and with one matmul per expert elsewhere: the same maths. On the meta device (profiling) the token count
per expert is not known, so the experts see a force-balanced split (the published-benchmark
convention; the imbalance factor is a workload setting, `autopar.workload`).

A MoE layer exposes ``moe_shape()`` (experts, top_k, hidden, expert_ffn, shared_ffn,
capacity_factor, node_limit, gate): the profiler reads it (`autopar.profile.moe`), and the executor shards
``moe.experts`` over the expert-parallel ranks (`autopar.executor.expert_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo import StagedModel, next_token_batch, sized_config
from autopar.zoo.llama import Attention, FeedForward

SCORES = ("softmax", "sigmoid")
GATES = ("learned", "balanced")  # the router's top-k choice, or the benchmark's fixed balanced one


@dataclass(frozen=True)
class MoeConfig:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    seq_len: int
    experts: int  # routed experts per MoE layer
    top_k: int  # routed experts per token
    expert_ffn: int  # hidden size of one expert's SwiGLU
    shared_experts: int = 0  # always-on experts (DeepSeek-V3: 1), one SwiGLU of shared_experts x expert_ffn
    dense_layers: int = 0  # the first layers have a dense FFN instead (DeepSeek-V3: 3)
    dense_ffn: int = 0
    head_dim: int = 0  # 0: hidden / heads
    score: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3)
    norm_topk: bool = True  # renormalise the top-k weights to sum 1
    route_groups: int = 1  # expert groups (nodes) for node-limited routing
    route_group_limit: int = 0  # at most this many groups per token (0: no limit)
    router_skew: float = 0.0  # selection bias favouring the first experts (uneven loads, for tests)
    expert_bias: bool = False  # biases on the experts' GEMMs (GPT-OSS)
    gate: str = "learned"  # "balanced": token i -> experts i*k ... i*k + k - 1 (mod experts), a benchmark's gate
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.heads % self.kv_heads or (not self.head_dim and self.hidden % self.heads):
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads} and divide "
                             f"hidden {self.hidden} (or give head_dim)")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k {self.top_k} must be between 1 and the {self.experts} experts")
        if self.score not in SCORES:
            raise ValueError(f"score {self.score!r} must be one of {', '.join(SCORES)}")
        if self.gate not in GATES:
            raise ValueError(f"gate {self.gate!r} must be one of {', '.join(GATES)}")
        if self.gate == "balanced" and (self.route_group_limit or self.router_skew):
            raise ValueError("gate 'balanced' fixes every token's experts: leave out route_group_limit and router_skew")
        if self.experts % self.route_groups or self.route_group_limit > self.route_groups:
            raise ValueError(f"route_groups {self.route_groups} must divide the {self.experts} experts and be at "
                             f"least route_group_limit {self.route_group_limit}")
        if self.route_group_limit and self.route_group_limit * self.experts // self.route_groups < self.top_k:
            raise ValueError(f"route_group_limit {self.route_group_limit} groups hold fewer than top_k "
                             f"{self.top_k} experts")
        if self.dense_layers > self.layers or (self.dense_layers and not self.dense_ffn):
            raise ValueError("dense_layers needs dense_ffn and at most `layers` layers")


def _moe(hidden, layers, heads, kv_heads, vocab, seq_len, experts, top_k, expert_ffn, **extra):
    return dict(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, vocab=vocab, seq_len=seq_len,
                experts=experts, top_k=top_k, expert_ffn=expert_ffn, **extra)


SIZES = {
    "tiny": _moe(64, 4, 4, 2, 256, 32, 8, 2, 32, shared_experts=1, dense_layers=1, dense_ffn=128),
    "small": _moe(768, 12, 12, 4, 32000, 2048, 16, 2, 1024),
    "mixtral-8x7b": _moe(4096, 32, 32, 8, 32000, 4096, 8, 2, 14336, rope_theta=1e6),
    "qwen3-30b-a3b": _moe(2048, 48, 32, 4, 151936, 4096, 128, 8, 768, head_dim=128, rope_theta=1e6,
                          norm_eps=1e-6),
    "gpt-oss-120b": _moe(2880, 36, 64, 8, 201088, 4096, 128, 4, 2880, head_dim=64, rope_theta=150000.0,
                         expert_bias=True),
    "deepseek-v3": _moe(7168, 61, 128, 16, 129280, 4096, 256, 8, 2048, head_dim=112, shared_experts=1,
                        dense_layers=3, dense_ffn=18432, score="sigmoid", route_groups=8, route_group_limit=4,
                        rope_theta=10000.0, norm_eps=1e-6),
}
DEFAULT_SIZE = "small"


def config(size: str = DEFAULT_SIZE, **overrides) -> MoeConfig:
    return sized_config(MoeConfig, SIZES, size, overrides)


class Router(nn.Module):
    """Scores, node-limited group choice, top-k: (weights (T, k), expert indices (T, k))."""

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.register_buffer("selection_bias", torch.zeros(cfg.experts), persistent=False)

    def reset_buffers(self):
        """The selection bias: zero, or `router_skew` falling linearly from the first expert to the last."""
        n = self.cfg.experts
        ramp = torch.linspace(1.0, 0.0, n, device=self.selection_bias.device) if n > 1 else torch.zeros(1)
        self.selection_bias = ramp * self.cfg.router_skew

    def forward(self, tokens: torch.Tensor, seq_len: int | None = None):
        logits = self.gate(tokens)
        scores = logits.softmax(-1) if self.cfg.score == "softmax" else logits.sigmoid()
        if self.cfg.gate == "balanced":
            index = balanced_experts(tokens.shape[0], seq_len or tokens.shape[0], self.cfg.top_k, self.cfg.experts,
                                     tokens.device)
            return self._weights(scores, index)
        choice = scores + self.selection_bias.to(scores.dtype)
        groups, limit = self.cfg.route_groups, self.cfg.route_group_limit
        if limit:  # node-limited: keep the `limit` groups with the best two experts each
            grouped = choice.view(tokens.shape[0], groups, -1)
            best = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
            keep = torch.zeros_like(best, dtype=torch.bool).scatter(1, best.topk(limit, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        return self._weights(scores, choice.topk(self.cfg.top_k, dim=-1).indices)

    def _weights(self, scores: torch.Tensor, index: torch.Tensor):
        weights = scores.gather(1, index)
        if self.cfg.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, index


def balanced_experts(tokens: int, seq_len: int, top_k: int, experts: int, device=None) -> torch.Tensor:
    """(tokens, top_k) expert indices of the balanced gate: the token at sequence index i gets experts
    i·k ... i·k + k − 1 (mod experts). Indexed by position in its sequence, so a token's experts do not
    depend on how the batch is split over ranks (the benchmark counts the rank's local tokens: the same
    whenever the sequence length is a multiple of experts / gcd(experts, k))."""
    position = torch.arange(tokens, device=device) % seq_len
    return (position[:, None] * top_k + torch.arange(top_k, device=device)) % experts


class GroupedExperts(nn.Module):
    """`experts` SwiGLU FFNs with stacked weights (torchtitan's layout): w1, w3 (E, ffn, hidden),
    w2 (E, hidden, ffn), and with `bias` (GPT-OSS) b1, b3 (E, ffn), b2 (E, hidden), added after each
    GEMM as their own elementwise pass, as NeMo AutoModel's grouped experts do (a grouped GEMM takes no
    bias). `forward(x, counts)` takes tokens sorted by expert, counts[e] of them for expert e."""

    def __init__(self, experts: int, hidden: int, ffn: int, bias: bool = False):
        super().__init__()
        self.num_experts, self.hidden, self.ffn = experts, hidden, ffn
        self.w1 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.b1, self.b2, self.b3 = ((nn.Parameter(torch.empty(experts, n)) for n in (ffn, hidden, ffn)) if bias
                                     else (None, None, None))
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02):
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=std)
        for b in (self.b1, self.b2, self.b3):
            if b is not None:
                nn.init.zeros_(b)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        if _grouped_mm_applies(x, self):
            offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            rows = torch.tensor(counts, device=x.device)

            def mm(a, w, b):
                y = torch._grouped_mm(a, w.transpose(-2, -1), offs=offsets)
                return y if b is None else y + b.repeat_interleave(rows, dim=0, output_size=a.shape[0])

            return mm(F.silu(mm(x, self.w1, self.b1)) * mm(x, self.w3, self.b3), self.w2, self.b2)

        def linear(a, w, b, e):
            y = F.linear(a, w[e])
            return y if b is None else y + b[e]

        outs = [linear(F.silu(linear(xe, self.w1, self.b1, e)) * linear(xe, self.w3, self.b3, e), self.w2, self.b2, e)
                for e, xe in enumerate(x.split(counts))]
        return torch.cat(outs) if outs else x.new_zeros(0, self.hidden)


def _grouped_mm_applies(x: torch.Tensor, experts: GroupedExperts) -> bool:
    """torch's grouped GEMM: CUDA, bf16, dims a multiple of 16 (its alignment rule). Unverified here
    (no GPU in this project's CI); the per-expert loop is the reference."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and experts.hidden % 16 == 0 and experts.ffn % 16 == 0)


def expert_counts(index: torch.Tensor, experts: int) -> list[int]:
    """Tokens per expert: counted, or on the meta device (no values) force-balanced."""
    n = index.numel()
    if index.device.type == "meta":
        base, extra = divmod(n, experts)
        return [base + (e < extra) for e in range(experts)]
    return torch.bincount(index.reshape(-1), minlength=experts).tolist()


class MoE(nn.Module):
    """Router, dropless dispatch to the routed experts, weighted combine, plus the shared experts."""

    capacity_factor = 0.0  # dropless: no capacity, no token dropped

    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.num_experts, self.top_k, self.hidden = cfg.experts, cfg.top_k, cfg.hidden
        self.node_limit = cfg.route_group_limit
        self.gate = cfg.gate
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.experts, cfg.hidden, cfg.expert_ffn, bias=cfg.expert_bias)
        shared = cfg.shared_experts * cfg.expert_ffn
        self.shared_experts = FeedForward(cfg.hidden, shared) if shared else None
        self.last_counts: list[int] = []  # tokens per expert of the last forward (tests, diagnostics)

    def moe_shape(self) -> dict:
        shared = self.shared_experts.w1.out_features if self.shared_experts is not None else 0
        return {"experts": self.num_experts, "top_k": self.top_k, "hidden": self.hidden,
                "expert_ffn": self.experts.ffn, "shared_ffn": shared, "capacity_factor": self.capacity_factor,
                "node_limit": self.node_limit, "gate": self.gate}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, index = self.router(tokens, shape[-2] if x.dim() > 2 else None)
        flat = index.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) pairs sorted by expert
        counts = expert_counts(flat, self.num_experts)
        self.last_counts = counts
        routed = self.experts(tokens[order // self.top_k], counts)
        unsorted = torch.zeros_like(routed).index_copy(0, order, routed).view(-1, self.top_k, shape[-1])
        out = (unsorted * weights.unsqueeze(-1).to(unsorted.dtype)).sum(1)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view(shape)


class Block(nn.Module):
    def __init__(self, cfg: MoeConfig, dense: bool):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        if dense:
            self.feed_forward = FeedForward(cfg.hidden, cfg.dense_ffn)
        else:
            self.moe = MoE(cfg)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        ffn = self.feed_forward if hasattr(self, "feed_forward") else self.moe
        return x + ffn(self.ffn_norm(x))


class MoeTransformer(StagedModel):
    def __init__(self, cfg: MoeConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg, dense=i < cfg.dense_layers) for i in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)


def build_model(size: str = DEFAULT_SIZE, **overrides) -> MoeTransformer:
    return MoeTransformer(config(size, **overrides))


def example_batch(batch_size: int, size: str = DEFAULT_SIZE, seq_len: int | None = None, **overrides):
    cfg = config(size, seq_len=seq_len, **overrides)
    return next_token_batch(batch_size, cfg.vocab, cfg.seq_len)


def tp_plan(model: MoeTransformer) -> dict[str, str]:
    """Attention, dense FFNs and shared experts as Llama's plan; the router and the routed experts
    are replicated over tp (expert tensor parallelism is not offered)."""
    plan = {"tok_embeddings": "vocab", "output": "vocab"}
    for name in ("wq", "wk", "wv"):
        plan[f"layers.*.attention.{name}"] = "colwise"
    plan["layers.*.attention.wo"] = "rowwise"
    dense = model.config.dense_layers > 0
    shared = model.config.shared_experts > 0
    for prefix, present in (("layers.*.feed_forward", dense), ("layers.*.moe.shared_experts", shared)):
        if present:
            plan.update({f"{prefix}.w1": "colwise", f"{prefix}.w3": "colwise", f"{prefix}.w2": "rowwise"})
    return plan


def blocks(model: MoeTransformer) -> nn.ModuleList:
    return model.layers
