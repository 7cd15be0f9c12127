"""A plain GPT with its own top-level names -- ``tok``, ``pos``, ``layers``, ``norm``, ``out`` -- and a
forward that adds token and position embeddings itself (no part may be None), with its
tensor-parallel plan as torch ParallelStyle objects (sequence parallel: SequenceParallel norms,
the stream Shard(1) between them). autopar reads where the stages start and end from the
forward (autopar/layout.py): nothing is renamed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from autopar.zoo import gpt as zoo_gpt


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.head_dim, self.dropout = c.hidden // c.heads, c.dropout  # `dropout`: the name --no-dropout turns off
        self.q, self.k, self.v = (nn.Linear(c.hidden, c.hidden) for _ in range(3))
        self.proj = nn.Linear(c.hidden, c.hidden)

    def forward(self, x):
        # (-1, head_dim): the heads this tensor-parallel rank holds
        q, k, v = (f(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.hidden), nn.LayerNorm(c.hidden)
        self.attn = Attention(c)
        self.fc, self.proj = nn.Linear(c.hidden, c.ffn), nn.Linear(c.ffn, c.hidden)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.tok, self.pos = nn.Embedding(c.vocab, c.hidden), nn.Embedding(c.seq_len, c.hidden)
        self.drop = nn.Dropout(c.dropout)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.hidden)
        self.out = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, idx):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.layers:
            x = block(x)
        return self.out(self.norm(x))


def build_model(size: str = "tiny", **overrides):
    return GPT(zoo_gpt.config(size, **overrides))


def example_batch(batch_size: int, size: str = "tiny", **overrides):
    return zoo_gpt.example_batch(batch_size, size, **overrides)


def tp_plan(model):
    """torchtitan's form: embeddings whole (vocab rows sharded, summed), the stream scattered at the
    first block, SequenceParallel norms, each region gathering its input and reduce-scattering."""
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {
        "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "layers.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                       use_local_output=True),
        "layers.*.ln1": SequenceParallel(),
        "layers.*.attn": gather,
        "layers.*.attn.q": ColwiseParallel(),
        "layers.*.attn.k": ColwiseParallel(),
        "layers.*.attn.v": ColwiseParallel(),
        "layers.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ln2": SequenceParallel(),
        "layers.*.fc": ColwiseParallel(input_layouts=Shard(1)),
        "layers.*.proj": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }


# the same plan as autopar's style names (tests/models/own_names_job.py runs both forms)
NAMES_PLAN = {"tok": "vocab", "layers.*.attn.q": "colwise", "layers.*.attn.k": "colwise",
              "layers.*.attn.v": "colwise", "layers.*.attn.proj": "rowwise", "layers.*.fc": "colwise",
              "layers.*.proj": "rowwise", "out": "vocab"}
