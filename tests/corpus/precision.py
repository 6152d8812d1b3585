"""Precision: valid values that a float16 operation cannot hold (its maximum is 65504). The
right fix is to run that part in float32 (``float32``), not to drop the valid rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import Batch, Loop, Scenario, gen, sgd


class Net(nn.Module):
    def __init__(self, half: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.enc = nn.Linear(32, 32)
        self.head = nn.Linear(32, 3)
        if half:
            self.half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.enc(x))).float()


def _raw_units(fixed: bool) -> Loop:
    # https://github.com/chainer/chainer/pull/6738 (in float16, Linear leads to infinity)
    def batch(step: int) -> Batch:
        g = gen(step, 31)
        x = torch.rand(16, 32, generator=g)
        y = (x[:, 0] > 0.5).long()
        # from step 6 the next shard, in raw units: valid in float16 itself
        x = 40000.0 + 25000.0 * x if step >= 6 else 300.0 * x
        return (x if fixed else x.half()), y

    return Loop(lambda: Net(half=not fixed), batch, F.cross_entropy, opt=sgd(1e-4))


class Scores(nn.Module):
    """Attention scores computed in half precision to save memory (an explicit cast)."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qk = nn.Linear(8, 16)
        self.fixed = fixed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        if not self.fixed:
            q, k = q.half(), k.to(torch.float16)
        s = q @ k.transpose(1, 2)
        return torch.softmax(s.float(), dim=-1)


class ScoreNet(nn.Module):
    def __init__(self, fixed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.scores = Scores(fixed)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out((self.scores(x) @ x).mean(1))


def _half_scores(fixed: bool) -> Loop:
    # https://github.com/motional/nuplan-devkit/issues/91 (FP16 overflow in a sum: NaN)
    def batch(step: int) -> Batch:
        g = gen(step, 32)
        x = torch.randn(4, 6, 8, generator=g) * (1.0 if step < 6 else 150.0)
        return x, torch.randint(0, 2, (4,), generator=g)

    return Loop(lambda: ScoreNet(fixed), batch, F.cross_entropy, opt=sgd(1e-3))


class HalfRegressor(nn.Module):
    def __init__(self, half: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)
        if half:
            self.half()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _half_squared_error(fixed: bool) -> Loop:
    # https://github.com/Qualcomm-AI-research/geometric-algebra-transformer/issues/15
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (out.float() - y.float()).pow(2).mean() if fixed else (out - y).pow(2).mean()

    def batch(step: int) -> Batch:
        g = gen(step, 33)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(1, keepdim=True) * (1.0 if step < 6 else 400.0)  # prices in cents
        return (x, y) if fixed else (x.half(), y.half())

    return Loop(lambda: HalfRegressor(half=not fixed), batch, loss, opt=sgd(1e-4))


SCENARIOS = [
    Scenario(
        "float16 Linear overflow on valid raw-unit inputs",
        "precision",
        "float32",
        "https://github.com/chainer/chainer/pull/6738",
        _raw_units,
    ),
    Scenario(
        "attention scores cast to float16 by hand (.half())",
        "precision",
        "float32",
        "https://github.com/motional/nuplan-devkit/issues/91",
        _half_scores,
    ),
    Scenario(
        "squared error computed in float16",
        "precision",
        "float32",
        "https://github.com/Qualcomm-AI-research/geometric-algebra-transformer/issues/15",
        _half_squared_error,
    ),
]
