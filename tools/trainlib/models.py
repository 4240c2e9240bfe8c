"""ResNet-18/50/101 in plain torch (no torchvision), with an optional CIFAR stem.

Architecture as in He et al. 2016 ("Deep Residual Learning") with the v1.5 placement of the
stride-2 conv in the bottleneck's 3x3 (what torchvision and the MLPerf reference use). Input
``(N, 3, H, W)`` float, output logits ``(N, num_classes)``.

* ``stem="imagenet"``: 7x7 conv stride 2 + 3x3 max-pool stride 2 (total stride 4 before stage 1).
* ``stem="cifar"``: 3x3 conv stride 1, no max-pool, for 32x32 inputs (He et al. section 4.2 style).
* ``width``: channels of the first stage (64 in the paper); smaller widths give cheap models for
  tests and CPU demos. Stage ``i`` has ``width * 2**i`` channels (x4 at the bottleneck output).
* ``zero_init_residual``: set the last BN's gamma of every residual block to 0, so each block
  starts as the identity (Goyal et al. 2017, "Accurate, Large Minibatch SGD", section 5.1).
"""

from __future__ import annotations

import torch
from torch import nn

# (block type, blocks per stage)
ARCHS: dict[str, tuple[str, tuple[int, int, int, int]]] = {
    "resnet18": ("basic", (2, 2, 2, 2)),
    "resnet34": ("basic", (3, 4, 6, 3)),
    "resnet50": ("bottleneck", (3, 4, 6, 3)),
    "resnet101": ("bottleneck", (3, 4, 23, 3)),
}


def _conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)


def _conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(cin, cout, 1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = _conv3x3(cin, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(_conv1x1(cin, planes, stride), nn.BatchNorm2d(planes))

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = _conv1x1(cin, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = _conv3x3(planes, planes, stride)  # v1.5: stride on the 3x3
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = _conv1x1(planes, cout)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(_conv1x1(cin, cout, stride), nn.BatchNorm2d(cout))

    @property
    def last_bn(self) -> nn.BatchNorm2d:
        return self.bn3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(
        self,
        block: type[BasicBlock] | type[Bottleneck],
        layers: tuple[int, int, int, int],
        num_classes: int = 1000,
        *,
        width: int = 64,
        stem: str = "imagenet",
        zero_init_residual: bool = False,
    ) -> None:
        super().__init__()
        if stem == "imagenet":
            self.stem = nn.Sequential(
                nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
        elif stem == "cifar":
            self.stem = nn.Sequential(_conv3x3(3, width), nn.BatchNorm2d(width), nn.ReLU(inplace=True))
        else:
            raise ValueError(f"unknown stem {stem!r}: expected 'imagenet' or 'cifar'")
        cin = width
        stages = []
        for i, n in enumerate(layers):
            planes = width * 2**i
            blocks: list[nn.Module] = []
            for j in range(n):
                blocks.append(block(cin, planes, stride=2 if (i > 0 and j == 0) else 1))
                cin = planes * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        if zero_init_residual:
            for m in self.modules():
                if isinstance(m, BasicBlock | Bottleneck):
                    nn.init.zeros_(m.last_bn.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def build_model(
    arch: str,
    num_classes: int,
    *,
    width: int = 64,
    stem: str = "imagenet",
    zero_init_residual: bool = False,
) -> ResNet:
    """Build ``arch`` (one of :data:`ARCHS`) for ``num_classes`` outputs."""
    if arch not in ARCHS:
        raise ValueError(f"unknown architecture {arch!r}: expected one of {', '.join(ARCHS)}")
    kind, layers = ARCHS[arch]
    block: type[BasicBlock] | type[Bottleneck] = BasicBlock if kind == "basic" else Bottleneck
    return ResNet(block, layers, num_classes, width=width, stem=stem, zero_init_residual=zero_init_residual)
