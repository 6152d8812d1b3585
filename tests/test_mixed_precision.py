"""Mixed precision: the trace records the dtype each module ran in under autocast; the
snapshot records the autocast state and the replay uses it; bfloat16 (precision) and float16
(range) findings are distinct; a replay where the dtype is unsupported says so."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nbdebug
from nbdebug.analysis.checks.base import TraceView
from nbdebug.analysis.checks.precision import BF16_SPREAD, precision_findings
from nbdebug.core.snapshot import replay as snapshot_module


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
    assert snap.autocast == {"device_type": "cpu", "dtype": "float16", "backward": True}
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
    # each entry point names its own way out: check and debug take the float32 trace
    with pytest.raises(nbdebug.SnapshotError, match=r"or replay it in float32 with "):
        nbdebug.check(snap, loss_fn=lambda o: o.sum())
    with pytest.raises(
        nbdebug.SnapshotError, match=r"or call nbdebug\.diagnose\(\.\.\., autocast=False\)\.$"
    ):
        nbdebug.diagnose(path, model=model, loss_fn=lambda o: o.sum())
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
    # one finding: the Sequential's output is the same tensor as its child's, not a second
    found = [f for f in precision_findings(TraceView(tr)) if f.event is not None]
    assert [f.module for f in found] == ["0"] and found[0].severity == "warning"
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


# ------------------------------------------------------------- float16 + GradScaler (CPU)
OVERFLOW_STEP = 2  # the batch x100: the forward is finite, the scaled float16 gradients are not
FORWARD_STEP = 4  # row 1 = 3e4: unit 0 of the first Linear passes 65504 in the forward
FP16_STEPS = 6


def fp16_model() -> nn.Module:
    m = model()
    with torch.no_grad():
        m[0].weight[0] = 1.0  # unit 0 sums its inputs: 4 x 3e4 > 65504 in float16
    return m


def fp16_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 4, generator=g), torch.randn(4, 2, generator=g)
    if step == OVERFLOW_STEP:
        x = x * 100
    if step == FORWARD_STEP:
        x[1] = 3e4  # finite in float16 itself
    return x, y


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A hand-written float16 loop: autocast forward, scaled backward, unscale_, the guard,
    scaler.step() when the guard says so, scaler.update() every step."""
    m = fp16_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    directory = tmp_path_factory.mktemp("fp16")
    guard = nbdebug.NaNGuard(
        m, opt, scaler=scaler, directory=directory, loss_fn=F.mse_loss, autocast=torch.float16
    )
    oks, changed, scales = [], [], []
    for step in range(FP16_STEPS):
        x, y = fp16_batch(step)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(m(x).float(), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        before = [p.detach().clone() for p in m.parameters()]
        ok = guard.check(loss, inputs=x, target=y, step=step)
        if ok:
            scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        oks.append(ok)
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, m.parameters())))
        scales.append(scaler.get_scale())
    return {"guard": guard, "model": m, "oks": oks, "changed": changed, "scales": scales}


def test_fp16_gradient_overflow_is_the_scalers_skip_and_a_forward_overflow_a_snapshot(
    fp16_run: dict[str, Any],
) -> None:
    guard = fp16_run["guard"]
    rows = {r["step"]: r for r in guard.history}
    # the gradient overflow: check() says go on, scaler.step() skips the update itself,
    # update() halves the scale; no snapshot, the row says skipped without a failure
    assert fp16_run["oks"][OVERFLOW_STEP] is True
    assert fp16_run["changed"][OVERFLOW_STEP] is False
    assert fp16_run["scales"][OVERFLOW_STEP - 1 : OVERFLOW_STEP + 1] == [2.0**8, 2.0**7]
    assert rows[OVERFLOW_STEP]["skipped"] is True and rows[OVERFLOW_STEP]["nonfinite"] is None
    assert math.isfinite(rows[OVERFLOW_STEP]["loss"])
    assert not math.isfinite(rows[OVERFLOW_STEP]["grad_norm"])
    # the forward overflow: a failure of its own (no scale fixes a forward), one snapshot
    assert fp16_run["oks"][FORWARD_STEP] is False
    assert fp16_run["changed"][FORWARD_STEP] is False
    assert rows[FORWARD_STEP]["nonfinite"] == "loss" and rows[FORWARD_STEP]["skipped"] is True
    assert [p.name for p in guard.snapshots] == [f"step-{FORWARD_STEP:09d}.nbsnap"]
    others = [i for i in range(FP16_STEPS) if i not in (OVERFLOW_STEP, FORWARD_STEP)]
    assert all(fp16_run["oks"][i] and fp16_run["changed"][i] for i in others)
    assert all(bool(torch.isfinite(p).all()) for p in fp16_run["model"].parameters())


def test_the_fp16_snapshot_holds_scaler_and_autocast_and_replays_in_a_fresh_process(
    fp16_run: dict[str, Any],
) -> None:
    (path,) = fp16_run["guard"].snapshots
    snap = nbdebug.load_snapshot(path, model=fp16_model)
    assert snap.autocast == {"device_type": "cpu", "dtype": "float16"}
    assert snap.scaler_state is not None
    assert snap.scaler_state["scale"] == fp16_run["scales"][FORWARD_STEP - 1]  # before update()
    assert snap.reason["kind"] == "loss" and snap.reason["scale"] == snap.scaler_state["scale"]
    assert torch.equal(snap.inputs, fp16_batch(FORWARD_STEP)[0])
    code = textwrap.dedent(
        f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import nbdebug
        from test_mixed_precision import fp16_model
        snap = nbdebug.load_snapshot({str(path)!r}, model=fp16_model)
        o = snap.trace().origin
        plain = snap.trace(autocast=False).origin
        print(json.dumps({{"phase": o.phase, "module": o.module, "samples": o.samples,
                           "dtype": o.dtype, "float32": plain is None}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    origin = json.loads(out.stdout.strip().splitlines()[-1])
    assert origin == {
        "phase": "forward",
        "module": "0",
        "samples": [1],
        "dtype": "float16",
        "float32": True,  # the step is finite in float32: only the float16 replay fails
    }


def test_the_guarded_step_form_updates_the_scaler_after_unscale_on_a_skipped_step(
    tmp_path: Path,
) -> None:
    m = fp16_model()
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    guard = nbdebug.NaNGuard(m, opt, scaler=scaler, directory=tmp_path, patience=None)
    oks = []
    for step in (3, FORWARD_STEP, 5):  # the middle one is skipped by the guard
        x, y = fp16_batch(step)
        with guard.step(x, y, step=step) as s:
            with torch.autocast("cpu", dtype=torch.float16):
                s.loss = F.mse_loss(m(x).float(), y)
            scaler.scale(s.loss).backward()
            scaler.unscale_(opt)  # raises on the next step if the skipped one left no update()
        oks.append(s.ok)
    assert oks == [True, False, True]
    assert scaler.get_scale() == 2.0**7  # the skipped step's inf lowered the scale once
    assert len(guard.snapshots) == 1


def test_the_autocast_option_takes_a_half_dtype(tmp_path: Path) -> None:
    guard = nbdebug.NaNGuard(model(), directory=tmp_path, autocast="bfloat16")
    assert guard.writer.fields["autocast"] == {"device_type": "cpu", "dtype": "bfloat16"}
    with pytest.raises(ValueError, match=r"autocast must be torch.float16, torch.bfloat16 .*"):
        nbdebug.NaNGuard(model(), directory=tmp_path, autocast=torch.float32)


# ------------------------------------------------------------- diagnose under autocast
def test_diagnose_replays_a_float16_only_overflow_under_float16(tmp_path: Path) -> None:
    x = torch.randn(3, 4)
    x[1] = 3e4  # its Linear output passes 65504 in float16 only
    path = guarded_step(tmp_path, torch.float16, x)
    d = nbdebug.diagnose(path, model=wide_model, progress=False)
    assert d.plain.finite is False and d.plain.loss_finite is False  # the baseline fails
    assert d.trace is not None and d.trace.origin is not None
    assert (d.trace.origin.module, d.trace.origin.dtype) == ("0", "float16")
    # the row is finite, valid data that only float16 cannot hold: the precision fix ranks
    # above dropping it (issue 31, "the fix a user would choose")
    assert d.cause.finite and (d.cause.kind, d.cause.module) == ("float32", "")
    # its evidence: the step as it ran against float64, op by op, names the first Linear,
    # whose float16 output is Inf where float64 holds 3e4 x 4 weights (about 1.2e5)
    (said,) = [n for n in d.notes if n.startswith("evidence for float32:")]
    assert "torch.nn.functional.linear in '0' (forward): inf (float16)" in said
    dropped = next(r for r in d.results if r.kind == "drop_rows")
    assert dropped.finite and dropped.rows == [1] and dropped.rank > 1
    # dropping is verified under float16 too: the rows dropped, the model still runs in it
    fixed = d.trace_with("drop_rows")
    dtypes = {e.module: e.dtype for e in fixed.events if e.phase == "forward"}
    assert dtypes["0"] == "float16" and dtypes["2"] == "float16" and fixed.origin is None
    by_kind = {(r.kind, r.module): r for r in d.results}
    assert by_kind[("float32", "")].finite  # the whole model in float32 is finite too
    # the first Linear alone in float32 is not: its 1.2e5 overflows again where the
    # second Linear casts it to float16 (a float32 replay would call this fix verified)
    assert not by_kind[("float32", "0")].finite
    # without the recorded autocast the step is finite: nothing to fix
    plain32 = nbdebug.diagnose(path, model=wide_model, progress=False, autocast=False)
    assert plain32.plain.finite and plain32.cause.kind == "not_reproducible"
    # ... because autocast is off, not because the failure does not reproduce
    said = plain32.cause.statement
    assert "autocast=False" in said and "float16 autocast" in said
    assert "non-determinism" not in said and "hardware" not in said


class HalfHead(nn.Module):
    """fc2 made float16 after construction (a half-precision head): its input cast
    overflows when fc1's outputs pass 65504."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x).to(self.fc2.weight.dtype)).float()


def test_a_snapshot_of_half_weights_replays_them_in_half_in_a_float32_built_model(
    tmp_path: Path,
) -> None:
    m = HalfHead()
    m.fc2.half()
    with torch.no_grad():
        m.fc1.weight.mul_(1e5)
    guard = nbdebug.NaNGuard(m, torch.optim.SGD(m.parameters(), lr=0.1), directory=tmp_path)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    loss = F.mse_loss(m(x), y)
    loss.backward()
    assert not guard.check(loss, inputs=x, target=y, step=0)
    snap = nbdebug.load_snapshot(guard.snapshots[0], model=HalfHead)  # built in float32
    tr = snap.trace(loss_fn=F.mse_loss)
    assert snap.model.fc2.weight.dtype == torch.float16 and snap.model.fc1.weight.dtype == (
        torch.float32
    )
    assert tr.origin is not None and tr.origin.op == "Tensor.to"  # the cast, as it ran
    assert not math.isfinite(tr.loss)
    assert m.fc2.weight.dtype == torch.float16  # the trained model as it was
