"""Small hand-built networks shaped like torchvision's AlexNet, VGG and ResNet (torchvision is not
importable in CI), with the same module types and forward code patterns."""

from __future__ import annotations

import torch
from torch import nn


def alexnet_like(num_classes: int = 10, width: int = 8) -> nn.Module:
    w = width
    features = nn.Sequential(
        nn.Conv2d(3, w, kernel_size=11, stride=4, padding=2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(w, 2 * w, kernel_size=5, padding=2),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
        nn.Conv2d(2 * w, 3 * w, kernel_size=3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(3 * w, 3 * w, kernel_size=3, padding=1),
        nn.ReLU(inplace=True),
        nn.Conv2d(3 * w, 2 * w, kernel_size=3, padding=1),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(kernel_size=3, stride=2),
    )
    classifier = nn.Sequential(
        nn.Dropout(0.5),
        nn.Linear(2 * w * 4, 32),
        nn.ReLU(inplace=True),
        nn.Dropout(0.5),
        nn.Linear(32, 32),
        nn.ReLU(inplace=True),
        nn.Linear(32, num_classes),
    )
    return _Classifier(features, nn.AdaptiveAvgPool2d((2, 2)), classifier)


def vgg_like(num_classes: int = 10, width: int = 4, batch_norm: bool = False) -> nn.Module:
    layers: list[nn.Module] = []
    channels = 3
    for out, repeats in ((width, 2), (2 * width, 2), (4 * width, 3)):
        for _ in range(repeats):
            layers.append(nn.Conv2d(channels, out, kernel_size=3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU(inplace=True))
            channels = out
        layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
    classifier = nn.Sequential(nn.Linear(channels * 4, 24), nn.ReLU(True), nn.Dropout(), nn.Linear(24, num_classes))
    return _Classifier(nn.Sequential(*layers), nn.AdaptiveAvgPool2d((2, 2)), classifier)


class _Classifier(nn.Module):
    def __init__(self, features: nn.Module, avgpool: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.features, self.avgpool, self.classifier = features, avgpool, classifier

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * 4)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNetLike(nn.Module):
    def __init__(self, block: type[BasicBlock] | type[Bottleneck], layers: tuple[int, ...], width: int = 8) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        stages = []
        for i, blocks in enumerate(layers):
            stages.append(self._stage(block, width * 2**i, blocks, 1 if i == 0 else 2))
        self.layers = nn.Sequential(*stages)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(self.inplanes, 10)

    def _stage(self, block: type[BasicBlock] | type[Bottleneck], planes: int, blocks: int, stride: int) -> nn.Module:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * block.expansion, 1, stride, bias=False),
                nn.BatchNorm2d(planes * block.expansion),
            )
        mods = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        mods += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*mods)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.avgpool(self.layers(x))
        return self.fc(torch.flatten(x, 1))


def randomize_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm non-trivial running statistics and affine parameters, so folding is tested."""
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            n = m.num_features
            m.running_mean.copy_(torch.randn(n, generator=gen) * 0.1)
            m.running_var.copy_(torch.rand(n, generator=gen) + 0.5)
            m.weight.data.copy_(torch.rand(n, generator=gen) + 0.5)
            m.bias.data.copy_(torch.randn(n, generator=gen) * 0.1)
    return model
