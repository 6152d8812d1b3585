"""True text in a diagnosis (issue 31, item 5), on failing loops run with a real optimizer
and the guard: the cause kind agrees with its sentence, snippets use the guard's own
directory and name only snapshots that exist, long row lists are counted, and a stored
batch that replays finite after a recorded NaN loss points at the input pipeline."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import nbdebug


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(n, 8, generator=g)
    return x, x.sum(1, keepdim=True)


def _guard(model: nn.Module, opt: torch.optim.Optimizer, directory: Path) -> nbdebug.NaNGuard:
    return nbdebug.NaNGuard(model, opt, directory=directory, loss_fn=F.mse_loss, param_norm_every=1)


def test_a_race_in_the_input_pipeline_points_at_the_pipeline_not_at_a_fix(tmp_path: Path) -> None:
    """A loader that reuses one buffer: the next batch is written into it (a prefetch)
    before the guard stores the step's batch, so the NaN the step saw is gone."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = _guard(model, opt, tmp_path)
    buf_x, buf_y = torch.empty(16, 8), torch.empty(16, 1)
    failed = None
    for step in range(12):
        x, y = _batch(step)
        if step == 9:
            x[3, 2] = float("nan")  # a corrupt record
        buf_x.copy_(x)
        buf_y.copy_(y)
        loss = F.mse_loss(model(buf_x), buf_y)
        loss.backward()
        nx, ny = _batch(step + 1)
        buf_x.copy_(nx)  # the prefetch of the next batch lands in the same buffer
        buf_y.copy_(ny)
        if not guard.check(loss, inputs=buf_x, target=buf_y, step=step):
            failed = step
            break
        opt.step()
        opt.zero_grad()
    assert failed == 9
    snap = nbdebug.load_snapshot(guard.snapshots[-1], model=mlp)
    # plain torch: the stored batch is finite on the stored weights
    m = mlp()
    m.load_state_dict(dict(snap.model_state))
    with torch.no_grad():
        assert math.isfinite(float(F.mse_loss(m(snap.inputs), snap.target)))
    d = nbdebug.diagnose(snap, progress=False)
    c = d.cause
    assert c.kind == "not_reproducible" and c.finite  # the same step replayed finite
    assert "the data the step saw differs from the data stored" in c.statement
    assert "input pipeline" in c.statement
    assert d.origin.startswith("the stored batch replays finite")
    assert "although the run recorded" in d.origin
    assert "use_deterministic_algorithms" not in d.results[0].snippet()
    assert "input pipeline" in d.results[0].snippet()
    # no row is listed as a fix: each changed nothing or was not needed
    fixes = [r for r in d.results if r.kind != "not_reproducible"]
    assert fixes and not any(r.finite for r in fixes)
    df = d.to_frame()
    for kind in ("clip_grad", "lower_lr"):
        row = df[df["kind"] == kind].iloc[0]
        assert not row["finite"] and ("changed nothing" in row["note"] or "no fix" in row["note"])


def test_a_half_precision_checkpoint_names_the_guards_directory_and_no_missing_snapshot(
    tmp_path: Path,
) -> None:
    """A checkpoint saved in float16 and loaded back: a weight beyond float16's range is
    Inf; the next step's guard finds it."""
    directory = tmp_path / "run-7" / "snaps"
    model = mlp()
    with torch.no_grad():
        model[0].weight[0, 0] = 7e4  # beyond float16's maximum 65504
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    guard = _guard(model, opt, directory)
    state = {k: v.half() for k, v in model.state_dict().items()}  # the half checkpoint
    model.load_state_dict({k: v.float() for k, v in state.items()})
    assert not torch.isfinite(model[0].weight).all()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x, y = _batch(0)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        assert not guard.check(loss, inputs=x, target=y, step=0)
    d = nbdebug.diagnose(nbdebug.load_snapshot(guard.snapshots[-1], model=mlp), progress=False)
    assert d.cause.kind == "weights_corrupted"
    snippet = d.results[0].snippet()
    assert "nbdebug-snapshots" not in snippet
    assert repr(str(directory)) in snippet
    # no earlier snapshot exists: the snippet says so and loads none
    assert "load_snapshot" not in snippet and "no earlier snapshot in" in snippet


def test_long_row_lists_are_counted() -> None:
    model = mlp()
    x, y = _batch(0, n=32)
    x[:26, 0] = float("nan")
    d = nbdebug.diagnose(model, x, y, F.mse_loss, progress=False)
    assert "26 of 32 rows" in d.origin and "0, 1, 2" not in d.origin
    drop = next(r for r in d.results if r.kind == "drop_rows")
    assert drop.describe() == "drop batch 26 of 32 rows"
    assert drop.rows == list(range(26))  # the fact stays a list
    assert "0, 1, 2" not in d.cause.statement


def test_a_cause_that_reproduces_is_never_named_not_reproducible(tmp_path: Path) -> None:
    """Every fix raises: the plain replay (non-finite) does not rank first."""

    class Boom(nbdebug.Fix):
        def apply(self, replay):  # type: ignore[no-untyped-def, override]
            raise RuntimeError("no")

    model = mlp()
    x, y = _batch(0)
    x[1, 0] = float("nan")
    d = nbdebug.diagnose(model, x, y, F.mse_loss, fixes=[Boom()], progress=False)
    assert not d.cause.finite
    assert d.cause.kind != "not_reproducible"
    assert "the failure reproduces" in d.cause.statement


def test_an_earlier_snapshot_that_exists_is_the_one_named(tmp_path: Path) -> None:
    """A NaN batch at step 3 (skipped: its snapshot is written), then an update that
    overflows at step 6: the diagnosis of the corrupted weights names the step-3 file,
    which exists, in the guard's own directory."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = nbdebug.NaNGuard(
        model,
        opt,
        directory=tmp_path,
        loss_fn=F.mse_loss,
        patience=None,
        on_nonfinite="skip",
        param_norm_every=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for step in range(9):
            x, y = _batch(step)
            if step == 3:
                x[0, 0] = float("nan")
            if step == 6:
                for g in opt.param_groups:
                    g["lr"] = float("inf")  # a broken schedule: the weights become Inf
            loss = F.mse_loss(model(x), y)
            loss.backward()
            ok = guard.check(loss, inputs=x, target=y, step=step)
            if ok:
                try:
                    opt.step()
                except nbdebug.NonFiniteError:
                    break
            opt.zero_grad()
            if len(guard.snapshots) >= 2:
                break
    assert len(guard.snapshots) >= 2
    first, last = Path(guard.snapshots[0]), Path(guard.snapshots[-1])
    assert first.exists() and first.parent == last.parent == tmp_path
    d = nbdebug.diagnose(nbdebug.load_snapshot(last, model=mlp), progress=False)
    assert d.cause.kind == "weights_corrupted"
    snippet = d.results[0].snippet()
    assert repr(str(first)) in snippet and "load_snapshot" in snippet
    assert repr(str(tmp_path)) in snippet  # the guard's own directory
    for r in d.results:
        for word in r.snippet().split("'"):
            if word.endswith(".nbsnap"):
                assert Path(word).exists(), word
