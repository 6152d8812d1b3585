"""``nbdebug.compare_replays``: what "beyond what the dtype explains" means.

- stand-ins for infinity (``torch.finfo(dtype).min``/``max``, ``+-inf``) are the same value
  in every dtype, and huge values never make the relative difference NaN;
- a record is judged at the precision its value was computed in (the coarsest dtype along
  its history), so an exact upcast of bfloat16 values is not blamed for bfloat16's rounding,
  while a genuine overflow or precision loss in a float32 op is still named.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from state import assert_unchanged, fingerprint
from torch import nn

import nbdebug
from nbdebug.analysis.compare.result import EPS_FACTOR, LOOKAHEAD, differs

F32, F64, BF16, F16 = torch.float32, torch.float64, torch.bfloat16, torch.float16


def _tol(dtype: torch.dtype) -> float:
    return EPS_FACTOR * torch.finfo(dtype).eps


# -- stand-ins for infinity ------------------------------------------------------------


class MaskedAttention(nn.Module):
    """Additive padding mask made from ``finfo(dtype).min`` (the transformers idiom), or
    from ``-inf`` with ``masked_fill``."""

    def __init__(self, d: int = 8, fill: str = "finfo") -> None:
        super().__init__()
        self.q, self.o, self.fill = nn.Linear(d, d), nn.Linear(d, 3), fill

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(1, 2)
        if self.fill == "finfo":
            add = (1.0 - mask[:, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
            scores = scores + add
        else:
            scores = scores.masked_fill(mask[:, None, :] == 0, float("-inf"))
        return self.o((scores.softmax(-1) @ x).mean(1))


def _masked_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(4, 12, 8)
    mask = torch.ones(4, 12)
    mask[:, 9:] = 0  # three padded positions in every row
    return x, mask, torch.randint(0, 3, (4,))


def _plain_losses(
    model: nn.Module, batch: tuple[torch.Tensor, ...], low: torch.dtype
) -> tuple[float, float]:
    x, mask, y = batch
    lo, hi = copy.deepcopy(model).to(low), copy.deepcopy(model).double()
    l_lo = F.cross_entropy(lo(x.to(low), mask.to(low)).float(), y).item()
    l_hi = F.cross_entropy(hi(x.double(), mask.double()), y).item()
    return l_lo, l_hi


@pytest.mark.parametrize(("fill", "low"), [("finfo", F32), ("finfo", BF16), ("inf", F32)])
def test_a_mask_of_the_dtype_s_extreme_value_is_the_same_in_both_replays(
    fill: str, low: torch.dtype
) -> None:
    model, batch = MaskedAttention(fill=fill), _masked_batch()
    # plain torch: the two precisions mean the same model. The loss of a healthy model of
    # a few dozen ops agrees to well within 16 eps of the lower precision (each op rounds
    # by at most half an ulp; the errors do not compound over so few ops) ...
    l_lo, l_hi = _plain_losses(model, batch, low)
    assert abs(l_lo - l_hi) / abs(l_hi) < _tol(low)
    # ... and the masked positions weigh nothing after the softmax in either dtype
    x, mask, _ = batch
    for dtype in (low, F64):
        m = copy.deepcopy(model).to(dtype).requires_grad_(False)
        s = m.q(x.to(dtype)) @ x.to(dtype).transpose(1, 2)
        if fill == "finfo":
            s = s + (1.0 - mask[:, None, :].to(dtype)) * torch.finfo(dtype).min
        else:
            s = s.masked_fill(mask[:, None, :] == 0, float("-inf"))
        assert float(s.softmax(-1)[..., 9:].abs().max()) == 0.0
    before = fingerprint(model)
    r = nbdebug.compare_replays(
        model, batch[:2], batch[2], a=str(low).removeprefix("torch."), b="float64",
        loss_fn=F.cross_entropy,
    )  # fmt: skip
    assert_unchanged(before, model)
    assert r.ok, r.summary()
    assert r.notes == [] and r.compared == len(r.rows) > 10
    frame = r.to_frame()
    assert frame["relative"].notna().all() and (frame["relative"] <= frame["tolerance"]).all()


def test_t5_in_eval_mode_agrees_with_float64() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.T5Config(
        vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_decoder_layers=1,
        num_heads=2, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(cfg).eval()
    batch = {"input_ids": torch.randint(1, 40, (2, 6)), "labels": torch.randint(1, 40, (2, 5))}
    # plain torch: the float32 and float64 losses agree (16 eps of float32, as above)
    l32, l64 = t5(**batch).loss.item(), copy.deepcopy(t5).double()(**batch).loss.item()
    assert abs(l32 - l64) / l64 < _tol(F32)
    r = nbdebug.compare_replays(t5, batch)
    assert r.ok, r.summary()


def test_stand_ins_for_infinity_are_equal_and_the_relative_difference_is_never_nan() -> None:
    n = 256  # the float64 norm of 256 values of finfo(float64).min overflows to inf
    assert math.isinf(float(torch.linalg.vector_norm(torch.full((n,), -1.7e308, dtype=F64))))
    lo32, lo64 = torch.finfo(F32).min, torch.finfo(F64).min
    ordinary = torch.linspace(-3, 3, n, dtype=F64)
    a = torch.cat([torch.full((n,), lo32), ordinary.float()])
    b = torch.cat([torch.full((n,), lo64, dtype=F64), ordinary])
    reason, rel, tol, _ = differs(a, b, None)
    # the ordinary half: float32 rounding of linspace, relative to its own norm
    expected = float((ordinary.float().double() - ordinary).norm() / ordinary.norm())
    assert reason == "" and rel == pytest.approx(expected, rel=1e-6) and tol == _tol(F32)
    # every stand-in for plus (minus) infinity is the same value, whatever the dtypes
    hi16, hi64 = torch.finfo(F16).max, torch.finfo(F64).max
    extremes64 = torch.tensor([hi64, lo64], dtype=F64)
    assert differs(torch.tensor([hi16, -hi16], dtype=F16), extremes64, None)[0] == ""
    inf = torch.tensor([float("inf"), float("-inf")])
    assert differs(inf.half(), extremes64, None)[0] == ""
    assert differs(inf, inf.double(), None)[0] == ""
    nan = torch.tensor([float("nan"), 1.0])
    assert differs(nan, nan.double(), None)[0] == ""
    # ... but a real Inf against an ordinary value, or of the other sign, is a difference
    assert differs(inf, torch.tensor([1e39, -1.0], dtype=F64), None)[0] == "Inf vs finite"
    assert differs(inf, extremes64.flip(0), None)[0] == "Inf of the other sign"
    # extremes of opposite signs are compared as numbers: far apart
    far = differs(torch.tensor([lo32]), torch.tensor([hi64], dtype=F64), None)
    assert far[0].startswith("relative") and far[1] == pytest.approx(1.0)
    # huge ordinary values (their float64 norm overflows): a relative difference of 1e-12
    big = torch.full((n,), 1e308, dtype=F64)
    assert math.isinf(float(torch.linalg.vector_norm(big)))
    reason, rel, _, _ = differs(big * (1 + 1e-12), big, 1e-15)
    assert reason.startswith("relative") and rel == pytest.approx(1e-12, rel=1e-3)


# -- the precision a value was computed in -------------------------------------------------


class RMSNorm(nn.Module):
    """The T5 / LLaMA pattern: the statistics in float32, whatever the model's dtype."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h32 = h.to(F32)
        h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.w * h32.to(self.w.dtype)


class SoftmaxIn32(nn.Module):
    """LLaMA's attention softmax: ``softmax(..., dtype=torch.float32).to(input dtype)``."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.softmax(h, dim=-1, dtype=F32).to(h.dtype) * h.shape[-1]


class After(nn.Module):
    """``step`` computed in at least float32 (float32 for a 16-bit model, float64 for a
    float64 one), then back to the model's dtype."""

    def __init__(self, step: str) -> None:
        super().__init__()
        self.step = step

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        up = h.to(torch.promote_types(h.dtype, F32))
        if self.step == "cosh":  # past float32's range: |h| >= 1 somewhere after RMSNorm
            return torch.cosh(up * 100).to(h.dtype)
        return (up * 1e5).to(h.dtype)  # past float16's 65504 when h is float16


def _rms_model(*middle: nn.Module) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), RMSNorm(16), *middle, nn.Linear(16, 3))
    return model, torch.randn(8, 16), torch.randint(0, 3, (8,))


@pytest.mark.parametrize("low", ["bfloat16", "float16"])
@pytest.mark.parametrize("softmax", [False, True])
def test_an_exact_upcast_inherits_the_precision_of_its_input(low: str, softmax: bool) -> None:
    model, x, y = _rms_model(*([SoftmaxIn32()] if softmax else []))
    dtype = getattr(torch, low)
    lo = copy.deepcopy(model).to(dtype).requires_grad_(False)
    hi = copy.deepcopy(model).double().requires_grad_(False)
    # plain torch: the upcast is exact (it round-trips), so it adds no error; the error it
    # carries is the low precision's, already there in the Linear before it ...
    h = lo[0](x.to(dtype))
    assert torch.equal(h.to(F32).to(dtype), h)
    h64 = hi[0](x.double())
    inherited = float((h.double() - h64).norm() / h64.norm())
    assert _tol(F32) < inherited < _tol(dtype)
    # ... and the step as a whole agrees within the low precision (a handful of ops)
    l_lo, l_hi = F.cross_entropy(lo(x.to(dtype)).float(), y), F.cross_entropy(hi(x.double()), y)
    assert abs(l_lo.item() - l_hi.item()) / l_hi.item() < _tol(dtype)
    r = nbdebug.compare_replays(model, x, y, a=low, b="float64", loss_fn=F.cross_entropy)
    assert r.ok, r.summary()
    frame = r.to_frame()
    up = frame[(frame["module"] == "1") & (frame["op"] == "Tensor.to")].iloc[0]
    # the upcast's value is float32, computed in the low precision: judged at its tolerance
    assert (up["precision_a"], up["precision_b"]) == (low, "float32")
    assert up["tolerance"] == _tol(dtype) and up["relative"] > _tol(F32)


@pytest.mark.parametrize(
    ("step", "low", "op"), [("cosh", BF16, "torch.cosh"), ("scale", F16, "Tensor.to")]
)
def test_an_overflow_after_the_upcast_is_still_named(step: str, low: torch.dtype, op: str) -> None:
    model, x, y = _rms_model(After(step))
    # plain torch: the low replay's float32 cosh (or its float16 cast back) overflows;
    # float64's stays finite (|h| <= sqrt(16) after the RMSNorm: cosh(400) ~ 2.6e173)
    lo, hi = copy.deepcopy(model).to(low), copy.deepcopy(model).double()
    h_lo, h_hi = lo[1](lo[0](x.to(low))).to(F32), hi[1](hi[0](x.double()))
    if step == "cosh":
        assert torch.cosh(h_lo * 100).isinf().any() and torch.cosh(h_hi * 100).isfinite().all()
    else:
        assert (h_lo * 1e5).to(F16).isinf().any() and (h_hi * 1e5).isfinite().all()
    name = str(low).removeprefix("torch.")
    r = nbdebug.compare_replays(model, x, y, a=name, b="float64", loss_fn=F.cross_entropy)
    d = r.first
    assert d is not None and (d.module, d.op, d.reason) == ("2", op, "Inf vs finite")
    assert math.isinf(d.a) and math.isfinite(d.b)


class Ramp(nn.Module):
    """A float32 value made from integers (positions), in both replays' own float dtype
    at least float32, raised to a high power: its float32 rounding is amplified a
    thousandfold, a loss float32 does not explain, inside a bfloat16 model."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(h.dtype, F32)  # float32 for bfloat16, float64 for float64
        ramp = (1 + torch.arange(h.shape[-1]).to(dtype) * 0.0041) ** 1000
        return h * (ramp / ramp.max()).to(h.dtype)


def _ramp(dtype: torch.dtype) -> torch.Tensor:
    return (1 + torch.arange(16).to(dtype) * 0.0041) ** 1000


def test_a_precision_loss_in_a_float32_op_of_a_bfloat16_replay_is_named() -> None:
    model, x, y = _rms_model(Ramp())
    # plain torch: the float32 ramp's base is within float32's tolerance of float64's, its
    # power is not (the rounding times 1000), and is within bfloat16's: only a float32
    # tolerance can name it
    base32, base64 = 1 + torch.arange(16).float() * 0.0041, 1 + torch.arange(16).double() * 0.0041
    assert float((base32.double() - base64).norm() / base64.norm()) < _tol(F32)
    p32, p64 = _ramp(F32).double(), _ramp(F64)
    rel = float((p32 - p64).norm() / p64.norm())
    assert _tol(F32) < rel < _tol(BF16)
    r = nbdebug.compare_replays(model, x, y, a="bfloat16", b="float64", loss_fn=F.cross_entropy)
    d = r.first
    assert d is not None and (d.module, d.op) == ("2", "Tensor.__pow__"), r.summary()
    assert (d.dtype_a, d.dtype_b) == ("float32", "float64") and d.tolerance == _tol(F32)
    assert d.relative == pytest.approx(rel, rel=1e-6)


class DtypeBranch(nn.Module):
    """Code that branches on the dtype (as T5's feed-forward does): ``extra`` ops that only
    a 16-bit replay makes."""

    def __init__(self, extra: int) -> None:
        super().__init__()
        self.extra = extra

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        up = h
        if h.dtype in (F16, BF16):
            up = h.to(F32)
            for _ in range(self.extra - 1):
                up = up * 1.0
        return torch.tanh(up).to(h.dtype)


def test_records_that_only_one_replay_makes_are_skipped_not_the_end() -> None:
    model, x, y = _rms_model(DtypeBranch(1))
    r = nbdebug.compare_replays(model, x, y, a="bfloat16", b="float64", loss_fn=F.cross_entropy)
    assert r.ok, r.summary()
    assert r.notes == [
        "1 record(s) that only the bfloat16 replay makes were skipped (code that branches "
        "on the configuration; the first: Tensor.to in '2')"
    ]
    # every record after the branch is compared: its tanh, the loss, all five gradients
    frame = r.to_frame()
    assert (frame["op"] == "torch.tanh").sum() == 1 and (frame["phase"] == "loss").any()
    assert (frame["phase"] == "backward").sum() == 5
    # a branch longer than the look-ahead: the replays part there, and the summary says so
    model, x, y = _rms_model(DtypeBranch(LOOKAHEAD + 4))
    r = nbdebug.compare_replays(model, x, y, a="bfloat16", b="float64", loss_fn=F.cross_entropy)
    assert r.first is None and r.notes[-1].startswith("the replays part at record 9: ")
    assert r.summary().endswith("up to where their op sequences part (notes).")
    assert r.compared == 9
