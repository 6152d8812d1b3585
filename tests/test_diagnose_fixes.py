"""The fixes a user would choose (issue 31, item 4): the built-in a hand-written chain
reimplements, all epsilons of a module together, float32 for a module that casts to half
precision itself, drop_rows after float32 for valid rows, and the plain re-run's own kind.
Expected values are worked out in plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nbdebug
from nbdebug.analysis.diagnose.fix_builtin import BuiltinMode
from nbdebug.analysis.diagnose.fix_combined import CombinedFix
from nbdebug.analysis.diagnose.fix_epsilon import EpsilonFix
from nbdebug.analysis.diagnose.fix_float32 import NoHalfCasts
from nbdebug.analysis.diagnose.fix_rows import out_of_range_rows
from nbdebug.analysis.diagnose.rewrite import RewriteMode
from nbdebug.core.optable import OpFamily


def _log_softmax_by_hand(z: torch.Tensor) -> torch.Tensor:
    e = torch.exp(z)
    return torch.log(e / e.sum(dim=-1, keepdim=True))


def test_the_builtin_mode_computes_what_the_builtins_compute() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 5, generator=g)
    with BuiltinMode() as mode:
        got = _log_softmax_by_hand(z)
        lse = torch.log(torch.exp(z).sum(-1, keepdim=True))
        centred = z - z.mean(dim=-1, keepdim=True)
        norm = centred / z.std(dim=-1, keepdim=True)
    torch.testing.assert_close(got, F.log_softmax(z, dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(z, dim=-1, keepdim=True))
    torch.testing.assert_close(norm, F.layer_norm(z, (5,)))
    assert mode.found == ["F.log_softmax", "torch.logsumexp", "F.layer_norm"]
    assert mode.calls == 4  # the division of the softmax, its log, the logsumexp, the norm


def test_the_builtin_is_finite_where_the_hand_written_chain_overflows() -> None:
    z = torch.tensor([[200.0, 0.0, -5.0]], requires_grad=True)
    assert not torch.isfinite(_log_softmax_by_hand(z.detach())).all()
    with BuiltinMode():
        out = _log_softmax_by_hand(z)
    out.sum().backward()
    expected = F.log_softmax(z.detach(), dim=-1)
    torch.testing.assert_close(out.detach(), expected)
    assert z.grad is not None and torch.isfinite(z.grad).all()
    # dry: nothing replaced, the chain recognised
    with BuiltinMode(dry=True) as dry:
        same = _log_softmax_by_hand(z.detach())
    assert not torch.isfinite(same).all() and dry.found == ["F.log_softmax"] and dry.calls == 0


def test_a_constant_row_standardised_by_hand_becomes_layer_norm() -> None:
    x = torch.tensor([[0.7, 0.7, 0.7, 0.7], [1.0, 2.0, 3.0, 4.0]])
    with BuiltinMode():
        y = (x - x.mean(dim=1, keepdim=True)) / x.std(dim=1, keepdim=True)
    torch.testing.assert_close(y, F.layer_norm(x, (4,)))
    assert torch.equal(y[0], torch.zeros(4))


def test_casts_to_half_precision_stay_float32_inside_no_half_casts() -> None:
    x = torch.randn(3, 2)
    with NoHalfCasts() as mode:
        a, b, c = x.half(), x.to(torch.float16), x.to(dtype=torch.bfloat16)
        d = x.to(torch.float64)  # not a cast to half precision: made
    assert (a.dtype, b.dtype, c.dtype, d.dtype) == (torch.float32,) * 3 + (torch.float64,)
    assert mode.calls == 3 and torch.equal(a, x)
    assert x.half().dtype == torch.float16  # outside, as ever


class CastingBlock(nn.Module):
    """Scores in float16 by an explicit cast inside the forward (float32 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, dim=-1)
        s = q.half() @ k.half().transpose(1, 2)
        return torch.softmax(s.float(), dim=-1) @ x


class CastingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = CastingBlock()
        self.out = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(x).mean(1))


def test_a_module_that_casts_to_float16_itself_gets_the_float32_fix_first() -> None:
    model = CastingNet()
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)) * 200.0
    y = torch.tensor([0, 1])
    # plain torch: the scores overflow float16, and in float32 they do not
    q, k = model.block.qk(x).chunk(2, dim=-1)
    assert not torch.isfinite(q.half() @ k.half().transpose(1, 2)).all()
    assert torch.isfinite(q @ k.transpose(1, 2)).all()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    d = nbdebug.diagnose(model, x, y, F.cross_entropy, optimizer=opt, progress=False)
    top = d.results[0]
    assert top.kind == "float32" and top.module == "block" and top.finite, d
    assert "half precision" in d.cause.statement
    drop = [r for r in d.results if r.kind == "drop_rows"]
    assert all(r.rank > top.rank for r in drop)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_combined_fix_needs_two_epsilons_of_one_module() -> None:
    with pytest.raises(ValueError, match="two or more epsilon fixes of one module"):
        CombinedFix([EpsilonFix("a", "exp")])
    with pytest.raises(ValueError, match="of one module"):
        CombinedFix([EpsilonFix("a", "exp"), EpsilonFix("b", "log")])
    both = CombinedFix([EpsilonFix("a", "exp"), EpsilonFix("a", "log")])
    assert both.kind == "epsilon" and both.module == "a"
    assert "exp(x - max)" in both.describe() and "log(x.clamp_min(eps))" in both.describe()


def test_the_softmax_epsilon_zeroes_masked_rows_not_overflowed_ones() -> None:
    s = torch.tensor(
        [[float("-inf")] * 3, [float("inf"), 0.0, 1.0], [0.0, 1.0, 2.0]]  # masked, overflow
    )
    with RewriteMode(OpFamily.SOFTMAX) as mode:
        p = torch.softmax(s, dim=-1)
    plain = torch.softmax(s, dim=-1)
    assert torch.equal(p[0], torch.zeros(3))  # the fully masked row
    assert torch.isnan(p[1]).all() and torch.isnan(plain[1]).all()  # left as it was
    torch.testing.assert_close(p[2], plain[2])
    assert mode.calls == 1


def test_out_of_range_rows_are_those_no_float32_square_can_hold() -> None:
    x = torch.randn(5, 3)
    x[1, 2], x[3, 0] = 3e37, -2e19
    y = torch.zeros(5)
    y[4] = 1e20
    rows = out_of_range_rows((x, y), 5)
    limit = torch.finfo(torch.float32).max ** 0.5
    expected = ((x.abs() > limit).any(1) | (y.abs() > limit)).nonzero().flatten().tolist()
    assert rows == expected == [1, 3, 4]
    assert out_of_range_rows((x, y), None) == []


def test_the_plain_rerun_that_fails_again_is_a_rerun_row() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    x = torch.randn(6, 4)
    x[2, 1] = float("nan")
    d = nbdebug.diagnose(model, x, torch.zeros(6, dtype=torch.long), F.cross_entropy)
    plain = next(r for r in d.results if r.kind == "rerun")
    assert not plain.finite and plain.snippet() == ""
    assert "not_reproducible" not in set(d.to_frame()["kind"])
    assert d.cause.kind == "drop_rows" and d.cause.rows == [2]
