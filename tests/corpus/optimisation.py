"""Optimisation: runs that diverge through their updates (a learning rate too high, a
warm-up without a cap, recurrent nets without clipping). The weights grow over several
steps before anything is non-finite, so the right fix (``lower_lr``, ``clip_grad``) shows
only over the steps before the failure: these need the rewind window (``window=True``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from models import ReluRNN
from torch import nn

from . import Batch, Loop, Scenario, gen, sgd


def _regression(step: int) -> Batch:
    g = gen(step, 41)
    x = torch.randn(16, 8, generator=g)
    return x, x.sum(1, keepdim=True) * 3 + 0.1 * torch.randn(16, 1, generator=g)


def _sequences(step: int) -> Batch:
    g = gen(step, 42)
    x = torch.randn(8, 20, 4, generator=g)
    return x, x[:, :, 0].sum(1, keepdim=True)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def deep() -> nn.Module:
    """Eight ReLU layers, no normalisation."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(8):
        layers += [nn.Linear(8 if i == 0 else 32, 32), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(32, 1))


def _lr_too_high(fixed: bool) -> Loop:
    # https://theneuralbase.com/tensorflow/learn/beginner/nan-loss-learning-rate-or-data/
    return Loop(mlp, _regression, F.mse_loss, opt=sgd(0.01 if fixed else 3.0, 0.0), steps=30)


def _uncapped_warmup(fixed: bool) -> Loop:
    # https://github.com/mlcommons/hpc/pull/27 (a warm-up schedule that goes wrong)
    return Loop(
        mlp,
        _regression,
        F.mse_loss,
        opt=sgd(0.001, 0.0),
        schedule=(lambda t: min(1.0 + 3 * t, 10.0)) if fixed else (lambda t: 1.0 + 3 * t),
        steps=70,
    )


def _relu_rnn(fixed: bool) -> Loop:
    # https://github.com/Marcovaldong/lstmp.pytorch/issues/2 (NaN after n iterations: clip)
    return Loop(
        ReluRNN, _sequences, F.mse_loss, opt=sgd(0.005), clip=1.0 if fixed else None, steps=35
    )


def _deep_without_clipping(fixed: bool) -> Loop:
    # https://theneuralbase.com/keras/learn/beginner/nan-loss-gradient-explosion/
    def batch(step: int) -> Batch:
        x, y = _regression(step)
        return x * 30.0, y * 30.0  # unscaled features and targets

    return Loop(deep, batch, F.mse_loss, opt=sgd(0.01), clip=1.0 if fixed else None, steps=30)


SCENARIOS = [
    Scenario(
        "SGD learning rate far too high",
        "optimisation",
        "lower_lr",
        "https://theneuralbase.com/tensorflow/learn/beginner/nan-loss-learning-rate-or-data/",
        _lr_too_high,
        window=True,
    ),
    Scenario(
        "a warm-up that never stops raising the learning rate",
        "optimisation",
        "lower_lr",
        "https://github.com/mlcommons/hpc/pull/27",
        _uncapped_warmup,
        window=True,
    ),
    Scenario(
        "ReLU RNN without gradient clipping",
        "optimisation",
        "clip_grad",
        "https://github.com/Marcovaldong/lstmp.pytorch/issues/2",
        _relu_rnn,
        window=True,
    ),
    Scenario(
        "deep ReLU MLP on unscaled data without gradient clipping",
        "optimisation",
        "clip_grad",
        "https://theneuralbase.com/keras/learn/beginner/nan-loss-gradient-explosion/",
        _deep_without_clipping,
        window=True,
    ),
]
