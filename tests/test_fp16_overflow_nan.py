"""A float16 overflow whose Inf turns into NaN before anything sees it is still a float16
overflow: ``fp16_overflow_risk`` (error) at the origin, with the value against 65504, not the
generic ``nonfinite_origin``; a NaN that float16 did not make (a log of a negative value,
acos out of range, a bfloat16 or float32 overflow) is not reported as one."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nbdebug
from nbdebug.analysis.checks.base import Finding


def origin_finding(tr: Any) -> Finding:
    """The error finding that names the trace's origin (the one the debugger jumps to)."""
    assert tr.origin is not None
    found = [f for f in nbdebug.check(tr) if f.severity == "error" and f.event == tr.origin.index]
    assert found, nbdebug.check(tr)
    return found[0]


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


class KeptInFloat32(nn.Module):
    """``pre`` runs outside autocast and passes x on (identity); ``fc`` runs in float16
    under autocast, whose cast of a value over 65504 makes +-Inf, and inf*w + (-inf)*w NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(4, 4)
        self.fc = nn.Linear(4, 2)
        with torch.no_grad():
            self.pre.weight.copy_(torch.eye(4))
            self.pre.bias.zero_()
            self.fc.weight.copy_(torch.tensor([[1.0, -1.0, 0.5, 0.5], [1.0, 1.0, -1.0, 1.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            h = self.pre(x.float())
        return self.fc(h)


def batch(value: float) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    x[1] = value
    return x, y


def test_a_value_over_65504_cast_by_autocast_into_nan_is_an_fp16_overflow() -> None:
    m = KeptInFloat32()
    x, y = batch(1e5)
    with torch.autocast("cpu", dtype=torch.float16):
        tr = nbdebug.trace(m, x, y, mse)
    o = tr.origin
    assert o is not None and (o.module, o.dtype, o.samples) == ("fc", "float16", [1])
    assert o.stats.n_nan and not o.stats.n_inf  # the Inf did not survive
    f = origin_finding(tr)
    assert (f.code, f.severity, f.module, f.rows) == ("fp16_overflow_risk", "error", "fc", [1])
    assert f.evidence["threshold"] == 65504.0 and f.evidence["reached_absmax"] == 1e5
    assert "1e+05 reached it, over 65504" in f.advice and "became NaN" in f.advice
    assert "run it in float32" in f.advice and f.fix
    assert nbdebug.check(tr).of("nonfinite_origin") == []


def test_the_same_overflow_with_the_inf_surviving_keeps_its_finding() -> None:
    m = KeptInFloat32()
    x, y = batch(4e4)  # finite in float16; fc's output passes 65504 and stays Inf
    with torch.autocast("cpu", dtype=torch.float16):
        tr = nbdebug.trace(m, x, y, mse)
    f = origin_finding(tr)
    assert (f.code, f.module) == ("fp16_overflow_risk", "fc")
    assert "largest finite value 65504" in f.advice and "became NaN" not in f.advice
    assert "reached_absmax" not in f.evidence


def test_the_step_is_no_fp16_overflow_in_float32_or_bfloat16() -> None:
    m = KeptInFloat32()
    x, y = batch(1e5)
    assert nbdebug.trace(m, x, y, mse).origin is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tr = nbdebug.trace(m, x, y, mse)
    assert tr.origin is None and nbdebug.check(tr).of("fp16_overflow_risk") == []


class CastsItself(nn.Module):
    """An explicit ``.to(torch.float16)`` of values around 1e5 (Inf), a float16 Linear
    (NaN), a float32 output: the chain reads ``Tensor.to (inf) -> linear (NaN)``."""

    def __init__(self, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dtype = dtype
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2).to(dtype)
        with torch.no_grad():
            self.fc1.weight.mul_(1e5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x).to(self.dtype)).float()


def test_an_explicit_cast_to_float16_with_a_float32_output_is_an_fp16_overflow() -> None:
    torch.manual_seed(1)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    tr = nbdebug.trace(CastsItself(), x, y, F.mse_loss)
    o = tr.origin
    assert o is not None and o.module == "" and o.dtype == "float32"
    assert str(o.chain).startswith("Tensor.to (inf)")
    f = origin_finding(tr)
    assert (f.code, f.severity, f.module) == ("fp16_overflow_risk", "error", "")
    assert f.evidence["reached_absmax"] > 65504.0 and "over 65504" in f.advice
    assert f.advice.startswith("Tensor.to overflowed float16")
    assert nbdebug.check(tr).of("nonfinite_origin") == []


class Float64Cast(nn.Module):
    """A cast that overflows float32, not float16: float64 values of 1e300 to float32."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([[1.0, -1.0, 0.5, 0.5], [1.0, 1.0, -1.0, 1.0]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc((x.double() * 1e300).to(torch.float32))


def test_a_cast_overflowing_float32_is_not_an_fp16_overflow() -> None:
    x, y = batch(1e5)
    tr = nbdebug.trace(Float64Cast(), x, y, F.mse_loss)
    o = tr.origin
    assert o is not None and str(o.chain).startswith("Tensor.to (inf)")
    assert origin_finding(tr).code == "nonfinite_origin"
    assert nbdebug.check(tr).of("fp16_overflow_risk") == []


class SelfCancelling(nn.Module):
    """A matmul in the module's own code overflows float16 under autocast (+-Inf), then
    ``h - h`` turns every Inf into NaN: the output holds NaN only."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4, 2), 300.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.w
        return h - h


def test_an_inf_root_that_becomes_nan_inside_a_float16_module_is_an_fp16_overflow() -> None:
    x = torch.full((3, 4), 1.0)
    x[1] = 300.0  # 4 * 300 * 300 = 360000 > 65504: Inf in float16 only
    y = torch.zeros(3, 2)
    assert nbdebug.trace(SelfCancelling(), x, y, mse).origin is None
    with torch.autocast("cpu", dtype=torch.float16):
        tr = nbdebug.trace(SelfCancelling(), x, y, mse)
    o = tr.origin
    assert o is not None and o.dtype == "float16" and o.stats.n_nan and not o.stats.n_inf
    assert o.chain and o.chain[0].value == "inf"
    f = origin_finding(tr)
    assert (f.code, f.rows) == ("fp16_overflow_risk", [1]) and "became NaN" in f.advice


class LogOfLinear(nn.Module):
    """A genuine NaN in a float16 module: the log of a negative float16 value."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        with torch.no_grad():
            self.fc.weight.fill_(-1.0)
            self.fc.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.fc(x))


def test_a_log_of_a_negative_value_in_float16_is_not_an_fp16_overflow() -> None:
    x = torch.full((3, 4), -1.0)
    x[1] = 1.0  # fc gives -4 in row 1: log(-4) = NaN
    y = torch.zeros(3, 2)
    with torch.autocast("cpu", dtype=torch.float16):
        tr = nbdebug.trace(LogOfLinear(), x, y, mse)
    o = tr.origin
    assert o is not None and o.dtype == "float16" and o.samples == [1]
    assert origin_finding(tr).code == "log_of_nonpositive"
    assert nbdebug.check(tr).of("fp16_overflow_risk") == []


class AcosThenLinear(nn.Module):
    """A NaN that no overflow made, from a large finite input: acos(1e5) in float32, then a
    float16 Linear under autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.acos(x))


def test_a_nan_from_acos_of_a_large_input_in_float16_is_not_an_fp16_overflow() -> None:
    x, y = batch(1e5)
    x = x.clamp(-1, 1)
    x[1] = 1e5
    with torch.autocast("cpu", dtype=torch.float16):
        tr = nbdebug.trace(AcosThenLinear(), x, y, mse)
    o = tr.origin
    assert o is not None and o.dtype == "float16" and o.op == "torch.acos"
    assert origin_finding(tr).code == "nonfinite_origin"
    assert nbdebug.check(tr).of("fp16_overflow_risk") == []


class Cancelling(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(torch.tensor([[1e10, -1e10]]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_bfloat16_or_float32_overflow_into_nan_is_not_an_fp16_overflow() -> None:
    x = torch.ones(3, 2)
    x[1] = 1e30  # 1e40 overflows float32 and bfloat16 (3.4e38): inf - inf = NaN
    y = torch.zeros(3, 1)
    tr32 = nbdebug.trace(Cancelling(), x, y, mse)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tr16 = nbdebug.trace(Cancelling(), x, y, mse)
    assert tr16.origin is not None and tr16.origin.dtype == "bfloat16"
    for tr in (tr32, tr16):
        assert tr.origin is not None and tr.origin.module == "fc" and tr.origin.stats.n_nan
        assert origin_finding(tr).code == "nonfinite_origin"
        assert nbdebug.check(tr).of("fp16_overflow_risk") == []
