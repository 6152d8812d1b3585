"""A loss that writes its target in place (``target[target < 0] = 0``, a common way to
fold an ignore label) must not change the user's target through nbdebug, and every pass
and replay must start from the target as the user gave it. Expected values come from
plain torch on a copy of the target."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import nbdebug
from nbdebug.core.batch import compute_loss, own_target


def _fold_ignored(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    target[target < 0] = 0  # in place, as some training scripts do
    return nn.functional.cross_entropy(out, target)


def _case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(5, 6)
    y = torch.tensor([2, -1, 1, -1, 0])
    return model, x, y


def test_trace_leaves_a_target_the_loss_writes_unchanged() -> None:
    model, x, y = _case()
    given = y.clone()
    folded = y.clone()
    folded[folded < 0] = 0
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(model(x), folded))
    tr = nbdebug.trace(model, x, y, loss_fn=_fold_ignored)
    assert torch.equal(y, given)  # the user's tensor: not written
    assert tr.loss == pytest.approx(expected, rel=1e-6)


def test_every_call_starts_from_the_target_as_given() -> None:
    # a loss that writes its target cumulatively: each call sees the original values
    def shifting(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        target += 1
        return nn.functional.cross_entropy(out, target % 3)

    model, x, _ = _case()
    y = torch.tensor([0, 1, 2, 0, 1])
    out = model(x)
    expected = nn.functional.cross_entropy(out, (y + 1) % 3)
    for _ in range(3):
        assert torch.equal(compute_loss(out, y, shifting), expected)
    assert torch.equal(y, torch.tensor([0, 1, 2, 0, 1]))


def test_own_target_copies_tensors_in_containers_and_keeps_the_rest() -> None:
    t = torch.arange(4)
    mask = torch.ones(4, dtype=torch.bool)
    pair = collections.namedtuple("pair", "y mask")
    for target in ((t, mask), [t, mask], pair(t, mask), {"y": t, "mask": mask, "k": 3}):
        copied = own_target(target)
        assert type(copied) is type(target)
        values = list(copied.values()) if isinstance(copied, dict) else list(copied)
        originals = list(target.values()) if isinstance(target, dict) else list(target)
        for c, o in zip(values, originals):
            if isinstance(o, torch.Tensor):
                assert c is not o and torch.equal(c, o)
                assert c.data_ptr() != o.data_ptr()
            else:
                assert c == o
    assert own_target("labels") == "labels" and own_target(None) is None
