"""BERT-style encoder trained with masked language modelling: post-LayerNorm, bidirectional.

Blocks reuse the GPT attention and MLP without the causal mask. ``tok_embeddings`` sums token,
position and segment embeddings, then LayerNorm and dropout; ``norm`` is None (post-LN blocks end
normalised); ``output`` is the MLM head (dense, GeLU, LayerNorm, vocabulary projection).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo import StagedModel, sized_config, token_positions
from autopar.zoo.gpt import BLOCK_TP_PLAN, MLP, Attention

MASK_FRACTION = 0.15  # of tokens to predict, as BERT
MASK_TOKEN = 3  # the id the masked positions read ([MASK]); any id below the vocabulary size works
IGNORE = -100  # target of unmasked positions: F.cross_entropy's default ignore_index


@dataclass(frozen=True)
class BertConfig:
    hidden: int
    layers: int
    heads: int
    vocab: int = 30522
    seq_len: int = 512
    ffn: int = 0  # 0: 4·hidden
    dropout: float = 0.1

    def __post_init__(self):
        if not self.ffn:
            object.__setattr__(self, "ffn", 4 * self.hidden)


SIZES = {
    "tiny": dict(hidden=64, layers=4, heads=4, vocab=256, seq_len=32),
    # Devlin et al. 2019
    "bert-base": dict(hidden=768, layers=12, heads=12),
    "bert-large": dict(hidden=1024, layers=24, heads=16),
    # Megatron-BERT (Shoeybi et al. 2019, Table 4)
    "megatron-bert-1.3b": dict(hidden=2048, layers=24, heads=32),
    "megatron-bert-3.9b": dict(hidden=2560, layers=48, heads=40),
}
DEFAULT_SIZE = "bert-base"


def config(size: str = DEFAULT_SIZE, **overrides) -> BertConfig:
    return sized_config(BertConfig, SIZES, size, overrides)


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.segment = nn.Embedding(2, cfg.hidden)
        self.norm = nn.LayerNorm(cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(token_positions(tokens)) + self.segment.weight[0]  # one segment
        return self.drop(self.norm(h))


class Block(nn.Module):
    """Post-LN block: ln(x + attn(x)), then ln(x + mlp(x))."""

    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = Attention(cfg.hidden, cfg.heads, cfg.dropout)
        self.attention_norm = nn.LayerNorm(cfg.hidden)
        self.feed_forward = MLP(cfg.hidden, cfg.ffn, cfg.dropout)
        self.ffn_norm = nn.LayerNorm(cfg.hidden)

    def forward(self, x):
        x = self.attention_norm(x + self.attention(x))
        return self.ffn_norm(x + self.feed_forward(x))


class MLMHead(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.hidden)
        self.norm = nn.LayerNorm(cfg.hidden)
        self.decoder = nn.Linear(cfg.hidden, cfg.vocab)

    def forward(self, x):
        return self.decoder(self.norm(F.gelu(self.dense(x))))


class Bert(StagedModel):
    sequence_shardable = True  # positions and attention through autopar.zoo's helpers: context parallelism runs
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = None  # post-LN: every block already ends with a LayerNorm
        self.output = MLMHead(cfg)


def build_model(size: str = DEFAULT_SIZE, **overrides) -> Bert:
    return Bert(config(size, **overrides))


def example_batch(batch_size: int, size: str = DEFAULT_SIZE, seq_len: int | None = None, **overrides):
    """Masked-LM batch: 15% of positions read MASK_TOKEN and are predicted, the rest are ignored."""
    cfg = config(size, seq_len=seq_len, **overrides)
    tokens = torch.randint(0, cfg.vocab, (batch_size, cfg.seq_len))
    masked = torch.rand(batch_size, cfg.seq_len) < MASK_FRACTION
    return tokens.masked_fill(masked, MASK_TOKEN), tokens.masked_fill(~masked, IGNORE)


def tp_plan(model: Bert) -> dict[str, str]:
    """Megatron-BERT's split, as GPT's."""
    return {"tok_embeddings.tok": "vocab", **BLOCK_TP_PLAN, "output.decoder": "vocab"}


def blocks(model: Bert) -> nn.ModuleList:
    return model.layers
