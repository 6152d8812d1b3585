"""Healthy runs for the spike detector's false-alarm count that are not its benchmark's own
models (``bench_spike.py``): small models trained on scikit-learn's bundled digits until
their batch loss sits near its floor, where it is heavy-tailed (a batch with one hard
example has 10x the loss of the median batch), with the schedules and batch sizes people
use. The detector before the loss was scored in log space flagged 4 to 21 steps in each
of these in 3,400 (a robust z-score of the loss as it is calls every such batch a
10-sigma spike).

Each is a :data:`bench_spike.Case`: a model factory, a batch function of a generator, a
loss, an optimizer factory, an lr multiplier by step and a gradient-norm clip.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from sklearn.datasets import load_digits
from torch import nn

_X, _Y = load_digits(return_X_y=True)
X = torch.tensor(_X / 16.0, dtype=torch.float32)
Y = torch.tensor(_Y)

Batch = tuple[torch.Tensor, torch.Tensor]


def digits(size: int) -> Callable[[torch.Generator], Batch]:
    """Batches of ``size`` digits drawn at random (with replacement across batches)."""

    def batch(g: torch.Generator) -> Batch:
        idx = torch.randint(0, len(X), (size,), generator=g)
        return X[idx], Y[idx]

    return batch


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(512, 10),
    )


def bn_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 256),
        nn.BatchNorm1d(256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.BatchNorm1d(256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


class RowGRU(nn.Module):
    """A GRU reading a digit's 8 rows as a sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.gru, self.head = nn.GRU(8, 32, batch_first=True), nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.gru(x.view(-1, 8, 8))[0][:, -1])
        return out


def cosine_restarts(period: int) -> Callable[[int], float]:
    return lambda s: 0.5 * (1.0 + math.cos(math.pi * (s % period) / period))


def cases() -> dict[str, tuple]:
    """The healthy runs, by name (:data:`bench_spike.Case` tuples)."""
    ce = nn.functional.cross_entropy
    one = lambda step: 1.0  # noqa: E731
    return {
        "digits MLP (SGD lr 0.01, batch 1)": (
            mlp,
            digits(1),
            ce,
            lambda p: torch.optim.SGD(p, lr=0.01),
            one,
            None,
        ),
        "digits CNN with BatchNorm (SGD momentum, cosine warm restarts every 500)": (
            cnn,
            digits(32),
            ce,
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            cosine_restarts(500),
            None,
        ),
        "digits MLP (SGD momentum, lr x0.1 every 1,000 steps)": (
            mlp,
            digits(16),
            ce,
            lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
            lambda s: 0.1 ** (s // 1000),
            None,
        ),
        "digits GRU over rows (Adam, batch 16)": (
            RowGRU,
            digits(16),
            ce,
            lambda p: torch.optim.Adam(p, lr=3e-3),
            one,
            None,
        ),
    }


def recovering() -> dict[str, tuple]:
    """Runs that train but not calmly: Adam at lr 3e-3 on the memorised digits, whose
    batch loss at 1e-4 rises 10-250x for tens of steps now and then and comes back (the
    late-training loss spikes of Adam, whose second-moment estimate has decayed with the
    gradients). Their flagged steps are spikes the detector is for; the benchmark
    prints them apart, not as false alarms."""
    return {
        "digits MLP with BatchNorm (Adam lr 3e-3, batch 64)": (
            bn_mlp,
            digits(64),
            nn.functional.cross_entropy,
            lambda p: torch.optim.Adam(p, lr=3e-3),
            lambda step: 1.0,
            None,
        ),
    }
