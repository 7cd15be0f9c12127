"""Built-in model.py files (GPT, Llama, MoE, BERT, ViT, ResNet), each parameterised by a named size,
and the parts they share.

They are ordinary model.py files: load them by path or by name with
``autopar.modelfile.load_model_file("gpt")``. They double as the RL model zoo.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MODELS = ("gpt", "llama", "moe", "bert", "vit", "resnet")


def path(name: str) -> Path:
    """The model.py file of zoo model ``name``."""
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; choose one of {', '.join(MODELS)}")
    return Path(__file__).with_name(f"{name}.py")


SHAPES = frozenset({"layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len", "experts", "top_k", "image",
                    "patch", "width", "classes"})  # model arguments that are sizes: at least 1


def sized_config(cls, sizes: dict, size: str, overrides: dict):
    """``cls`` built from the named size with keyword overrides applied (None keeps the size's value)."""
    if size not in sizes:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(sizes)}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown model argument(s) {', '.join(unknown)}; known: size, {', '.join(sorted(known))}")
    for key, value in overrides.items():  # a shape below 1 (or any count below 0) fails later, somewhere else
        least = 1 if key in SHAPES else 0
        if isinstance(value, int) and not isinstance(value, bool) and value < least:
            raise ValueError(f"model argument {key}={value}: {key} must be at least {least}")
    return cls(**{**sizes[size], **{k: v for k, v in overrides.items() if v is not None}})


def init_transformer(model: nn.Module, num_layers: int, std: float = 0.02):
    """GPT-2 initialisation: N(0, std) weights, zero biases, residual projections (``wo``, ``w2``)
    scaled by 1/√(2L); other modules (norms, patch embeddings) reset themselves; buffers rebuilt."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            scale = 1 / math.sqrt(2 * num_layers) if name.endswith(("wo", "w2")) else 1.0
            nn.init.normal_(module.weight, std=std * scale)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        if callable(getattr(module, "reset_buffers", None)):
            module.reset_buffers()


class StagedModel(nn.Module):
    """``tok_embeddings`` → ``layers`` → ``norm`` → ``output``, as torchtitan lays models out.

    Any of the four may be None (a pipeline stage removes what other stages run); the tensor then
    passes through unchanged. Subclasses set ``config`` (with a ``layers`` count) and the four parts.
    """

    def init_weights(self):
        """Initialise parameters and rebuild buffers (after ``to_empty`` of a meta-built model)."""
        init_transformer(self, self.config.layers)

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers:
            x = layer(x)
        if self.norm is not None:
            x = self.norm(x)
        return self.output(x) if self.output is not None else x


def next_token_batch(batch_size: int, vocab: int, seq_len: int):
    """Random tokens and the same tokens shifted by one: a language-modelling batch."""
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def counting_corpus(samples: int, vocab: int, seq_len: int, seed: int = 0):
    """Synthetic text a model can learn, made here (no download): every sequence counts up by one
    from a random start, modulo the vocabulary; tokens and the same shifted by one. The next token
    follows from the current one, so the loss falls from ln(vocab) within a few steps (on random
    tokens, as `next_token_batch` makes, it cannot: there is nothing to learn). The same on every
    rank: drawn from its own generator seeded by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    tokens = (torch.randint(0, vocab, (samples, 1), generator=g) + torch.arange(seq_len + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def image_batch(batch_size: int, image: int, classes: int):
    """Random images (batch, 3, image, image) and class labels."""
    return torch.randn(batch_size, 3, image, image), torch.randint(0, classes, (batch_size,))


# -- context parallelism: the part of every sequence this rank holds (set by autopar's executor) ---------
@dataclass(frozen=True)
class SequenceShard:
    """This rank's tokens under context parallelism. `positions`: their places in the whole
    sequence (chunks i and 2cp-1-i of 2cp, causal load balancing); `gather(t)`: an autograd-aware
    all-gather of a K or V tensor (batch, heads, tokens, dim) over the cp ranks, whose tokens then
    sit at `key_positions`. `ring`: torch's `context_parallel` has replaced
    scaled_dot_product_attention (CUDA), so SDPA is called as without context parallelism."""

    positions: torch.Tensor
    key_positions: torch.Tensor
    gather: Callable[[torch.Tensor], torch.Tensor]
    ring: bool = False


# a module global, not a ContextVar: recomputation in backward may run on autograd's own threads
_SHARD: list[SequenceShard | None] = [None]


@contextlib.contextmanager
def sequence_shard(shard: SequenceShard | None):
    """Run the models' forward (and backward) on `shard`'s part of every sequence."""
    before, _SHARD[0] = _SHARD[0], shard
    try:
        yield
    finally:
        _SHARD[0] = before


def token_positions(tokens: torch.Tensor) -> torch.Tensor:
    """Positions of the tokens of `tokens` (batch, seq, ...) in the whole sequence: 0..seq-1, or
    this rank's under context parallelism (rotary and learned position embeddings need them)."""
    shard = _SHARD[0]
    if shard is None:
        return torch.arange(tokens.shape[1], device=tokens.device)
    return shard.positions.to(tokens.device)


def sequence_sharded() -> bool:
    return _SHARD[0] is not None


def context_keys(k: torch.Tensor, v: torch.Tensor, causal: bool):
    """Under context parallelism, for attention over (batch, heads, tokens, dim): every cp rank's
    keys and values, and the mask (True where a query must not see a key) of their global
    positions, or None when not causal."""
    shard = _SHARD[0]
    mask = shard.positions[:, None] < shard.key_positions[None, :] if causal else None
    return shard.gather(k), shard.gather(v), None if mask is None else mask.to(k.device)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal F.scaled_dot_product_attention over (batch, heads, tokens, dim), context-parallel
    when the executor splits the sequence: torch's ring attention where it runs (CUDA), else every
    cp rank's K and V gathered and masked by global position (gloo, where torch 2.13 has no CPU
    sharding rule for SDPA)."""
    shard = _SHARD[0]
    if shard is None or shard.ring:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    k, v, mask = context_keys(k, v, causal=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=~mask)
