"""Data: records that hold NaN/Inf or values far outside the data's range. The right fix
is to leave the bad records out (``drop_rows``), and clean them in the pipeline."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import Batch, Loop, Scenario, gen


def mlp(d_in: int = 8, d_out: int = 3) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(d_in, 16), nn.ReLU(), nn.Linear(16, d_out))

    return make


def _clean(x: torch.Tensor, y: torch.Tensor) -> Batch:
    """The fix by hand: the records whose features and label are all finite."""
    keep = torch.isfinite(x.flatten(1)).all(1) & torch.isfinite(y.reshape(len(y), -1)).all(1)
    return x[keep], y[keep]


def _classes(step: int, salt: int) -> Batch:
    g = gen(step, salt)
    x = torch.randn(16, 8, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def _missing_value(fixed: bool) -> Loop:
    # https://www.baeldung.com/cs/ml-training-nan-errors-fix (3.1: a NaN in the input data)
    def batch(step: int) -> Batch:
        x, y = _classes(step, 1)
        if step == 7:
            x[5, 2] = float("nan")  # a missing value read as NaN
        return _clean(x, y) if fixed else (x, y)

    return Loop(mlp(), batch, F.cross_entropy)


def _log_of_zero_count(fixed: bool) -> Loop:
    # https://pythonkb.com/python-deep-learning-nan-loss-reasons (a log of 0 in preprocessing)
    def batch(step: int) -> Batch:
        g = gen(step, 2)
        counts = torch.poisson(torch.full((16, 8), 20.0), generator=g)
        if step == 5:
            counts[2, 0] = 0.0  # a record with a zero count
        x = torch.log(counts) - 3.0
        y = (counts[:, 0] > 20).long()
        return _clean(x, y) if fixed else (x, y)

    return Loop(mlp(d_out=2), batch, F.cross_entropy)


def _missing_label(fixed: bool) -> Loop:
    # https://taourl.com/read-2021368.html ("Input y contains NaN": a missing label)
    def batch(step: int) -> Batch:
        g = gen(step, 3)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(1, keepdim=True) + 0.1 * torch.randn(16, 1, generator=g)
        if step == 6:
            y[3] = float("nan")
        return _clean(x, y) if fixed else (x, y)

    return Loop(mlp(d_out=1), batch, F.mse_loss)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.head = nn.Linear(4 * 8 * 8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).flatten(1))


def _corrupt_image(fixed: bool) -> Loop:
    # https://github.com/pytorch/pytorch/issues/49844 (non-finite values reaching the loss)
    def batch(step: int) -> Batch:
        g = gen(step, 4)
        x = torch.rand(8, 1, 8, 8, generator=g)
        y = (x.mean((1, 2, 3)) > 0.5).long()
        if step == 5:
            x[6, 0, 3:5, 3:5] = float("nan")  # a truncated image file decoded as NaN
        return _clean(x, y) if fixed else (x, y)

    return Loop(SmallCNN, batch, F.cross_entropy)


def _empty_document(fixed: bool) -> Loop:
    # https://pythonkb.com/python-deep-learning-nan-loss-reasons (dividing by zero)
    def batch(step: int) -> Batch:
        g = gen(step, 5)
        counts = torch.poisson(torch.full((16, 8), 2.0), generator=g)
        if step == 6:
            counts[9] = 0.0  # an empty document: term frequencies 0 / 0
        x = counts / counts.sum(1, keepdim=True)
        y = (counts[:, 0] > counts[:, 1]).long()
        return _clean(x, y) if fixed else (x, y)

    return Loop(mlp(d_out=2), batch, F.cross_entropy)


def _wrong_units(fixed: bool) -> Loop:
    # https://www.alexacabs.in/why-is-loss-showing-as-nan.html (7: extreme outliers)
    def batch(step: int) -> Batch:
        g = gen(step, 6)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(1, keepdim=True)
        if step == 6:
            x[4, 1] = 3e37  # one reading stored in the wrong units
        if fixed:
            keep = x.abs().amax(1) < 1e6
            return x[keep], y[keep]
        return x, y

    return Loop(mlp(d_out=1), batch, F.mse_loss)


SCENARIOS = [
    Scenario(
        "a missing value read as NaN",
        "data",
        "drop_rows",
        "https://www.baeldung.com/cs/ml-training-nan-errors-fix",
        _missing_value,
    ),
    Scenario(
        "log of a zero count in preprocessing",
        "data",
        "drop_rows",
        "https://pythonkb.com/python-deep-learning-nan-loss-reasons",
        _log_of_zero_count,
    ),
    Scenario(
        "a missing regression label",
        "data",
        "drop_rows",
        "https://taourl.com/read-2021368.html",
        _missing_label,
    ),
    Scenario(
        "a corrupt image decoded as NaN",
        "data",
        "drop_rows",
        "https://github.com/pytorch/pytorch/issues/49844",
        _corrupt_image,
    ),
    Scenario(
        "an empty document: term frequencies 0/0",
        "data",
        "drop_rows",
        "https://pythonkb.com/python-deep-learning-nan-loss-reasons",
        _empty_document,
    ),
    Scenario(
        "a reading in the wrong units (3e37)",
        "data",
        "drop_rows",
        "https://www.alexacabs.in/why-is-loss-showing-as-nan.html",
        _wrong_units,
    ),
]
