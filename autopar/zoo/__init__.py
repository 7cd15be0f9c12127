"""Built-in model.py files (GPT, Llama, MoE, BERT, ViT, ResNet), each parameterised by a named size,
and the parts they share.

They are ordinary model.py files: load them by path or by name with
``autopar.modelfile.load_model_file("gpt")``. They double as the RL model zoo.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import torch
from torch import nn

MODELS = ("gpt", "llama", "moe", "bert", "vit", "resnet")


def path(name: str) -> Path:
    """The model.py file of zoo model ``name``."""
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; choose one of {', '.join(MODELS)}")
    return Path(__file__).with_name(f"{name}.py")


def sized_config(cls, sizes: dict, size: str, overrides: dict):
    """``cls`` built from the named size with keyword overrides applied (None keeps the size's value)."""
    if size not in sizes:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(sizes)}")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown model argument(s) {', '.join(unknown)}; known: size, {', '.join(sorted(known))}")
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


def image_batch(batch_size: int, image: int, classes: int):
    """Random images (batch, 3, image, image) and class labels."""
    return torch.randn(batch_size, 3, image, image), torch.randint(0, classes, (batch_size,))
