"""Divergence as a cause (issue 31, item 3): runs that diverge through their updates,
each trained with a real optimizer under the guard until it went non-finite by itself.
The expected answer is worked out in plain torch: the right fix applied by hand (a capped
warm-up, gradient clipping, a lower learning rate) keeps the same run finite."""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import ReluRNN, regression_batch, sequence_batch
from torch import nn

import nbdebug
from nbdebug.analysis.diagnose.divergence import band, find_divergence
from nbdebug.analysis.diagnose.interventions import FIXES

Batch = tuple[torch.Tensor, torch.Tensor]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


class Run:
    """One training loop: model, optimizer, schedule, batches, optional clipping."""

    def __init__(
        self,
        make_model: Callable[[], nn.Module],
        make_opt: Callable[[nn.Module], torch.optim.Optimizer],
        batches: Callable[[int], Batch],
        *,
        schedule: Callable[[int], float] | None = None,
        clip: float | None = None,
    ) -> None:
        self.model = make_model()
        self.opt = make_opt(self.model)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule) if schedule else None
        self.batches, self.clip = batches, clip

    def step(self, step: int, guard: Any = None) -> bool:
        x, y = self.batches(step)
        loss = F.mse_loss(self.model(x), y)
        loss.backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        if guard is not None:
            if not guard.check(loss, inputs=x, target=y, step=step):
                return False
        elif not torch.isfinite(loss):
            return False
        self.opt.step()
        self.opt.zero_grad()
        if self.sched is not None:
            self.sched.step()
        return True


def until_nonfinite(run: Run, tmp: Path, steps: int = 300) -> tuple[Any, int]:
    guard = nbdebug.NaNGuard(
        run.model,
        run.opt,
        directory=tmp,
        loss_fn=F.mse_loss,
        scheduler=run.sched,
        param_norm_every=1,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the spike detector warns on the way up
        for step in range(steps):
            if not run.step(step, guard):
                return guard, step
    raise AssertionError("the run stayed finite: the scenario needs to diverge")


def _stays_finite(run: Run, steps: int) -> bool:
    return all(run.step(step) for step in range(steps))


def _warmup() -> tuple[Run, Run]:
    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.001)

    uncapped = Run(mlp, sgd, regression_batch, schedule=lambda t: 1.0 + t)
    capped = Run(mlp, sgd, regression_batch, schedule=lambda t: min(1.0 + t, 10.0))
    return uncapped, capped


def _rnn() -> tuple[Run, Run]:
    def sgd(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.002, momentum=0.9)

    return Run(ReluRNN, sgd, sequence_batch), Run(ReluRNN, sgd, sequence_batch, clip=1.0)


def _high_lr() -> tuple[Run, Run]:
    return (
        Run(mlp, lambda m: torch.optim.SGD(m.parameters(), lr=3.0), regression_batch),
        Run(mlp, lambda m: torch.optim.SGD(m.parameters(), lr=0.01), regression_batch),
    )


SHAPES = {
    "uncapped warm-up": _warmup,
    "relu rnn without clipping": _rnn,
    "lr far too high": _high_lr,
}
MODELS = {"uncapped warm-up": mlp, "relu rnn without clipping": ReluRNN, "lr far too high": mlp}


def _jump(rows: list[dict[str, Any]]) -> int:
    """Worked out by hand: the first step of the final run of steps whose gradient norm is
    over 6x the median of all the healthy steps before it."""
    began = len(rows) - 1
    for b in range(len(rows) - 1, 0, -1):
        med = statistics.median(r["grad_norm"] for r in rows[max(0, b - 20) : b])
        if all(r["grad_norm"] > 6 * med for r in rows[b:]):
            began = b
        else:
            break
    return int(rows[began]["step"])


@pytest.mark.parametrize("name", list(SHAPES))
def test_a_run_that_diverged_through_its_updates_is_diagnosed_as_diverged(
    name: str, tmp_path: Path
) -> None:
    bad, fixed = SHAPES[name]()
    guard, failed = until_nonfinite(bad, tmp_path)
    # the right fix, applied by hand in plain torch, keeps the same run finite
    assert _stays_finite(fixed, failed + 20)
    rows = [dict(h) for h in guard.history if h.get("step", 0) < failed]
    snap = nbdebug.load_snapshot(guard.snapshots[-1], model=MODELS[name])
    d = nbdebug.diagnose(snap, progress=False)
    c = d.cause
    assert c.kind == "diverged", d
    assert c.kind != "not_reproducible" and not c.finite
    began = _jump(rows)
    assert f"the weights diverged over the updates from step {began}" in c.statement, d
    assert c.statement.endswith(".")
    assert f"resume from a checkpoint before step {began}" in c.statement
    # the advice says what the replays over steps verified, each change they tried named
    assert d.over_steps is not None
    ran = [r for r in d.over_steps.replays if r.intervention in FIXES and r.ran]
    assert ran and all(r.change in c.statement for r in ran)
    if any(r.counts for r in ran):
        assert "the replays over steps show that" in c.statement
    else:
        assert "none of the changes replayed over steps" in c.statement
    # the healthy band: the steps before the divergence began, never the ones diagnosed
    before = [r for r in rows if r["step"] < began]
    assert d.reference["grad_norm"] == pytest.approx(
        statistics.median(r["grad_norm"] for r in before[-20:])
    )
    assert d.reference["loss"] == pytest.approx(statistics.median(r["loss"] for r in before[-20:]))
    div = c.fix.divergence  # type: ignore[union-attr]
    assert div.began == began and div.step == failed
    w0, w1 = div.weight_norm
    assert w0 == pytest.approx(before[-1]["param_norm"]) and w1 > 10 * w0
    assert div.grad_z and min(z for _, z in div.grad_z) > 6
    # the frame says so too
    top = d.to_frame().iloc[0]
    assert top["kind"] == "diverged" and "the gradient norm rose from" in top["note"]


def _activations(snap: Any, model: nn.Module) -> list[float]:
    """Plain torch: the absolute maximum of every layer's output at the failing step."""
    model.load_state_dict(dict(snap.model_state))
    h, tops = snap.inputs, []
    with torch.no_grad():
        for layer in model:
            h = layer(h)
            tops.append(float(h.abs().max()))
    return tops


def test_the_warm_up_story_names_the_rising_learning_rate_and_the_extreme_activations(
    tmp_path: Path,
) -> None:
    bad, _ = _warmup()
    guard, failed = until_nonfinite(bad, tmp_path)
    snap = nbdebug.load_snapshot(guard.snapshots[-1], model=mlp)
    d = nbdebug.diagnose(snap, progress=False)
    lr0, lr1 = 0.001, 0.001 * (1 + failed)
    assert d.cause.fix.divergence.lr == pytest.approx((lr0, lr1))  # type: ignore[union-attr]
    assert "the learning rate rose from 0.001 to" in d.cause.statement
    # the activations were already extreme (1e24) when the last Linear made Inf of them:
    # the origin says so and names no torch file
    tops = _activations(snap, mlp())
    assert tops[-1] == float("inf") and max(t for t in tops if t != float("inf")) > 1e15
    assert d.origin.startswith("the activations reached ")
    assert (
        f"at step {failed} (the output of " in d.origin
        and "2 (Linear) turned them into Inf" in d.origin
    )
    assert "torch/" not in d.origin


def test_outputs_already_extreme_read_as_such_not_as_the_loss_functions_fault(
    tmp_path: Path,
) -> None:
    bad, _ = _high_lr()
    guard, failed = until_nonfinite(bad, tmp_path)
    snap = nbdebug.load_snapshot(guard.snapshots[-1], model=mlp)
    tops = _activations(snap, mlp())
    out = tops[-1]
    assert 1e15 < out < float("inf")  # finite model outputs; mse_loss overflows them
    d = nbdebug.diagnose(snap, progress=False)
    assert d.origin == (
        f"the model's outputs reached {nbdebug.core.text.fmt_num(out)} at step {failed}; "
        "the loss turned them into Inf"
    )
    assert "mse_loss" not in d.cause.statement and "torch/" not in d.cause.statement


def test_a_single_bad_step_after_a_healthy_history_is_no_divergence() -> None:
    rows = [{"step": i, "loss": 1.0 + 0.01 * i, "grad_norm": 2.0, "lr": 0.1} for i in range(10)]
    assert find_divergence(rows, 10) is None
    rows.append({"step": 10, "loss": float("nan"), "grad_norm": float("nan"), "nonfinite": "loss"})
    assert find_divergence(rows, 10) is None
    # a spike that recovered is no divergence either
    rows[5] = {"step": 5, "loss": 1e6, "grad_norm": 1e6, "lr": 0.1}
    assert find_divergence(rows[:10], 10) is None


def test_the_band_is_robust_and_the_weights_must_grow() -> None:
    rows = [
        {"step": i, "loss": 1.0, "grad_norm": 2.0 + (i % 2), "param_norm": 5.0} for i in range(8)
    ]
    ref = band(rows)
    assert ref.grad_norm == 2.5 and ref.grad_norm_mad is not None and ref.grad_norm_mad > 0
    grown = [*rows, {"step": 8, "loss": 1e5, "grad_norm": 1e5, "param_norm": 5.0}]
    # gradient norm and loss exploded, but the weights held: not a divergence of the updates
    assert find_divergence(grown, 9) is None
    grown[-1]["param_norm"] = 500.0
    d = find_divergence(grown, 9)
    assert d is not None and d.began == 8 and d.weight_norm == (5.0, 500.0)
