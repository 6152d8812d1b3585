"""exp_overflow_risk warns before the overflow: from ``EXP_RISK_FRACTION`` of the exp limit."""

from __future__ import annotations

import math

import torch
from torch import nn

import nbdebug
from nbdebug.analysis.checks import base as cb


def hand_written_nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Softmax + log written by hand: exp overflows above the limit."""
    e = torch.exp(logits)
    return -(e / e.sum(1, keepdim=True)).log().gather(1, y[:, None]).mean()


def logits_model(scale: float) -> nn.Module:
    """Outputs whose largest magnitude is exactly ``scale``."""

    class Fixed(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x) / torch.tanh(x).abs().max() * scale

    return nn.Sequential(nn.Linear(4, 5), Fixed())


def test_the_fraction_is_documented_and_below_the_limit() -> None:
    assert 0 < cb.EXP_RISK_FRACTION < 1
    limit = cb.EXP_LIMIT["float32"]
    assert limit == math.log(torch.finfo(torch.float32).max)
    # beyond the fraction exp(x)**2 overflows: the warning comes before exp(x) itself does
    x = torch.tensor(cb.EXP_RISK_FRACTION * limit + 1.0)
    assert torch.isfinite(torch.exp(x)) and not torch.isfinite(torch.exp(x) ** 2)


def test_hand_written_loss_warns_while_everything_is_still_finite() -> None:
    limit = cb.EXP_LIMIT["float32"]
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randint(0, 5, (8,))
    between = logits_model(0.5 * (cb.EXP_RISK_FRACTION * limit + limit))  # ~66.5: finite exp
    tr = nbdebug.trace(between, x, y, hand_written_nll)
    # no inf in the forward yet (the backward's exp(x)**2 already overflows) ...
    assert tr.loss is not None and math.isfinite(tr.loss)
    assert all(e.finite for e in tr.events if e.phase in ("input", "forward", "loss"))
    found = nbdebug.check((between, x), target=y, loss_fn=hand_written_nll).of("exp_overflow_risk")
    assert [f.severity for f in found] == ["warning"]  # ... and already the warning
    ev = found[0].evidence
    assert ev["threshold"] == cb.EXP_RISK_FRACTION * limit and ev["limit"] == limit
    assert "88.72" in found[0].message and "44.36" in found[0].message
    calm = logits_model(0.9 * cb.EXP_RISK_FRACTION * limit)
    assert (
        nbdebug.check((calm, x), target=y, loss_fn=hand_written_nll).of("exp_overflow_risk") == []
    )


def test_softmax_module_warns_from_the_fraction() -> None:
    limit = cb.EXP_LIMIT["float32"]
    x = torch.randn(6, 4)
    for scale, expected in ((0.75 * limit, 1), (0.4 * limit, 0)):
        model = nn.Sequential(logits_model(scale), nn.Softmax(dim=1))
        found = nbdebug.check((model, x), loss_fn=lambda p: p[:, 0].mean()).of("exp_overflow_risk")
        assert len(found) == expected, (scale, found)
