"""core.norms: the one fused per-tensor / total L2 norm helper (trace, guard, checks)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nbdebug.core.norms import (
    copy_norms,
    device_norms,
    fused_norms,
    host_squares,
    host_total,
    norm_vector,
    total_norm,
    update_norms,
)


def test_fused_norms_match_one_norm_per_tensor_across_dtypes() -> None:
    g = torch.Generator().manual_seed(0)
    ts = [
        torch.randn(3, 4, generator=g),
        torch.randn(5, generator=g).double(),
        torch.randn(2, 2, generator=g).half(),
        torch.randn(7, generator=g),
        torch.arange(4),  # integers: the float64 fallback
    ]
    expected = [torch.linalg.vector_norm(t.double()).item() for t in ts]
    got = fused_norms(ts)
    assert got.dtype == np.float64 and got.shape == (5,)
    np.testing.assert_allclose(got, expected, rtol=1e-3)  # the half one in half precision
    assert [n.dtype for n in device_norms(ts[:2])] == [torch.float32, torch.float64]
    assert fused_norms([]).shape == (0,)


def test_float64_accumulation_keeps_an_overflowing_norm_finite() -> None:
    big = torch.full((4,), 1e20)  # squares overflow float32
    assert math.isinf(float(fused_norms([big])[0]))
    assert fused_norms([big], dtype=torch.float64)[0] == pytest.approx(2e20)


def test_total_norm_is_the_norm_of_everything_together() -> None:
    ts = [torch.full((3,), 2.0), torch.full((2, 2), 1.0).half(), torch.ones(5).double()]
    flat = torch.cat([t.double().reshape(-1) for t in ts])
    cpu = torch.device("cpu")
    out = total_norm(ts, device=cpu)
    assert out.dtype == torch.float32 and out.shape == ()
    assert out.item() == pytest.approx(flat.norm().item(), rel=1e-6)
    assert total_norm([], device=cpu).item() == 0.0


def _mixed_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ts: list[torch.Tensor] = []
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        ts += [
            torch.randn(300_000, generator=g).to(dt),  # several parallel tasks
            torch.randn(17, generator=g).to(dt),
            torch.empty(0, dtype=dt),
            torch.randn(40, 30, generator=g).to(dt).t(),  # not contiguous, dense
            torch.randn(20, 20, generator=g).to(dt)[:, ::3],  # not dense
            torch.tensor([1.0, float("nan")], dtype=dt),
            torch.tensor([2.0, float("inf"), -float("inf")], dtype=dt),
        ]
    return ts


@pytest.fixture(params=["eager", "compiled"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test in both statistics engines (the compiled one when it is built)."""
    from nbdebug.core import kernels

    if request.param == "compiled" and not kernels.active():
        pytest.skip("the compiled kernel is not built (nbdebug build-kernels)")
    monkeypatch.setenv(kernels.ENV, request.param)
    return str(request.param)


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64])
def test_norms_match_float64_reference_in_both_engines(
    mode: str, dtype: torch.dtype | None
) -> None:
    ts = _mixed_tensors()
    expected = [torch.linalg.vector_norm(t.double()).item() for t in ts]
    got = device_norms(ts, dtype=dtype)
    for t, n, e in zip(ts, got, expected):
        assert n.dtype == (dtype or t.dtype) and n.shape == ()
        rel = 1e-2 if (dtype or t.dtype) in (torch.float16, torch.bfloat16) else 1e-5
        if math.isnan(e):
            assert math.isnan(float(n))
        else:
            assert float(n) == pytest.approx(e, rel=rel)
    finite = [t for t, e in zip(ts, expected) if math.isfinite(e)]
    flat = torch.cat([t.double().reshape(-1) for t in finite])
    total = total_norm(finite, device=torch.device("cpu"), dtype=torch.float64)
    assert float(total) == pytest.approx(float(flat.norm()), rel=1e-5)


def _close(got: float, want: float, dtype: torch.dtype) -> None:
    if math.isnan(want):
        assert math.isnan(got)
    elif math.isinf(want):
        assert got == want
    else:
        rel = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5
        assert got == pytest.approx(want, rel=rel, abs=1e-30)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norm_vector_is_one_vector_of_the_float64_norms(mode: str, dtype: torch.dtype) -> None:
    ts = _mixed_tensors()  # mixed dtypes, empty, transposed, strided, NaN and Inf
    cpu = torch.device("cpu")
    got = norm_vector(ts, device=cpu, dtype=dtype)
    assert got.dtype == dtype and got.shape == (len(ts),)
    for t, n in zip(ts, got.tolist()):
        _close(n, torch.linalg.vector_norm(t.double()).item(), t.dtype)
    assert norm_vector([], device=cpu).shape == (0,)


def _pairs() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Weights before and after an update: every float dtype, a large tensor (several
    parallel tasks), a small one, an empty one, a NaN weight after the update."""
    g = torch.Generator().manual_seed(2)
    before, after = [], []
    for dt in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for shape in ((300_000,), (17, 3), (0,)):
            w = torch.randn(*shape, generator=g).to(dt)
            before.append(w)
            after.append((w.double() - 1e-2 * torch.randn(*shape, generator=g)).to(dt))
    after[1][0, 0] = float("nan")
    return before, after


def test_copy_norms_copies_and_measures_the_tensors(mode: str) -> None:
    weights, _ = _pairs()
    copies = [torch.full_like(w, 7.0) for w in weights]
    got = copy_norms(copies, weights, device=torch.device("cpu"))
    assert got.dtype == torch.float32 and got.shape == (len(weights),)
    for c, w, n in zip(copies, weights, got.tolist()):
        assert torch.equal(c, w)
        _close(n, torch.linalg.vector_norm(w.double()).item(), w.dtype)


def test_update_norms_are_the_norms_of_the_differences(mode: str) -> None:
    before, after = _pairs()
    want = [torch.linalg.vector_norm(b.double() - a.double()).item() for b, a in zip(before, after)]
    kept = [a.clone() for a in after]
    copies = [b.clone() for b in before]
    got = update_norms(copies, after, device=torch.device("cpu"), dtype=torch.float64)
    assert got.dtype == torch.float64 and got.shape == (len(before),)
    for b, n, w in zip(before, got.tolist(), want):
        _close(n, w, b.dtype)
    assert math.isnan(got[1].item())  # the NaN weight
    for a, k in zip(after, kept):  # the weights are only read
        torch.testing.assert_close(a, k, rtol=0, atol=0, equal_nan=True)
    if mode == "compiled":  # nothing written: the copies are as they were
        assert all(torch.equal(c, b) for c, b in zip(copies, before))


def test_update_norms_fall_back_for_a_pair_the_kernel_cannot_read() -> None:
    w = torch.randn(30, 40)
    now = (w + 1).t().contiguous().t()  # the same values, not contiguous
    got = update_norms([w.clone()], [now], device=torch.device("cpu"))
    assert got.item() == pytest.approx(math.sqrt(1200), rel=1e-5)
    copy = torch.empty(40, 30).t()  # a copy buffer that is not contiguous
    got = copy_norms([copy], [w], device=torch.device("cpu"))
    assert torch.equal(copy, w) and got.item() == pytest.approx(w.double().norm().item(), rel=1e-5)


def test_host_squares_are_the_sums_of_squares_read_on_the_host(mode: str) -> None:
    # contiguous CPU tensors of every float dtype the guard sees, one empty, a NaN, an Inf
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(300_000, generator=g), torch.randn(17, 3, generator=g).double()]
    ts += [torch.randn(40, generator=g).half(), torch.randn(9, generator=g).bfloat16()]
    ts += [torch.empty(0), torch.tensor([1.0, float("nan")]), torch.tensor([2.0, float("inf")])]
    got = host_squares(ts)
    if mode == "eager":  # no kernel: the caller takes the device path
        assert got is None
        return
    assert isinstance(got, np.ndarray) and got.dtype == np.float64 and got.shape == (len(ts),)
    for t, sq in zip(ts, got.tolist()):
        _close(sq, float((t.double() ** 2).sum()), t.dtype)
    assert host_squares([]) is not None and len(host_squares([])) == 0
    # a tensor the kernel cannot read (not contiguous) is no error: the device path
    assert host_squares([torch.randn(6, 4).t()]) is None


def test_guard_totals_from_the_host_match_plain_torch(mode: str, tmp_path) -> None:
    # the guard's gradient norm and weight norm, read on the host or on the device, are
    # the L2 norms of all the gradients and all the weights together
    from torch import nn

    from nbdebug.core.guard import NaNGuard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 20), nn.Tanh(), nn.Linear(20, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = NaNGuard(model, opt, directory=tmp_path)
    loss = nn.functional.cross_entropy(
        model(torch.randn(8, 30)), torch.tensor([0, 1, 2] * 2 + [0, 1])
    )
    loss.backward()
    reading = guard.measure_step(loss, step=0)
    grads = torch.cat([p.grad.double().reshape(-1) for p in model.parameters()])
    weights = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    assert reading.grad_norm == pytest.approx(float(grads.norm()), rel=1e-6)
    assert reading.param_norm == pytest.approx(float(weights.norm()), rel=1e-6)
    assert reading.loss == pytest.approx(float(loss.detach()), rel=1e-7)


def test_host_total_is_the_norm_of_the_sums_and_overflows_to_inf() -> None:
    assert host_total(np.array([9.0, 16.0])) == 5.0
    assert host_total(np.zeros(0)) == 0.0
    # finite sums whose total overflows (float64 gradients near 1e154): inf, no error
    assert host_total(np.array([1e308, 1e308])) == math.inf
    assert math.isnan(host_total(np.array([1.0, math.nan])))
