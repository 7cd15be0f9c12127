"""ResNet with bottleneck blocks (He et al. 2016; torchvision's v1.5: stride on the 3x3 conv).

Laid out for pipelining: the stem is ``tok_embeddings``, the bottleneck blocks of all stages form
one flat ModuleList ``layers`` (heterogeneous: the first block of each stage changes width and
stride), and pooling plus the classifier are ``output``. Sizes vary depth (50/101/152), the inner
width of the bottlenecks (wide ResNets) and the overall width (BiT's x4), so the same file spans
25M parameters to 1B and, through the ``width`` override, beyond. There is no tp_plan: the
planner uses tensor-parallel degree 1 for ResNets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from autopar.zoo import StagedModel, image_batch, sized_config

EXPANSION = 4  # bottleneck output channels / inner channels


@dataclass(frozen=True)
class ResNetConfig:
    depths: tuple[int, ...] = (3, 4, 6, 3)  # bottleneck blocks per stage
    width: int = 64  # inner channels of the first stage; doubles every stage
    wide: int = 1  # extra multiplier of the bottlenecks' inner channels (wide ResNets: 2)
    image: int = 224
    classes: int = 1000

    @property
    def layers(self) -> int:
        return sum(self.depths)


SIZES = {
    "tiny": dict(depths=(2, 2, 2, 2), width=16, image=64, classes=10),
    "resnet50": dict(depths=(3, 4, 6, 3)),
    "resnet101": dict(depths=(3, 4, 23, 3)),
    "resnet152": dict(depths=(3, 8, 36, 3)),
    "wide_resnet50_2": dict(depths=(3, 4, 6, 3), wide=2),
    "wide_resnet101_2": dict(depths=(3, 4, 23, 3), wide=2),
    "resnet152x4": dict(depths=(3, 8, 36, 3), width=256),  # BiT-L (Kolesnikov et al. 2020)
}
DEFAULT_SIZE = "resnet50"


def config(size: str = DEFAULT_SIZE, **overrides) -> ResNetConfig:
    return sized_config(ResNetConfig, SIZES, size, overrides)


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> tuple[nn.Conv2d, nn.BatchNorm2d]:
    return nn.Conv2d(cin, cout, kernel, stride, padding=kernel // 2, bias=False), nn.BatchNorm2d(cout)


class Stem(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv, self.bn = _conv_bn(3, width, 7, stride=2)

    def forward(self, images):
        return F.max_pool2d(F.relu(self.bn(self.conv(images))), kernel_size=3, stride=2, padding=1)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand, plus the shortcut (projected when the shape changes)."""

    def __init__(self, cin: int, inner: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(cin, inner, 1)
        self.conv2, self.bn2 = _conv_bn(inner, inner, 3, stride)
        self.conv3, self.bn3 = _conv_bn(inner, cout, 1)
        self.downsample = nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None

    def forward(self, x):
        shortcut = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return F.relu(self.bn3(self.conv3(y)) + shortcut)


class Classifier(nn.Module):
    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        return self.fc(x.mean(dim=(2, 3)))


class ResNet(StagedModel):
    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = Stem(cfg.width)
        layers, cin = [], cfg.width
        for stage, depth in enumerate(cfg.depths):
            width = cfg.width * 2 ** stage
            for i in range(depth):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(Bottleneck(cin, width * cfg.wide, width * EXPANSION, stride))
                cin = width * EXPANSION
        self.layers = nn.ModuleList(layers)
        self.norm = None
        self.output = Classifier(cin, cfg.classes)


def build_model(size: str = DEFAULT_SIZE, **overrides) -> ResNet:
    return ResNet(config(size, **overrides))


def example_batch(batch_size: int, size: str = DEFAULT_SIZE, **overrides):
    cfg = config(size, **overrides)
    return image_batch(batch_size, cfg.image, cfg.classes)


def blocks(model: ResNet) -> nn.ModuleList:
    return model.layers
