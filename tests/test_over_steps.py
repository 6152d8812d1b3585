"""Counterfactual replays over steps (issue 31, item 2): a run replayed from a rewind
window through the failing step and k steps beyond it, once per intervention.

Each run is trained here in plain torch until it goes non-finite by itself, recording
what a guard's ``rewind=K`` keeps (the state at the window's start, every batch, RNG
state and learning rate since); the window is built by hand from that record, and once
through a real guard. The expected outcome of every intervention is worked out in plain
torch: the change applied by hand to a fresh model loaded with the window's state,
trained over the same steps, held to the healthy band computed here by hand."""

from __future__ import annotations

import copy
import itertools
import math
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from models import ReluRNN, regression_batch, sequence_batch
from state import assert_unchanged, fingerprint
from torch import nn

import nbdebug
from nbdebug.analysis.diagnose.interventions import Intervention, Verdict
from nbdebug.analysis.diagnose.over_steps import NO_WINDOW, OverSteps, replay_window
from nbdebug.core.snapshot import resolve_step
from nbdebug.core.snapshot.rewind import RewindStep, RewindWindow
from nbdebug.core.state import RngState

K = 3  # the steps replayed beyond the failure
Batch = tuple[torch.Tensor, torch.Tensor]
MakeOpt = Callable[[nn.Module], torch.optim.Optimizer]


def _nan_at_30(step: int) -> Batch:
    """Healthy regression data, but the batch of step 30 holds a NaN in row 3."""
    x, y = regression_batch(step)
    if step == 30:
        x = x.clone()
        x[3, 2] = float("nan")
    return x, y


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))


def _norm(tensors: list[torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([t.double().norm() for t in tensors])))


@dataclass
class Recorded:
    """A run trained in plain torch until it went non-finite, with what a rewind window
    keeps at every step."""

    model: nn.Module
    opt: torch.optim.Optimizer
    make_model: Callable[[], nn.Module]
    make_opt: MakeOpt
    failed: int = -1
    batches: dict[int, Batch] = field(default_factory=dict)
    states: dict[int, tuple[dict[str, Any], dict[str, Any]]] = field(default_factory=dict)
    rng: dict[int, RngState] = field(default_factory=dict)
    lr: dict[int, list[float]] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)

    def window(self, start: int, *, stored: bool = True) -> RewindWindow:
        steps = []
        for t in range(start, self.failed + 1):
            x, y = self.batches[t]
            row = next((r for r in self.rows if r["step"] == t), {})
            steps.append(
                RewindStep(
                    step=t,
                    inputs=x.clone() if stored else None,
                    target=y.clone() if stored else None,
                    stored=stored,
                    ids=None,
                    rng=self.rng[t],
                    lr=list(self.lr[t]),
                    loss=row.get("loss", math.nan),
                    grad_norm=row.get("grad_norm", math.nan),
                )
            )
        model_state, opt_state = self.states[start]
        return RewindWindow(start, model_state, opt_state, None, None, steps, nbytes=0)

    def over_steps(self, window: RewindWindow) -> OverSteps:
        x, y = self.batches[self.failed]
        src = resolve_step(
            self.model, x, y, loss_fn=F.mse_loss, optimizer=self.opt, history=self.rows
        )
        return replay_window(src, window, steps=K)


def train(
    make_model: Callable[[], nn.Module],
    make_opt: MakeOpt,
    batches: Callable[[int], Batch],
    *,
    schedule: Callable[[int], float] = lambda t: 1.0,
) -> Recorded:
    model = make_model()
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    torch.manual_seed(1)
    run = Recorded(model, opt, make_model, make_opt)
    for t in range(400):
        x, y = batches(t)
        run.batches[t] = (x, y)
        run.states[t] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        run.rng[t] = RngState.capture()
        run.lr[t] = [float(g["lr"]) for g in opt.param_groups]
        loss = F.mse_loss(model(x), y)
        loss.backward()
        grad = _norm([p.grad for p in model.parameters() if p.grad is not None])
        if not (math.isfinite(loss.item()) and math.isfinite(grad)):
            run.failed = t
            return run
        params = [p.detach() for p in model.parameters()]
        row = {"step": t, "loss": loss.item(), "grad_norm": grad, "lr": run.lr[t][0]}
        run.rows.append({**row, "param_norm": _norm(params)})
        opt.step()
        opt.zero_grad()
        sched.step()
    raise AssertionError("the run stayed finite: the scenario needs to fail")


# ------------------------------------------------------------------ by hand, plain torch
def began(rows: list[dict[str, Any]]) -> int | None:
    """The first step of the final run of steps whose gradient norm is over 6x the median
    of the healthy steps before it (``None``: the last step is not such a step)."""
    start = None
    for b in range(len(rows) - 1, 0, -1):
        med = statistics.median(r["grad_norm"] for r in rows[max(0, b - 20) : b])
        if not all(r["grad_norm"] > 6 * med for r in rows[b:]):
            break
        start = b
    return None if start is None else int(rows[start]["step"])


def band_top(rows: list[dict[str, Any]], key: str) -> float:
    """Median + 6 robust sigmas (1.4826 MAD, floored at a tenth of the median)."""
    v = [r[key] for r in rows[-20:]]
    med = statistics.median(v)
    mad = max(1.4826 * statistics.median(abs(a - med) for a in v), 0.1 * abs(med))
    return med + 6 * mad


@dataclass
class ByHand:
    loss: list[float]
    grad: list[float]
    counts: bool


def by_hand(
    run: Recorded,
    window: RewindWindow,
    healthy: list[dict[str, Any]],
    *,
    lr: list[float] | None = None,
    clip: float | None = None,
    skip: bool = False,
    reset: bool = False,
) -> ByHand:
    """The window's steps (the failing batch left out with ``skip``), then K more (the
    failing batch again, or the healthy batches again with ``skip``), on a fresh model
    and optimizer loaded with the window's state; the band of ``healthy`` rows applies
    from the failing step's place on."""
    model = run.make_model()
    model.load_state_dict(window.model_state)
    opt = run.make_opt(model)
    opt.load_state_dict(copy.deepcopy(window.optimizer_state))
    if reset:
        opt.state.clear()
    fail = window.steps[-1]
    fx, fy = run.batches[fail.step]
    seq = [(s.inputs, s.target, s.rng, s.lr) for s in window.steps[:-1]]
    checked = len(seq)
    if skip:
        seq += [(x, y, rng, fail.lr) for (x, y, rng, _), _ in zip(itertools.cycle(seq), range(K))]
    else:
        seq += [(fx, fy, fail.rng, fail.lr)] * (1 + K)
    losses, grads = [], []
    for x, y, rng, step_lr in seq:
        torch.set_rng_state(rng.torch_cpu)
        for g, v in zip(opt.param_groups, lr or step_lr):
            g["lr"] = v
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        g = _norm([p.grad for p in model.parameters() if p.grad is not None])
        if clip is not None and math.isfinite(g):
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            g = min(g, clip)
        losses.append(loss.item())
        grads.append(g)
        if not (math.isfinite(losses[-1]) and math.isfinite(g)):
            break
        opt.step()
    finite = len(losses) == len(seq) and all(map(math.isfinite, losses + grads))
    lt, gt = band_top(healthy, "loss"), band_top(healthy, "grad_norm")
    inside = all(a <= lt and b <= gt for a, b in zip(losses[checked:], grads[checked:]))
    return ByHand(losses, grads, finite and inside)


def _assert_matches(over: OverSteps, which: str, hand: ByHand) -> None:
    r = over.replay(which)
    assert r.counts == hand.counts, (which, r, hand)
    assert r.loss == pytest.approx(hand.loss, rel=1e-4, nan_ok=True), which
    assert r.grad_norm == pytest.approx(hand.grad, rel=1e-4, nan_ok=True), which


def _sgd_warmup(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.001)


def _sgd_momentum(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.002, momentum=0.9)


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def warmup() -> Recorded:
    """A warm-up schedule without a cap: the learning rate keeps rising until the run
    diverges through its updates."""
    return train(mlp, _sgd_warmup, regression_batch, schedule=lambda t: 1.0 + t)


@pytest.fixture(scope="module")
def rnn() -> Recorded:
    """A ReLU RNN trained with momentum and without gradient clipping."""
    return train(ReluRNN, _sgd_momentum, sequence_batch)


@pytest.fixture(scope="module")
def bad_data() -> Recorded:
    """A healthy run whose batch of step 30 holds a NaN."""
    return train(mlp, _sgd, _nan_at_30)


# ------------------------------------------------------------------------------ tests
def _common(run: Recorded, over: OverSteps, window: RewindWindow, healthy: list[Any]) -> None:
    """What every diverging scenario shares: the healthy band, the plain replay
    reproducing the failure, the plain replay and clipping matching plain torch."""
    assert over.band.grad_norm == pytest.approx(
        statistics.median(r["grad_norm"] for r in healthy[-20:])
    )
    plain = over.replay("plain")
    assert not plain.finite and plain.steps[-1] == run.failed
    assert not math.isfinite(plain.loss[-1]) or not math.isfinite(plain.grad_norm[-1])
    _assert_matches(over, "plain", by_hand(run, window, healthy))
    clip = statistics.median(r["grad_norm"] for r in healthy[-20:])
    _assert_matches(over, "clip_grad", by_hand(run, window, healthy, clip=clip))
    skip = by_hand(run, window, healthy, skip=True)
    assert not skip.counts  # the weights were already going: the batch is not it
    _assert_matches(over, "skip_batch", skip)
    assert over.verdict is Verdict.OPTIMISATION
    assert over.summary().startswith("Verdict optimisation: the updates diverged")
    assert f"through step {run.failed + K}" in over.summary()
    assert any("the failing batch is repeated 3 times" in n for n in over.notes)


def test_a_warm_up_without_a_cap_is_optimisation(warmup: Recorded) -> None:
    run = warmup
    b = began(run.rows)
    assert b is not None and b < run.failed  # the run diverges before it fails
    window = run.window(b - 4)
    before = fingerprint(run.model)
    opt_before = copy.deepcopy(run.opt.state_dict())
    over = run.over_steps(window)
    assert_unchanged(before, run.model)  # the model, its grads, the RNGs
    assert str(run.opt.state_dict()) == str(opt_before)
    assert over.began == b
    healthy = [r for r in run.rows if r["step"] < b]  # the band: before the divergence
    _common(run, over, window, healthy)
    # lr x0.1 held at the last healthy step's, applied by hand, keeps the run healthy
    lower = by_hand(run, window, healthy, lr=[0.1 * v for v in run.lr[b - 1]])
    assert lower.counts
    _assert_matches(over, "lower_lr", lower)
    assert over.replay("lower_lr").supports is Verdict.OPTIMISATION
    assert over.replay("reset_moments").skipped == "the optimizer keeps no moments to reset"


def test_a_relu_rnn_without_clipping_is_optimisation(rnn: Recorded) -> None:
    run = rnn
    b = began(run.rows)
    assert b is not None and b < run.failed  # the gradient norm explodes before it fails
    window = run.window(b - 4)
    over = run.over_steps(window)
    # the weight norm grew less than 1.5x from before the jump: by the history's rule no
    # divergence of the weights, so the band is that of the steps before the failure
    assert run.rows[-1]["param_norm"] < 1.5 * run.rows[b - 5]["param_norm"]
    assert over.began is None
    _common(run, over, window, run.rows)
    reset = by_hand(run, window, run.rows, reset=True)
    assert reset.counts  # momentum restarted at the window's start, by hand
    _assert_matches(over, "reset_moments", reset)
    _assert_matches(over, "lower_lr", by_hand(run, window, run.rows, lr=[0.0002]))


def test_a_bad_batch_is_data(bad_data: Recorded) -> None:
    run = bad_data
    assert run.failed == 30
    window = run.window(24)
    healthy = [r for r in run.rows if r["step"] < 30]
    over = run.over_steps(window)
    skip = by_hand(run, window, healthy, skip=True)
    assert skip.counts  # skipping the batch by hand keeps the run healthy
    _assert_matches(over, "skip_batch", skip)
    for which, hand in [
        ("plain", by_hand(run, window, healthy)),
        ("lower_lr", by_hand(run, window, healthy, lr=[0.001])),
        ("clip_grad", by_hand(run, window, healthy, clip=over.band.grad_norm)),
    ]:
        assert not hand.counts
        _assert_matches(over, which, hand)
    # the failing batch on the earlier state: NaN as well (PaLM's test: the data alone)
    earlier = over.replay("earlier_state")
    model = mlp()
    model.load_state_dict(window.model_state)
    x, y = run.batches[30]
    assert not math.isfinite(F.mse_loss(model(x), y).item())
    assert earlier.start_step == 24 and not earlier.finite
    assert earlier.supports is Verdict.DATA
    assert over.replay("same_state").supports is None  # persistent, not transient
    assert over.verdict is Verdict.DATA
    assert over.summary().startswith("Verdict data: the failing batch breaks the earlier")
    assert "skipping the failing batch (step 30) keeps the run finite" in over.summary()
    assert list(over.to_frame()["intervention"])[:2] == ["plain", "lower_lr"]


class RowNorm(nn.Module):
    """A hand-written normalisation without an epsilon: a constant row divides by 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(1, keepdim=True)) / x.std(1, keepdim=True)


def normed() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(RowNorm(), nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))


def _constant_row_at_30(step: int) -> Batch:
    x, y = regression_batch(step)
    if step == 30:
        x = x.clone()
        x[3] = 0.5
    return x, y


class Glitch(nn.Module):
    """A layer that returns NaN on its 31st call only (a hardware fault, a race)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x * float("nan") if self.calls == 31 else x


def glitchy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), Glitch(), nn.ReLU(), nn.Linear(32, 1))


def test_a_finite_batch_that_no_state_can_take_is_numerics() -> None:
    run = train(normed, _sgd, _constant_row_at_30)
    assert run.failed == 30
    window = run.window(24)
    healthy = [r for r in run.rows if r["step"] < 30]
    over = run.over_steps(window)
    # by hand: the failing batch is finite, and non-finite on the window's first state too
    x, y = run.batches[30]
    model = normed()
    model.load_state_dict(window.model_state)
    assert torch.isfinite(x).all() and not math.isfinite(F.mse_loss(model(x), y).item())
    assert over.replay("earlier_state").supports is Verdict.NUMERICS
    skip = by_hand(run, window, healthy, skip=True)
    assert skip.counts
    _assert_matches(over, "skip_batch", skip)
    assert over.replay("skip_batch").supports is Verdict.NUMERICS
    assert over.verdict is Verdict.NUMERICS
    assert over.summary().startswith("Verdict numerics: the failing batch, finite itself")


def test_a_fault_that_does_not_come_back_is_transient() -> None:
    run = train(glitchy, _sgd, regression_batch)
    assert run.failed == 30
    over = run.over_steps(run.window(24))
    # by hand: the failing step rerun on its recorded state (the glitch gone) is finite
    model = glitchy()
    model.load_state_dict(run.states[30][0])
    model[1].calls = 31
    x, y = run.batches[30]
    torch.set_rng_state(run.rng[30].torch_cpu)
    assert math.isfinite(F.mse_loss(model(x), y).item())
    same = over.replay("same_state")
    assert same.finite and same.supports is Verdict.TRANSIENT
    assert over.verdict is Verdict.TRANSIENT
    assert "a transient fault" in over.summary()


def test_a_window_without_its_batches_replays_the_failing_batch_only(bad_data: Recorded) -> None:
    over = bad_data.over_steps(bad_data.window(24, stored=False))
    assert any("replays of the failing batch only" in n for n in over.notes), over.notes
    names = [str(r.intervention) for r in over.replays]
    assert "plain" not in names  # no batches to replay the window with
    assert over.replay("skip_batch").skipped == (
        "the window's batches were not stored: no other batch to train on"
    )
    lower = over.replay("lower_lr")
    # from the failing step's own state; a replay stops at its first non-finite step
    assert lower.start_step == 30 and lower.steps == [30] and not lower.finite
    assert over.replay("earlier_state").start_step == 24
    assert over.verdict is Verdict.DATA


def test_a_window_of_the_failing_step_alone_says_so(bad_data: Recorded) -> None:
    over = bad_data.over_steps(bad_data.window(30))
    assert any("the window holds only the failing step 30" in n for n in over.notes)
    assert over.replay("earlier_state").supports is None  # no earlier state to try
    assert over.replay("skip_batch").skipped == (
        "the window holds no healthy batch to train on instead"
    )
    assert over.verdict is None
    assert over.summary().startswith("No replay over steps told the cause apart")


def test_bad_input_is_one_sentence(bad_data: Recorded) -> None:
    window = bad_data.window(24)
    with pytest.raises(ValueError, match=r"steps must be an int >= 1; got 0\."):
        replay_window(resolve_step(bad_data.model, bad_data.batches[30][0]), window, steps=0)
    x, y = bad_data.batches[30]
    src = resolve_step(bad_data.model, x, y, loss_fn=F.mse_loss, optimizer=bad_data.opt)
    with pytest.raises(TypeError, match=r"window must be a RewindWindow \(snap.rewind\); got dict"):
        replay_window(src, {"steps": []})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"step must be a ResolvedStep .*; got Sequential"):
        replay_window(bad_data.model, window)  # type: ignore[arg-type]
    src.step = 99
    with pytest.raises(ValueError, match=r"holds steps 24\.\.30; expected the failing step 99"):
        replay_window(src, window)


def _guarded_warmup(tmp: Path, rewind: int) -> tuple[Any, int]:
    model = mlp()
    opt = _sgd_warmup(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 + t)
    guard = nbdebug.NaNGuard(
        model,
        opt,
        directory=tmp,
        loss_fn=F.mse_loss,
        scheduler=sched,
        rewind=rewind,
        on_spike="ignore",
        param_norm_every=1,
    )
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for t in range(400):
            x, y = regression_batch(t)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            if not guard.check(loss, inputs=x, target=y, step=t):
                return guard, t
            opt.step()
            opt.zero_grad()
            sched.step()
    raise AssertionError("the run stayed finite")


def test_a_guard_snapshot_with_a_rewind_window_is_diagnosed_over_steps(tmp_path: Path) -> None:
    guard, failed = _guarded_warmup(tmp_path, rewind=20)
    snap = nbdebug.load_snapshot(guard.snapshots[-1], model=mlp)
    window = snap.rewind
    assert window is not None and window.steps[-1].step == failed
    rows = [dict(h) for h in guard.history if h["step"] < failed]
    b = began(rows)
    assert b is not None and window.start_step < b  # the window reaches back before it
    caller = torch.get_rng_state()
    d = nbdebug.diagnose(snap, progress=False)
    assert torch.equal(caller, torch.get_rng_state())
    assert d.verdict is Verdict.OPTIMISATION
    assert d.replays[0].intervention is Intervention.PLAIN
    healthy = [r for r in rows if r["step"] < b]
    run = Recorded(mlp(), _sgd_warmup(mlp()), mlp, _sgd_warmup)
    run.batches[failed] = (snap.inputs, snap.target)
    lower = by_hand(
        run, window, healthy, lr=[0.1 * s.lr[0] for s in window.steps if s.step == b - 1]
    )
    assert lower.counts
    r = next(r for r in d.replays if r.intervention is Intervention.LOWER_LR)
    assert r.counts and r.loss == pytest.approx(lower.loss, rel=1e-4)
    assert any(n.startswith("Verdict optimisation") for n in d.notes)


def test_a_snapshot_without_a_window_says_what_would_allow_the_replays(tmp_path: Path) -> None:
    guard, _ = _guarded_warmup(tmp_path, rewind=0)
    snap = nbdebug.load_snapshot(guard.snapshots[-1], model=mlp)
    assert snap.rewind is None
    d = nbdebug.diagnose(snap, progress=False)
    assert d.replays == [] and d.verdict is None
    assert NO_WINDOW in d.notes
    assert NO_WINDOW == "replays over steps need a rewind window: NaNGuard(..., rewind=K)."
    assert d.cause.kind == "diverged"  # today's single-step diagnosis, unchanged


def test_the_figure_draws_one_curve_per_replay_and_non_finite_values_at_the_top(
    warmup: Recorded,
) -> None:
    from nbdebug.figures.replays import replays_figure

    b = began(warmup.rows)
    assert b is not None
    over = warmup.over_steps(warmup.window(b - 4))
    fig = replays_figure(over)
    ran = [r for r in over.replays if r.steps]
    lines = [t for t in fig.data if not t.name.endswith("non-finite")]
    assert sorted(t.name for t in lines) == sorted([str(r.intervention) for r in ran] * 2)
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis2.type == "log"
    plain = over.replay("plain")
    marks = [t for t in fig.data if t.name == "plain non-finite"]
    assert len(marks) == 2  # the loss panel and the gradient-norm panel
    finite = [v for r in ran for v in r.loss if math.isfinite(v)]
    loss_mark = marks[0]
    assert list(loss_mark.x) == [plain.steps[-1]]
    assert loss_mark.y[0] > max(finite)  # at the top, never as 0
    curve = next(t for t in lines if t.name == "plain")
    assert curve.y[-1] is None  # no line through the non-finite value
    assert "verdict: optimisation" in fig.layout.title.text
    with pytest.raises(TypeError, match="expects the OverSteps of a diagnosis"):
        replays_figure(over.replays)  # type: ignore[arg-type]


def test_the_fixes_tab_tells_the_story(tmp_path: Path) -> None:
    import ipywidgets as widgets

    from nbdebug.widgets.fixes import FixesPanel

    guard, _ = _guarded_warmup(tmp_path / "with", rewind=20)
    d = nbdebug.diagnose(nbdebug.load_snapshot(guard.snapshots[-1], model=mlp), progress=False)
    panel = FixesPanel(diagnosis=d)
    verdict, plot = panel.story.children
    assert isinstance(verdict, widgets.HTML) and isinstance(plot, widgets.Widget)
    assert "<b>Over steps:</b> Verdict optimisation: the updates diverged" in verdict.value
    guard, _ = _guarded_warmup(tmp_path / "without", rewind=0)
    d = nbdebug.diagnose(nbdebug.load_snapshot(guard.snapshots[-1], model=mlp), progress=False)
    (line,) = FixesPanel(diagnosis=d).story.children
    assert NO_WINDOW in line.value
