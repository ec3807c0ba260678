"""CIFAR-style ResNets (He et al. 2016, §4.2): the image models of docs/algorithm.md §5.

This module owns :func:`resnet` and its building blocks. A network of depth 6n+2 is a 3x3
stem conv (16 channels), three stages of n basic blocks with widths 16, 32, 64 (the second and
third start with stride 2), global average pooling and a linear classifier, with a
normalization layer after every conv: BatchNorm (``norm="batch"``, the paper's) or GroupNorm
with :data:`GROUPS` groups (``norm="group"``). GroupNorm has no running statistics and does not
depend on what else is in the batch, so it is the choice under label skew: there each worker's
BatchNorm learns the statistics of its own one or two classes during training, and the averaged
running statistics used at evaluation fit none of them (measured: docs/results.md).

Shortcuts are the paper's option A: identity, and where a stage halves the resolution and
doubles the width, a stride-2 subsample zero-padded in channels. It adds no parameters, so
ResNet-32 has the 0.46M parameters the CELGC paper quotes (464,154 for 10 classes).

Any input size works (global pooling), e.g. 28x28 Fashion-MNIST with ``in_channels=1``
(28 -> 14 -> 7) or 32x32 CIFAR (32 -> 16 -> 8).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from localclip.errors import ConfigError

__all__ = ["BasicBlock", "CifarResNet", "GROUPS", "NORMS", "RESNET_DEPTHS", "resnet"]

NORMS = ("batch", "group")
GROUPS = 8  # GroupNorm groups at every width (16, 32, 64 channels: 2, 4, 8 channels a group)


def _norm(kind: str, planes: int) -> nn.Module:
    return nn.BatchNorm2d(planes) if kind == "batch" else nn.GroupNorm(GROUPS, planes)

RESNET_DEPTHS = (8, 14, 20, 32, 44, 56)


class BasicBlock(nn.Module):
    """Two 3x3 conv-norm layers plus an option-A shortcut (the norms are named ``bn*`` whatever
    their kind, so that checkpoints keep their keys)."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1, norm: str = "batch") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = _norm(norm, planes)
        self.stride = stride
        self.pad = planes - in_planes

    def shortcut(self, x: Tensor) -> Tensor:
        if self.stride != 1:
            # x[::2] keeps ceil(s/2) pixels, which is what the stride-2, padding-1 conv yields
            # for any size s, odd or even.
            x = x[:, :, :: self.stride, :: self.stride]
        if self.pad:
            x = F.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))
        return x

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """The 6n+2 ResNet; build it with :func:`resnet`."""

    def __init__(self, blocks_per_stage: int, num_classes: int = 10, in_channels: int = 3, norm: str = "batch") -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, stride=1, padding=1, bias=False)
        self.bn1 = _norm(norm, 16)
        stages = []
        in_planes = 16
        for planes, stride in [(16, 1), (32, 2), (64, 2)]:
            blocks = []
            for b in range(blocks_per_stage):
                blocks.append(BasicBlock(in_planes, planes, stride if b == 0 else 1, norm))
                in_planes = planes
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3 = stages
        self.fc = nn.Linear(64, num_classes)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # He et al. (2015) init for convs, as the ResNet paper does; norms start as the identity.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
                if isinstance(m, nn.BatchNorm2d):
                    m.reset_running_stats()
            elif isinstance(m, nn.Linear):
                m.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        """``x``: ``[B, in_channels, H, W]`` -> logits ``[B, num_classes]``."""
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer3(self.layer2(self.layer1(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.fc(x)


def resnet(depth: int, *, num_classes: int = 10, in_channels: int = 3, norm: str = "batch") -> CifarResNet:
    """A CIFAR ResNet of ``depth`` in :data:`RESNET_DEPTHS` (ResNet-32: 0.46M parameters) with
    ``norm`` in :data:`NORMS` (the parameter count is the same for both)."""
    if depth not in RESNET_DEPTHS:
        raise ConfigError(f"Invalid ResNet depth: {depth!r} (choose one of {list(RESNET_DEPTHS)})")
    if norm not in NORMS:
        raise ConfigError(f"Invalid ResNet norm: {norm!r} (choose one of {list(NORMS)})")
    for name, value in [("num_classes", num_classes), ("in_channels", in_channels)]:
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"Invalid {name}: {value!r} (need a positive integer)")
    return CifarResNet((depth - 2) // 6, num_classes=num_classes, in_channels=in_channels, norm=norm)
