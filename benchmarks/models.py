"""The two reference models of DESIGN.md's performance targets, shared by the benchmarks."""

from __future__ import annotations

import torch
from torch import nn


def transformer() -> tuple[nn.Module, torch.Tensor]:
    """4-layer TransformerEncoder, d=128, seq 64, batch 16."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(128, 4, batch_first=True)
    model = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    return model, torch.randn(16, 64, 128)


def cnn(widths: tuple[int, ...] = (64, 128, 256, 512, 512)) -> tuple[nn.Module, torch.Tensor]:
    """5 conv blocks (conv-BN-ReLU, max-pooling; VGG widths by default) and a linear
    head, batch 32x3x32x32."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    cin = 3
    for i, cout in enumerate(widths):
        blocks += [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU()]
        if i < 4:
            blocks.append(nn.MaxPool2d(2))
        cin = cout
    model = nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 10))
    return model, torch.randn(32, 3, 32, 32)


def mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def narrow_cnn() -> tuple[nn.Module, torch.Tensor]:
    """The same CNN with narrow layers (32..256 channels): more activation per FLOP, so
    the relative cost of per-module statistics is higher."""
    return cnn((32, 64, 128, 128, 256))
