"""The optimizer step as an origin (issue 33, item 5): the guard catches an update that
makes a weight or optimizer state non-finite at its step, rolls it back, and its snapshot's
origin (phase "optimizer") names the parameter, the state tensor and the reason; diagnose
ranks the right fix first. Every failing update is worked out in plain torch first."""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import pytest
import torch
from torch import nn

import nbdebug
from nbdebug.core.guard import NonFiniteError
from nbdebug.core.vocab import EventKind, FailureKind, FixKind, Phase, UpdateFault


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def half_case() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """Adam on float16 weights with eps=1e-8 (0 in float16): input column 1 is zero, so
    the gradient of weight[:, 1] is exactly 0 and Adam divides 0 by 0 there."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half()
    x = torch.randn(8, 4).half()
    x[:, 1] = 0
    return model, torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8), x


def lr_case() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """SGD at lr=1e38 in float32 on gradients of size ~10-100: lr x grad > 3.4e38."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=1e38), torch.randn(8, 4) * 100


def nan_state_case() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """Adam after one healthy step, with a NaN put into exp_avg_sq (a corrupt state)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(8, 4)
    loss_of(model(x)).backward()
    opt.step()
    opt.zero_grad()
    opt.state[model.weight]["exp_avg_sq"][0, 0] = float("nan")
    return model, opt, x


def plain_update(case) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The same step unguarded, in plain torch: the weights after the update."""
    model, opt, x = case()
    loss_of(model(x)).backward()
    opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def guarded_step(case, tmp_path: Path, **options):  # type: ignore[no-untyped-def]
    model, opt, x = case()
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path, **options)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_before = copy.deepcopy(opt.state_dict())
    loss = loss_of(model(x))
    loss.backward()
    assert guard.check(loss, inputs=x)  # forward and backward are finite
    return guard, model, opt, before, state_before


def _our_hooks(opt: torch.optim.Optimizer) -> list[object]:
    hooks = [*opt._optimizer_step_pre_hooks.values(), *opt._optimizer_step_post_hooks.values()]
    return [h for h in hooks if getattr(h, "__module__", "") == "nbdebug.core.guard.update_watch"]


CASES = [
    # case, the bad parameter, its state tensor, the fault
    (half_case, "weight", "exp_avg_sq", UpdateFault.EPS_BELOW_NORMAL),
    (lr_case, "weight", None, UpdateFault.LR_OVERFLOW),
    (nan_state_case, "weight", "exp_avg_sq", UpdateFault.STATE_NONFINITE),
]


@pytest.mark.parametrize(("case", "param", "state", "fault"), CASES)
def test_a_bad_update_is_rolled_back_and_its_snapshot_names_the_origin(
    case, param: str, state: str | None, fault: UpdateFault, tmp_path: Path
) -> None:
    after_plain = plain_update(case)
    assert not torch.isfinite(after_plain[param]).all()  # the failure is real
    guard, model, opt, before, state_before = guarded_step(case, tmp_path, check_update="rollback")
    opt.step()  # the guard's post-step hook rolls it back
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n  # exactly the pre-step weights
    now = opt.state_dict()
    assert now["state"].keys() == state_before["state"].keys()
    for i, st in state_before["state"].items():
        for k, v in st.items():
            assert torch.equal(now["state"][i][k], v) or (
                torch.isnan(v).any() and torch.equal(now["state"][i][k].isnan(), v.isnan())
            )
    row = guard.history[-1]
    assert row["nonfinite"] == FailureKind.OPTIMIZER and row["skipped"] is True
    assert guard.ok is False and len(guard.snapshots) == 1
    snap = nbdebug.load_snapshot(guard.snapshots[0], model=copy.deepcopy(model))
    assert snap.kind == FailureKind.OPTIMIZER
    assert (snap.reason["param"], snap.reason["state"], snap.reason["fault"]) == (
        param,
        state,
        fault,
    )
    assert snap.reason["rolled_back"] is True
    tr = snap.trace(loss_fn=loss_of)
    o = tr.origin
    assert o is not None and o.phase == Phase.OPTIMIZER and o.kind == EventKind.UPDATE
    assert (o.param, o.state, o.fault) == (param, state, fault)
    assert tr.first_nonfinite is o and not tr.healthy
    bad = after_plain[param]
    if fault != UpdateFault.STATE_NONFINITE:  # the replayed update: the same values
        assert o.stats.n_nan == int(bad.isnan().sum())
        assert o.stats.n_inf == int(bad.isinf().sum())
    guard.close()


def test_the_replayed_origin_holds_the_plain_torch_update(tmp_path: Path) -> None:
    """float16 Adam: the NaN entries are exactly weight[:, 1] (the zero gradients)."""
    after_plain = plain_update(half_case)
    assert after_plain["weight"][:, 1].isnan().all()
    guard, model, opt, *_ = guarded_step(half_case, tmp_path, check_update="rollback")
    opt.step()
    snap = nbdebug.load_snapshot(guard.snapshots[0], model=copy.deepcopy(model))
    o = snap.trace(loss_fn=loss_of).origin
    assert o is not None and o.op == "Adam.step" and o.dtype == "float16"
    assert o.stats.n_nan == int(after_plain["weight"].isnan().sum()) >= 2
    assert "exp_avg_sq" in o.note and "eps=1e-08" in o.note
    # the snapshot's model and optimizer state are those before the step
    assert torch.equal(snap.model_state["weight"], model.weight.detach())
    guard.close()


EXPECTED_FIX = [
    (half_case, FixKind.OPTIMIZER_EPS),
    (lr_case, FixKind.LOWER_LR),
    (nan_state_case, FixKind.RESET_STATE),
]


@pytest.mark.parametrize(("case", "kind"), EXPECTED_FIX)
def test_diagnose_ranks_the_right_fix_first(case, kind: FixKind, tmp_path: Path) -> None:
    guard, model, opt, *_ = guarded_step(case, tmp_path, check_update="rollback")
    opt.step()
    snap = nbdebug.load_snapshot(guard.snapshots[0], model=copy.deepcopy(model))
    d = nbdebug.diagnose(snap, loss_fn=loss_of)
    assert not d.plain.finite  # the update replays non-finite
    top = d.results[0]
    assert top.kind == kind and top.finite, d.to_frame()
    assert d.cause.kind == kind
    guard.close()


def test_the_eps_fix_proposes_an_eps_float16_can_hold(tmp_path: Path) -> None:
    guard, model, opt, *_ = guarded_step(half_case, tmp_path, check_update="rollback")
    opt.step()
    snap = nbdebug.load_snapshot(guard.snapshots[0], model=copy.deepcopy(model))
    d = nbdebug.diagnose(snap, loss_fn=loss_of)
    fix = d.results[0].fix
    assert fix.changes == [(1e-8, 1e-4, "float16")]  # type: ignore[attr-defined]
    assert 1e-4 > torch.finfo(torch.float16).tiny > 1e-8
    # verified in plain torch: the same step with eps=1e-4 stays finite
    model2, _, x = half_case()
    opt2 = torch.optim.Adam(model2.parameters(), lr=1e-3, eps=1e-4)
    loss_of(model2(x)).backward()
    opt2.step()
    assert all(torch.isfinite(p).all() for p in model2.parameters())
    guard.close()


@pytest.mark.parametrize("mode", [True, "rollback"])
def test_a_healthy_run_is_untouched(mode: object, tmp_path: Path) -> None:
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    b = copy.deepcopy(a)
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-2)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-2)
    guard = nbdebug.NaNGuard(b, opt_b, directory=tmp_path, check_update=mode)
    for step in range(6):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        for model, opt in ((a, opt_a), (b, opt_b)):
            loss = loss_of(model(x))
            loss.backward()
            if model is b:
                assert guard.check(loss, inputs=x)
            opt.step()
            opt.zero_grad()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n
    sa, sb = opt_a.state_dict()["state"], opt_b.state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
    assert not guard.snapshots and all(r["nonfinite"] is None for r in guard.history)
    assert len(_our_hooks(opt_b)) == 2
    guard.close()
    assert _our_hooks(opt_b) == []


def test_hooks_go_with_the_guard(tmp_path: Path) -> None:
    model, opt, _ = half_case()
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path)
    assert len(_our_hooks(opt)) == 2
    del guard
    gc.collect()
    assert _our_hooks(opt) == []
    off = nbdebug.NaNGuard(model, opt, directory=tmp_path, check_update=False)
    assert _our_hooks(opt) == [] and off.update_watch is None


def test_a_step_no_check_let_through_is_not_watched(tmp_path: Path) -> None:
    model, opt, x = half_case()
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path, check_update="rollback")
    loss_of(model(x)).backward()
    opt.step()  # no guard.check() before it: the watch stays out of it
    assert model.weight.isnan().any() and not guard.snapshots
    guard.close()


def test_without_rollback_skip_raises_and_the_snapshot_records_the_origin(
    tmp_path: Path,
) -> None:
    after_plain = plain_update(half_case)
    guard, model, opt, *_ = guarded_step(half_case, tmp_path)  # check_update=True
    with pytest.raises(NonFiniteError, match="check_update='rollback'") as err:
        opt.step()
    assert err.value.kind == FailureKind.OPTIMIZER
    assert err.value.reason["rolled_back"] is False
    assert torch.equal(model.weight.isnan(), after_plain["weight"].isnan())  # not undone
    snap = nbdebug.load_snapshot(err.value.path, model=copy.deepcopy(model))
    assert snap.update_grads is None
    o = snap.trace(loss_fn=loss_of).origin  # the weights are NaN: a forward origin
    assert o is not None
    guard.close()


def test_continue_records_the_bad_update_and_goes_on(tmp_path: Path) -> None:
    guard, model, opt, *_ = guarded_step(half_case, tmp_path, on_nonfinite="continue")
    opt.step()
    assert guard.history[-1]["nonfinite"] == FailureKind.OPTIMIZER
    assert guard.history[-1]["skipped"] is False and len(guard.snapshots) == 1
    assert model.weight.isnan().any()
    guard.close()


def test_raise_rolls_back_then_raises(tmp_path: Path) -> None:
    guard, model, opt, before, _ = guarded_step(
        lr_case, tmp_path, check_update="rollback", on_nonfinite="raise"
    )
    with pytest.raises(NonFiniteError) as err:
        opt.step()
    assert err.value.reason["fault"] == UpdateFault.LR_OVERFLOW
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    guard.close()


def test_check_update_refuses_other_values(tmp_path: Path) -> None:
    model, opt, _ = half_case()
    with pytest.raises(ValueError, match="check_update must be True, False, None or 'rollback'"):
        nbdebug.NaNGuard(model, opt, directory=tmp_path, check_update="copy")


def test_the_guarded_step_form_rolls_back_too(tmp_path: Path) -> None:
    model, opt, x = half_case()
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path, check_update="rollback")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with guard.step(x) as s:  # the guard steps the optimizer itself
        s.loss = loss_of(model(x))
        s.loss.backward()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert guard.ok is False and guard.history[-1]["nonfinite"] == FailureKind.OPTIMIZER
    assert s.ok is False  # the step's own outcome says the update was undone
    guard.close()


def test_half_weights_are_read_every_step_float32_ones_every_tenth(tmp_path: Path) -> None:
    """Between two full reads (every 10th watched step) only float16/bfloat16 weights are
    read after the update; a float32 update gone bad then meets the next check."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    guard = nbdebug.NaNGuard(model, opt, directory=tmp_path, spike=False, rewind=False)
    x = torch.randn(8, 4) * 100
    loss = loss_of(model(x))
    loss.backward()
    assert guard.check(loss, inputs=x)
    opt.step()  # watched step 0: a full read, healthy
    opt.zero_grad()
    for g in opt.param_groups:
        g["lr"] = 1e38  # lr x grad > 3.4e38 in float32: the weights overflow (plain torch)
    loss = loss_of(model(x))
    loss.backward()
    assert guard.check(loss, inputs=x)
    opt.step()  # watched step 1: only half-precision weights are read
    opt.zero_grad()
    assert not torch.isfinite(model.weight).all()  # the update did overflow
    assert all(r["nonfinite"] is None for r in guard.history)  # not seen at its step
    loss = loss_of(model(x))
    loss.backward()
    assert not guard.check(loss, inputs=x)  # the next check meets the non-finite weights
    assert guard.history[-1]["nonfinite"] is not None
    guard.close()
    # float16 weights are read after every update: a bad second update is caught at once
    hmodel, hopt, hx = half_case()
    hx[:, 1] = 1.0  # no zero gradient entry: a healthy first update
    hguard = nbdebug.NaNGuard(hmodel, hopt, directory=tmp_path / "h", spike=False, rewind=False)
    for t in range(2):
        if t == 1:
            hopt.state[hmodel.weight]["exp_avg_sq"][0, 0] = float("nan")  # a corrupt state
        loss = loss_of(hmodel(hx))
        loss.backward()
        assert hguard.check(loss, inputs=hx)
        if t == 0:
            hopt.step()
        else:
            with pytest.raises(NonFiniteError):  # skip cannot undo it without rollback
                hopt.step()
        hopt.zero_grad()
    assert hguard.history[-1]["nonfinite"] == FailureKind.OPTIMIZER
    hguard.close()
