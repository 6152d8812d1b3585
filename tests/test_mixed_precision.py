"""Mixed precision: the trace records the dtype each module ran in under autocast; the
snapshot records the autocast state and the replay uses it; bfloat16 (precision) and float16
(range) findings are distinct; a replay where the dtype is unsupported says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nbdebug
from nbdebug.analysis.checks_base import TraceView
from nbdebug.analysis.checks_precision import BF16_SPREAD, precision_findings
from nbdebug.core import snapshot as snapshot_module


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def wide_model() -> nn.Module:
    m = model()
    with torch.no_grad():
        m[0].weight.fill_(1.0)  # a row of 3e4s sums to 1.2e5 > 65504 in float16
    return m


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_trace_records_the_dtype_each_module_ran_in(dtype: torch.dtype) -> None:
    m, x, y = model(), torch.randn(3, 4), torch.randn(3, 2)
    with torch.autocast("cpu", dtype=dtype):
        tr = nbdebug.trace(m, x, target=y, loss_fn=loss_fn)
    dtypes = {e.module: e.dtype for e in tr.events if e.phase == "forward"}
    name = str(dtype).replace("torch.", "")
    assert dtypes["0"] == name and dtypes["2"] == name  # the Linear layers ran in it
    assert next(e for e in tr.events if e.phase == "input").dtype == "float32"
    plain = nbdebug.trace(model(), x, target=y, loss_fn=loss_fn)
    assert {e.dtype for e in plain.events if e.phase == "forward"} == {"float32"}


def guarded_step(tmp_path: Path, dtype: torch.dtype, x: torch.Tensor) -> Path:
    m = wide_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    guard = nbdebug.NaNGuard(m, opt, directory=tmp_path, loss_fn=F.mse_loss)
    y = torch.zeros(x.shape[0], 2)
    with torch.autocast("cpu", dtype=dtype):
        out = m(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        assert not guard.check(loss, inputs=x, target=y, step=7)
    (path,) = guard.snapshots
    return path


def test_a_float16_overflow_replays_under_float16_only(tmp_path: Path) -> None:
    x = torch.randn(3, 4)
    x[1] = 3e4  # finite in float16 itself; its Linear output passes 65504
    path = guarded_step(tmp_path, torch.float16, x)
    snap = nbdebug.load_snapshot(path, model=wide_model)
    assert snap.autocast == {"device_type": "cpu", "dtype": "float16"}
    origin = snap.trace().origin
    assert origin is not None and origin.phase == "forward" and origin.module == "0"
    assert origin.dtype == "float16" and origin.samples == [1]
    codes = {f.code for f in nbdebug.check(snap.trace())}
    assert "fp16_overflow_risk" in codes and "bf16_precision_loss" not in codes
    assert snap.trace(autocast=False).origin is None  # in float32 the step is finite


def test_the_autocast_field_round_trips_and_defaults_to_none(tmp_path: Path) -> None:
    path = nbdebug.save_snapshot(tmp_path / "a.nbsnap", model(), torch.randn(2, 4))
    assert nbdebug.load_snapshot(path).autocast is None
    spec = {"device_type": "cuda", "dtype": "bfloat16"}
    path = nbdebug.save_snapshot(tmp_path / "b.nbsnap", model(), torch.randn(2, 4), autocast=spec)
    assert nbdebug.load_snapshot(path).autocast == spec


def test_a_bf16_snapshot_where_bf16_is_unsupported_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = {"device_type": "cuda", "dtype": "bfloat16"}
    x = torch.randn(2, 4)
    path = nbdebug.save_snapshot(tmp_path / "b.nbsnap", model(), x, autocast=spec)
    snap = nbdebug.load_snapshot(path, model=model)
    monkeypatch.setattr(snapshot_module, "autocast_supported", lambda device, dtype: False)
    with pytest.raises(
        nbdebug.SnapshotError,
        match=r"ran under bfloat16 autocast \(cuda\); expected a cpu device that supports "
        r"bfloat16 autocast, found one that does not",
    ):
        snap.trace(loss_fn=lambda o: o.sum())
    assert snap.trace(loss_fn=lambda o: o.sum(), autocast=False).origin is None


def test_bfloat16_precision_loss_is_found_and_is_not_an_overflow() -> None:
    m = nn.Sequential(nn.Linear(4, 4))
    with torch.no_grad():
        m[0].weight.zero_()
        m[0].bias.fill_(300.0)  # outputs 300 + tiny: below one bfloat16 step (~1.2 at 300)
        m[0].weight[:, 0] = 1e-3
    x = torch.randn(6, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tr = nbdebug.trace(m, x, loss_fn=lambda o: o.float().mean())
    found = [f for f in precision_findings(TraceView(tr)) if f.module == "0"]
    assert len(found) == 1 and found[0].severity == "warning"
    assert found[0].evidence["std_over_mean"] < BF16_SPREAD
    assert tr.origin is None  # nothing overflowed: precision, not range
    with torch.autocast("cpu", dtype=torch.bfloat16):
        spread = nbdebug.trace(nn.Sequential(nn.Linear(4, 4)), x, loss_fn=lambda o: o.sum())
    assert not [f for f in precision_findings(TraceView(spread)) if f.module == "0"]


def test_a_loss_computed_in_bfloat16_is_named() -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tr = nbdebug.trace(model(), torch.randn(3, 4), loss_fn=lambda o: o.sum())
    codes = [(f.code, f.where) for f in nbdebug.check(tr)]
    assert ("bf16_precision_loss", "the loss") in codes


def test_an_ordinary_bfloat16_layer_is_not_flagged() -> None:
    # random weights on a random batch: the outputs spread far beyond one bfloat16 step
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tr = nbdebug.trace(m, torch.randn(16, 8), loss_fn=lambda o: o.float().mean())
    assert [f for f in precision_findings(TraceView(tr)) if f.module in ("0", "2")] == []
