"""Vision Transformer (Dosovitskiy et al. 2021): patch embedding, CLS token, pre-LN encoder blocks.

``tok_embeddings`` turns images into (batch, patches + 1, hidden) tokens, so the sequence length
is (image / patch)² + 1; the blocks are GPT's without the causal mask; ``output`` classifies the
CLS token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopar.zoo import StagedModel, image_batch, sized_config
from autopar.zoo.gpt import BLOCK_TP_PLAN, Block


@dataclass(frozen=True)
class ViTConfig:
    hidden: int
    layers: int
    heads: int
    ffn: int
    patch: int = 16
    image: int = 224
    classes: int = 1000
    dropout: float = 0.0
    seq_len: int = 0  # derived: (image / patch)² + 1; giving another value is an error

    def __post_init__(self):
        if self.image % self.patch:
            raise ValueError(f"image size {self.image} is not a multiple of the patch size {self.patch}")
        tokens = (self.image // self.patch) ** 2 + 1
        if self.seq_len not in (0, tokens):
            raise ValueError(f"a ViT's seq_len is (image/patch)²+1 = {tokens}; change image or patch instead")
        object.__setattr__(self, "seq_len", tokens)


SIZES = {
    "tiny": dict(hidden=64, layers=4, heads=4, ffn=256, patch=8, image=40, classes=10),  # 26 tokens
    # Dosovitskiy et al. 2021, Table 1
    "vit-b16": dict(hidden=768, layers=12, heads=12, ffn=3072),
    "vit-l16": dict(hidden=1024, layers=24, heads=16, ffn=4096),
    "vit-h14": dict(hidden=1280, layers=32, heads=16, ffn=5120, patch=14),
    # Zhai et al. 2022 (scaling ViTs); Dehghani et al. 2023 (ViT-22B: here with standard blocks)
    "vit-g14": dict(hidden=1408, layers=40, heads=16, ffn=6144, patch=14),
    "vit-G14": dict(hidden=1664, layers=48, heads=16, ffn=8192, patch=14),
    "vit-22b": dict(hidden=6144, layers=48, heads=48, ffn=24576, patch=14),
}
DEFAULT_SIZE = "vit-b16"


def config(size: str = DEFAULT_SIZE, **overrides) -> ViTConfig:
    return sized_config(ViTConfig, SIZES, size, overrides)


class PatchEmbedding(nn.Module):
    """Non-overlapping patches projected to ``hidden``, a learned CLS token, learned positions."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.proj = nn.Conv2d(3, cfg.hidden, kernel_size=cfg.patch, stride=cfg.patch)
        self.cls = nn.Parameter(torch.empty(1, 1, cfg.hidden))
        self.pos = nn.Parameter(torch.empty(1, cfg.seq_len, cfg.hidden))
        self.drop = nn.Dropout(cfg.dropout)
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.cls, std=0.02)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, images):
        x = self.proj(images).flatten(2).transpose(1, 2)  # (batch, patches, hidden)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1)
        return self.drop(x + self.pos)


class ClassifierHead(nn.Module):
    def __init__(self, hidden: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc(x[:, 0])


class ViT(StagedModel):
    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = PatchEmbedding(cfg)
        self.layers = nn.ModuleList(Block(cfg.hidden, cfg.heads, cfg.ffn, cfg.dropout) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.output = ClassifierHead(cfg.hidden, cfg.classes)


def build_model(size: str = DEFAULT_SIZE, **overrides) -> ViT:
    return ViT(config(size, **overrides))


def example_batch(batch_size: int, size: str = DEFAULT_SIZE, **overrides):
    cfg = config(size, **overrides)
    return image_batch(batch_size, cfg.image, cfg.classes)


def tp_plan(model: ViT) -> dict[str, str]:
    """The encoder blocks split as GPT's; patch embedding and classifier stay replicated."""
    return dict(BLOCK_TP_PLAN)


def blocks(model: ViT) -> nn.ModuleList:
    return model.layers
