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


class _BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 conv-BN, a projection shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        skip = x if self.downsample is None else self.downsample(x)
        return self.relu(out + skip)


def resnet18() -> tuple[nn.Module, torch.Tensor]:
    """A ResNet-18-shaped CNN (torchvision's layout: 7x7 stem, 4 stages of 2 basic blocks,
    64..512 channels, 11.7M parameters), batch 16x3x64x64."""
    torch.manual_seed(0)
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.MaxPool2d(3, 2, 1),
    ]
    cin = 64
    for i, cout in enumerate((64, 128, 256, 512)):
        stride = 1 if i == 0 else 2
        layers += [_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)]
        cin = cout
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 1000))
    return model, torch.randn(16, 3, 64, 64)


def gpt2(n_layer: int = 12, n_embd: int = 768, n_head: int = 12) -> tuple[nn.Module, dict]:
    """GPT-2 (``transformers.GPT2LMHeadModel``) from a ``GPT2Config`` with random init,
    batch 2x64 token ids; the loss is ``output.loss`` (``labels`` = the ids)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head)
    model = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 64))
    return model, {"input_ids": ids, "labels": ids}


def gpt2_124m() -> tuple[nn.Module, dict]:
    """GPT-2 small: 12 x 768, 124M parameters."""
    return gpt2(12, 768, 12)


def gpt2_deep() -> tuple[nn.Module, dict]:
    """GPT-2 80 x 304 (8 heads): 105M parameters, 1,048 modules."""
    return gpt2(80, 304, 8)
