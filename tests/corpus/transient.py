"""Transient: the failing step replays finite from what the guard stored (a race in the
input pipeline, a fault outside the model, a module with state between calls). No change
to the step is needed (``not_reproducible``): the fix is in the pipeline or the hardware."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import Batch, Loop, Scenario, gen


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _xy(step: int, salt: int) -> Batch:
    g = gen(step, salt)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :3].argmax(1)


def _prefetch_race(fixed: bool) -> Loop:
    # https://github.com/NVIDIA/DIGITS/issues/883 (a data loader that is not deterministic)
    buf_x, buf_y = torch.empty(16, 8), torch.empty(16, dtype=torch.long)

    def batch(step: int) -> Batch:
        x, y = _xy(step, 61)
        if step == 7:
            x[3, 2] = float("nan")  # a record the decoder got wrong, this time
        if fixed:
            return x, y  # the fix: a batch of its own per step, not a shared buffer
        buf_x.copy_(x)
        buf_y.copy_(y)
        return buf_x, buf_y

    def prefetch(step: int, b: Batch) -> None:
        if not fixed:  # the next batch lands in the same buffer before the step is done
            nx, ny = _xy(step + 1, 61)
            buf_x.copy_(nx)
            buf_y.copy_(ny)

    def clean(step: int) -> Batch:
        x, y = batch(step)
        if fixed:
            keep = torch.isfinite(x).all(1)  # and the bad record dropped where it is seen
            return x[keep], y[keep]
        return x, y

    return Loop(mlp, clean, F.cross_entropy, after_backward=prefetch, steps=12)


class Flaky(nn.Module):
    """A fault outside the model's code (a bit flip in one kernel launch): the output of
    one call, at one step, is NaN."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 3)
        self.fixed = fixed
        self.calls = 0  # not in the state_dict: a replay starts from a fresh module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.fc1(x)
        if self.calls == 8 and not self.fixed:
            h = h * float("nan")
        return self.fc2(torch.relu(h))


def _hardware_fault(fixed: bool) -> Loop:
    # https://github.com/marian-nmt/marian-dev/issues/699 (NaN on one GPU model, not another)
    return Loop(lambda: Flaky(fixed), lambda s: _xy(s, 62), F.cross_entropy, steps=12)


class Cached(nn.Module):
    """Keeps the previous batch's mean as a plain attribute (not a buffer): a stale value
    from an empty batch poisons the next call, and a replay, which starts from the
    module's registered state, does not have it."""

    def __init__(self, fixed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 3)
        self.fixed = fixed
        self.last_mean: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(0, keepdim=True)
        shift = self.last_mean if self.last_mean is not None else torch.zeros_like(mean)
        self.last_mean = mean.detach()
        if self.fixed and not bool(torch.isfinite(shift).all()):
            shift = torch.zeros_like(mean)
        return self.fc(x - 0.1 * shift)


def _stale_cache(fixed: bool) -> Loop:
    # https://github.com/pytorch/pytorch/pull/4640 (state outside the step: not reproducible)
    def batch(step: int) -> Batch:
        x, y = _xy(step, 63)
        return (x[:0], y[:0]) if step == 6 else (x, y)  # an empty batch after filtering

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out, y) if len(y) else out.sum() * 0.0

    return Loop(lambda: Cached(fixed), batch, loss, steps=12)


SCENARIOS = [
    Scenario(
        "a prefetch overwrites the batch buffer before the step ends",
        "transient",
        "not_reproducible",
        "https://github.com/NVIDIA/DIGITS/issues/883",
        _prefetch_race,
    ),
    Scenario(
        "a fault outside the model (one NaN kernel launch)",
        "transient",
        "not_reproducible",
        "https://github.com/marian-nmt/marian-dev/issues/699",
        _hardware_fault,
    ),
    Scenario(
        "a stale cached mean from an empty batch",
        "transient",
        "not_reproducible",
        "https://github.com/pytorch/pytorch/pull/4640",
        _stale_cache,
    ),
]
