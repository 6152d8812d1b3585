"""core.norms: the one fused per-tensor / total L2 norm helper (trace, guard, checks)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nbdebug.core.norms import device_norms, fused_norms, total_norm


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


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("dtype", [None, torch.float32, torch.float64])
def test_norms_match_float64_reference_in_both_engines(
    mode: str, dtype: torch.dtype | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nbdebug.core import kernels

    if mode == "compiled" and not kernels.active():
        pytest.skip("the compiled kernel is not built (nbdebug build-kernels)")
    monkeypatch.setenv(kernels.ENV, mode)
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
