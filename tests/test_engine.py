"""The quick pass's statistics engine (nbdebug/core/engine.py) and the compiled kernel's
batched entries: expected values from plain torch in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from nbdebug.core import kernels, measure
from nbdebug.core.engine import ROW_LEN, QuickEngine, RowBuffer
from nbdebug.core.stats import IDX_MAX, IDX_MIN, IDX_NNAN, IDX_NORM, IDX_NUMEL, IDX_SUM

needs_kernel = pytest.mark.skipif(
    not kernels.active(), reason="the compiled kernel is not built (nbdebug build-kernels)"
)


def _mixed() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(200_000, generator=g)  # several parallel tasks
    return [
        big,
        torch.randn(7, generator=g),
        torch.empty(0),
        torch.randn(3, 5, generator=g, dtype=torch.float64),
        torch.randn(70_001, generator=g).half(),
        torch.randn(33, generator=g).bfloat16(),
        torch.randn(8, 6, generator=g).t(),  # not contiguous, dense
        torch.randn(10, 10, generator=g)[:, ::2],  # not dense
        torch.tensor([1.0, float("nan"), 2.0]),
        torch.tensor([1.0, float("inf"), -3.0]),
        *[torch.randn(16, generator=g) for _ in range(200)],  # many small ones
    ]


def _check(vectors: np.ndarray, ts: list[torch.Tensor]) -> None:
    for v, t in zip(vectors, ts):
        d = t.double()
        assert v[IDX_NUMEL] == t.numel()
        if t.numel() == 0:
            assert v[IDX_SUM] == 0 and math.isnan(v[IDX_MIN]) and v[IDX_NNAN] == 0
            continue
        if torch.isnan(d).any():
            assert math.isnan(v[IDX_SUM]) and math.isnan(v[IDX_MIN])
            continue
        assert v[IDX_NORM] == pytest.approx(float(torch.linalg.vector_norm(d)), rel=1e-5)
        assert v[IDX_MIN] == float(d.min()) and v[IDX_MAX] == float(d.max())
        if torch.isfinite(d).all():
            assert v[IDX_SUM] == pytest.approx(float(d.sum()), rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_engine_rows_match_plain_torch(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if mode == "compiled" and not kernels.active():
        pytest.skip("the compiled kernel is not built (nbdebug build-kernels)")
    monkeypatch.setenv(kernels.ENV, mode)
    ts = _mixed()
    eng = QuickEngine(kernels.compiled())
    half = len(ts) // 2
    ids = [eng.measure(t) for t in ts[:half]] + eng.measure_many([*ts[half:], None])
    rows = eng.host_rows()
    assert rows.shape == (len(ts) + 1, measure.VECTOR_LEN)
    _check(rows[ids[:-1]], ts)
    assert rows[ids[-1], IDX_NUMEL] == 0 and math.isnan(rows[ids[-1], IDX_MIN])
    # the same numbers as the one-tensor path of the same engine
    for i in (0, 4, 6, 7):
        assert np.allclose(rows[ids[i]], measure.quick_vector(ts[i]), equal_nan=True)


def test_row_buffer_grows_by_doubling_and_keeps_rows() -> None:
    buf = RowBuffer(torch.device("cpu"), capacity=2)
    assert buf.take() == 0
    buf.data[0] = 1.0
    assert buf.take(3) == 1 and buf.data.shape == (4, ROW_LEN)
    assert buf.take() == 4 and buf.data.shape == (8, ROW_LEN)
    assert buf.host().shape == (5, ROW_LEN) and (buf.host()[0] == 1.0).all()
    with pytest.raises(ValueError, match="capacity of at least 1, got 0"):
        RowBuffer(torch.device("cpu"), capacity=0)


def test_engine_rows_survive_growth_and_in_place_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(kernels.ENV, "eager")
    eng = QuickEngine(kernels.compiled())
    ts = [torch.full((4,), float(i)) for i in range(600)]  # past the first 256 rows
    ids = [eng.measure(t) for t in ts]
    for t in ts:
        t.add_(1000.0)  # after the measurement: not seen
    rows = eng.host_rows()
    assert [rows[i, IDX_SUM] for i in ids] == [4.0 * i for i in range(600)]


@needs_kernel
def test_quick_stats_into_packs_small_and_splits_large_tensors() -> None:
    fused = kernels.compiled()
    ts = [t for t in _mixed() if t.is_contiguous()]
    out = torch.full((len(ts) + 3, ROW_LEN), -7.0, dtype=torch.float64)
    fused.quick_stats_into(ts, out, 2, *measure.kernel_args())
    assert (out[:2] == -7.0).all() and (out[2 + len(ts) :] == -7.0).all()
    for i, t in enumerate(ts):
        if t.numel():  # each row equals the one-tensor kernel's
            one = fused.quick_stats(t, *measure.kernel_args())
            assert torch.allclose(out[2 + i], one, rtol=1e-12, equal_nan=True)
    with pytest.raises(RuntimeError, match="inside out's"):
        fused.quick_stats_into(ts, out, 5, *measure.kernel_args())
    with pytest.raises(RuntimeError, match="contiguous CPU tensors of a floating dtype"):
        fused.quick_stats_into([torch.arange(3)], out, 0, *measure.kernel_args())


@needs_kernel
def test_moments_many_match_float64_reference() -> None:
    ts = [t for t in _mixed() if t.is_contiguous()]
    for wide in (False, True):
        m = kernels.compiled().moments_many(ts, wide)
        for row, t in zip(m.tolist(), ts):
            d = t.double()
            sq = float(d.square().sum())
            assert row[1] == pytest.approx(sq, rel=1e-5) or (math.isnan(sq) and math.isnan(row[1]))
            if t.numel() and torch.isfinite(d).all():
                assert row[0] == pytest.approx(float(d.sum()), rel=1e-5, abs=1e-4)
                assert (row[2], row[3]) == (float(d.min()), float(d.max()))
