"""nbdebug.diagnose() on training loops its scenario corpus does not hold: an optimizer eps
of 0, a hand-written cross-entropy, an optimizer hyper-parameter out of its range, rewrites
of hand-written ops, and a spike snapshot. Every expected answer is worked out in plain
torch inside the test (the loop run without nbdebug, the change replayed by hand)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nbdebug
from nbdebug.analysis.diagnose.interventions import Intervention, StepsReplay, Verdict, supports
from nbdebug.core.vocab import FixKind, Phase


def _finite(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


# ------------------------------------------------------------------ 1. an eps of 0
class EmbedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(12, 4)
        self.fc = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(x).mean(1))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 9, (8, 3), generator=g)  # rows 9..11 of the table never used
    return x, x.float().mean(1, keepdim=True) / 10


OptFactory = Callable[[Any, float], torch.optim.Optimizer]
ADAM: OptFactory = lambda ps, eps: torch.optim.Adam(ps, lr=1e-2, eps=eps)  # noqa: E731
RMSPROP: OptFactory = lambda ps, eps: torch.optim.RMSprop(ps, lr=1e-2, eps=eps)  # noqa: E731


def _plain_step(make: OptFactory, eps: float) -> nn.Module:
    """One step of the loop without nbdebug: the model after the update."""
    torch.manual_seed(0)
    model = EmbedNet()
    opt = make(model.parameters(), eps)
    x, y = _tokens()
    F.mse_loss(model(x), y).backward()
    opt.step()
    return model


def _guarded_step(make: OptFactory, tmp: Path, mode: object) -> str:
    torch.manual_seed(0)
    model = EmbedNet()
    opt = make(model.parameters(), 0.0)
    guard = nbdebug.NaNGuard(
        model, opt, directory=tmp, loss_fn=F.mse_loss, check_update=mode, patience=None
    )
    x, y = _tokens()
    loss = F.mse_loss(model(x), y)
    loss.backward()
    assert guard.check(loss, inputs=x, target=y)  # forward and backward are finite
    try:
        opt.step()
    except nbdebug.NonFiniteError:
        assert mode is True  # an update that is not rolled back raises
    guard.close()
    return str(guard.snapshots[0])


@pytest.mark.parametrize("make", [ADAM, RMSPROP], ids=["adam", "rmsprop"])
def test_an_eps_of_zero_is_the_optimizer_not_corrupted_weights(
    make: OptFactory, tmp_path: Path
) -> None:
    # plain torch: finite before the step, the unused rows NaN after it (0 / (sqrt(0) + 0))
    torch.manual_seed(0)
    assert _finite(EmbedNet())
    bad = _plain_step(make, 0.0)
    rows = torch.isnan(bad.emb.weight).any(1).nonzero().flatten().tolist()
    assert rows == [9, 10, 11]
    assert _finite(_plain_step(make, 1e-8))  # the same step with eps=1e-8 is finite
    d = nbdebug.diagnose(_guarded_step(make, tmp_path, True), model=EmbedNet)
    # the snapshot holds the weights after the update: the cause is that update, unverified
    assert d.cause.kind == FixKind.OPTIMIZER_EPS and not d.cause.finite
    assert d.cause.module == "emb"
    s = d.cause.statement
    assert "emb.weight" in s and "eps=0" in s and "already held" not in s
    assert "check_update='rollback'" in s
    assert d.trace is not None and d.trace.origin is not None
    assert d.trace.origin.phase == Phase.OPTIMIZER


@pytest.mark.parametrize("make", [ADAM, RMSPROP], ids=["adam", "rmsprop"])
def test_an_eps_of_zero_rolled_back_is_fixed_by_a_replayed_eps(
    make: OptFactory, tmp_path: Path
) -> None:
    assert not _finite(_plain_step(make, 0.0)) and _finite(_plain_step(make, 1e-8))
    d = nbdebug.diagnose(_guarded_step(make, tmp_path, "rollback"), model=EmbedNet)
    top = d.results[0]
    assert not d.plain.finite  # the update replays non-finite as it ran
    # float32's smallest normal is ~1.2e-38: an eps of 0 is below it, 1e-8 is not
    assert top.kind == FixKind.OPTIMIZER_EPS and top.finite, d.to_frame()
    assert top.fix.changes == [(0.0, 1e-8, "float32")]  # type: ignore[attr-defined]
    assert type(d.workbench.optimizer).__name__ in top.snippet()  # type: ignore[union-attr]
    assert d.cause.kind == FixKind.OPTIMIZER_EPS and d.cause.finite


def test_an_eps_normal_in_float32_is_not_offered_a_raise(tmp_path: Path) -> None:
    """Adam(eps=1e-8) in float32 never divides 0 by 0: the eps fix does not apply."""
    torch.manual_seed(0)
    model = EmbedNet()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-8)
    x, y = _tokens()
    d = nbdebug.diagnose(model, x, y, F.mse_loss, optimizer=opt)
    row = next(r for r in d.results if r.kind == FixKind.OPTIMIZER_EPS)
    assert not row.applies and "eps=1e-08 in float32" in row.note


# ------------------------------------------------------------------ 2. the earlier state
class SoftmaxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(10, 32)
        self.fc2 = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


def my_ce(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy by hand: 0 * log(0) = NaN once a softmax entry underflows."""
    return -(F.one_hot(y, 5).float() * torch.log(p)).sum(1).mean()


def _ce_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    protos = 3 * torch.randn(5, 10, generator=g)
    out = []
    for _ in range(20):
        y = torch.randint(0, 5, (32,), generator=g)
        out.append((protos[y] + torch.randn(32, 10, generator=g), y))
    return out


def _ce_run(
    steps: int, skip: tuple[int, ...] = (), keep: int | None = None
) -> tuple[int | None, dict[str, torch.Tensor] | None]:
    """The loop without nbdebug: the first step whose loss is NaN, and the weights at the
    start of step ``keep``."""
    data = _ce_batches()
    torch.manual_seed(0)
    model = SoftmaxNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.07)
    kept = None
    for s in range(steps):
        if s == keep:
            kept = {k: v.clone() for k, v in model.state_dict().items()}
        if s in skip:
            continue
        x, y = data[s % 20]
        loss = my_ce(model(x), y)
        opt.zero_grad()
        loss.backward()
        if not math.isfinite(loss.item()):
            return s, kept
        opt.step()
    return None, kept


def test_a_batch_finite_on_the_earlier_state_is_never_data(tmp_path: Path) -> None:
    fail, _ = _ce_run(60)
    assert fail is not None
    again, _ = _ce_run(fail + 4, skip=(fail,))
    assert again is not None and again <= fail + 3  # skipping the batch does not help
    data = _ce_batches()
    torch.manual_seed(0)
    model = SoftmaxNet()
    opt = torch.optim.Adam(model.parameters(), lr=0.07)
    guard = _guarded(model, opt, tmp_path, lambda s: data[s % 20], fail + 1, my_ce)
    d = nbdebug.diagnose(guard.snapshots[-1], model=SoftmaxNet, loss_fn=my_ce)
    over = d.over_steps
    assert over is not None and over.failing_step == fail
    # by hand: the failing batch on the window's first state is finite (loss and grads)
    _, state = _ce_run(over.start_step + 1, keep=over.start_step)
    assert state is not None
    early = SoftmaxNet()
    early.load_state_dict(state)
    x, y = data[fail % 20]
    loss = my_ce(early(x), y)
    loss.backward()
    assert math.isfinite(loss.item()) and all(
        torch.isfinite(p.grad).all() for p in early.parameters()
    )
    earlier = over.replay("earlier_state")
    assert earlier.in_band is False  # finite there, but outside the healthy band
    assert earlier.finite and earlier.supports is not Verdict.DATA
    assert d.verdict is not Verdict.DATA
    # the verdict is one the replay table supports
    assert d.verdict is None or d.verdict in {r.supports for r in over.replays}


@pytest.mark.parametrize("bad_batch", [False, True])
def test_the_earlier_state_rule(bad_batch: bool) -> None:
    """The failing batch on the earlier state: non-finite there too -> the data (a batch
    holding NaN) or the numerics (a finite one); finite and inside the band -> data x
    state; finite but outside the band -> nothing, whatever the batch holds (it did not
    break the earlier state)."""

    def earlier(loss: float, in_band: bool | None) -> StepsReplay:
        r = StepsReplay(Intervention.EARLIER_STATE, "", 0, steps=[5], loss=[loss])
        r.grad_norm = [1.0]
        r.finite, r.in_band = math.isfinite(loss), in_band
        return r

    def said(r: StepsReplay) -> Verdict | None:
        return supports(r, [r], bad_batch=bad_batch, healthy_start=True)

    assert said(earlier(math.nan, False)) is (Verdict.DATA if bad_batch else Verdict.NUMERICS)
    assert said(earlier(0.5, True)) is Verdict.DATA_X_STATE
    assert said(earlier(9e3, False)) is None


# ------------------------------------------------------------------ 3. the advice
def _regression() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(9)
    wtrue = torch.randn(10, 1, generator=g)
    return [(x, x @ wtrue) for x in (torch.randn(32, 10, generator=g) for _ in range(20))]


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))


OptOf = Callable[[Any], torch.optim.Optimizer]


def _first_nonfinite(make: OptOf, steps: int = 300, clip: float | None = None) -> int | None:
    """The loop without nbdebug: the first step whose loss is not finite."""
    data = _regression()
    model = _mlp()
    opt = make(model.parameters())
    for s in range(steps):
        x, y = data[s % 20]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if not math.isfinite(loss.item()):
            return s
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return None


def _guarded(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    tmp: Path,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    **options: Any,
) -> nbdebug.NaNGuard:
    """A training loop of ``steps`` batches under a guard (``options``) that stops at the
    first bad step (``patience=0``); the guard, closed."""
    guard = nbdebug.NaNGuard(model, opt, directory=tmp, patience=0, **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the spike detector warns on the way up
        for s in range(steps):
            x, y = batch(s)
            loss = loss_of(model(x), y)
            loss.backward()
            try:
                if guard.check(loss, inputs=x, target=y):
                    opt.step()
            except nbdebug.NonFiniteError:
                break
            opt.zero_grad()
    guard.close()
    return guard


def _diagnosed(make: OptOf, tmp: Path, rewind: object = "auto") -> tuple[Any, str]:
    """The loop under the guard until it fails; the diagnosis of its failing step."""
    data = _regression()
    model = _mlp()
    opt = make(model.parameters())
    guard = _guarded(
        model, opt, tmp, lambda s: data[s % 20], 300, F.mse_loss, loss_fn=F.mse_loss, rewind=rewind
    )
    path = str(guard.snapshots[-1])
    return nbdebug.diagnose(path, model=_mlp), path


def _verified(statement: str) -> str:
    """The clause of the advice that names the changes the replays verified."""
    head = "the replays over steps show that "
    if head not in statement:
        return ""
    rest = statement.split(head, 1)[1]
    return rest.split(" the run finite", 1)[0]


def test_a_momentum_of_1_3_is_named_and_its_replay_verified(tmp_path: Path) -> None:
    def sgd(lr: float, m: float) -> OptOf:
        return lambda ps: torch.optim.SGD(ps, lr=lr, momentum=m)

    fail = _first_nonfinite(sgd(0.05, 1.3))
    assert fail is not None
    assert _first_nonfinite(sgd(0.005, 1.3)) is not None  # lr x0.1 only delays it
    assert _first_nonfinite(sgd(0.05, 0.9)) is None  # a momentum below 1 stays finite
    d, path = _diagnosed(sgd(0.05, 1.3), tmp_path)
    assert d.cause.kind == FixKind.DIVERGED
    s = d.cause.statement
    assert "momentum=1.3 is 1 or more" in s
    over = d.over_steps
    hyper, lower = over.replay("hyperparameters"), over.replay("lower_lr")
    assert hyper.change == "SGD momentum 1.3 -> 0.9" and hyper.counts
    # by hand: the window's first state, momentum 0.9, the same batches through the replay
    snap = nbdebug.load_snapshot(path)
    model = _mlp()
    model.load_state_dict(snap.rewind.model_state)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=1.3)
    opt.load_state_dict(snap.rewind.optimizer_state)
    opt.param_groups[0]["momentum"] = 0.9
    data = _regression()
    for step in hyper.steps:  # beyond the failure the window repeats the failing batch
        x, y = data[min(step, fail) % 20]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert math.isfinite(loss.item())
    # the advice claims only the changes whose replays kept the run healthy
    assert "SGD momentum 1.3 -> 0.9" in _verified(s)
    assert lower.ran and not lower.counts and lower.change not in _verified(s)
    assert "lower the learning rate" not in s
    assert "optimizer.param_groups[0]['momentum'] = 0.9" in d.results[0].snippet()


def test_a_huge_adamw_weight_decay_is_named_and_clipping_not_advised(tmp_path: Path) -> None:
    """AdamW(lr=0.1, weight_decay=25): the decay alone multiplies the weights by
    1 - 2.5 = -1.5 a step, after any clipping of the gradient."""

    def adamw(wd: float) -> OptOf:
        return lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=wd)

    fail = _first_nonfinite(adamw(25.0))
    assert fail is not None
    assert _first_nonfinite(adamw(25.0), clip=0.1) == fail  # clipping changes nothing
    assert _first_nonfinite(adamw(0.01)) is None  # lr * weight_decay = 1e-3 stays finite
    d, _ = _diagnosed(adamw(25.0), tmp_path, rewind=64)  # the window from step 0
    s = d.cause.statement
    assert d.cause.kind == FixKind.DIVERGED
    assert "AdamW weight_decay=25 at lr=0.1" in s and "-1.5" in s
    hyper, clip = d.over_steps.replay("hyperparameters"), d.over_steps.replay("clip_grad")
    assert hyper.change == "AdamW weight_decay 25 -> 0.01" and hyper.counts
    assert clip.ran and not clip.counts and clip.change not in _verified(s)
    assert "AdamW weight_decay 25 -> 0.01" in _verified(s)
    assert "clip_grad_norm_" not in d.results[0].snippet()


def test_without_replays_over_steps_the_advice_is_labelled_unverified(tmp_path: Path) -> None:
    sgd: OptOf = lambda ps: torch.optim.SGD(ps, lr=0.02, momentum=1.1)  # noqa: E731
    assert _first_nonfinite(sgd) is not None
    d, _ = _diagnosed(sgd, tmp_path, rewind=False)
    s = d.cause.statement
    assert d.cause.kind == FixKind.DIVERGED and d.over_steps is None
    assert "the replays over steps show" not in s
    assert "no replay over steps verified a change" in s
    assert "unverified, the usual remedies: set momentum=0.9 instead of 1.1" in s
    assert "# unverified" in d.results[0].snippet()


# ------------------------------------------------------------------ 4. the rewrites
class BatchStandardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / x.std(0)


class RowStandardize(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)
        return x


class MySoftplus(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(1 + torch.exp(x))


class Log1pSoftplus(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.exp(x))


def _net(first: nn.Module, width: int = 6) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(first, nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 1))

    return make


def _act_net(act: nn.Module) -> Callable[[], nn.Module]:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 16), act, nn.Linear(16, 1))

    return make


def _fail_and_diagnose(
    make: Callable[[], nn.Module],
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    tmp: Path,
) -> tuple[int, Any]:
    # plain torch first: the step whose loss is not finite
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    fail = None
    for s in range(20):
        x, y = batch(s)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if not math.isfinite(loss.item()):
            fail = s
            break
        opt.step()
    assert fail is not None
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = _guarded(model, opt, tmp, batch, fail + 1, F.mse_loss, loss_fn=F.mse_loss)
    return fail, nbdebug.diagnose(guard.snapshots[-1], model=make)


def _code_line(snippet: str) -> str:
    return next(line for line in snippet.splitlines() if not line.startswith("#"))


def _run_line(line: str, x: torch.Tensor) -> Any:
    """The snippet's line pasted into a forward: ``def f(x): <line>`` (and ``return x``
    after an assignment)."""
    body = line if line.startswith("return ") else f"{line}\n    return x"
    scope: dict[str, Any] = {"torch": torch, "F": F}
    exec(f"def f(x):\n    {body}", scope)
    return scope["f"](x)


def _builtin_row(d: Any) -> Any:
    return next(r for r in d.results if type(r.fix).__name__ == "BuiltinFix")


@pytest.mark.parametrize(
    ("module", "dim"), [(BatchStandardize(), 0), (RowStandardize(), -1)], ids=["dim0", "dim-1"]
)
def test_a_standardisation_snippet_is_the_code_replayed(
    module: nn.Module, dim: int, tmp_path: Path
) -> None:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(16, 6, generator=g)
        if step == 3:  # a constant column (dim 0) or a constant row (dim -1): std 0
            x[(slice(None), 2) if dim == 0 else (2, slice(None))] = 1.0
        return x, x.sum(1, keepdim=True)

    fail, d = _fail_and_diagnose(_net(module), batch, tmp_path)
    assert fail == 3
    row = _builtin_row(d)
    assert row.finite
    line = _code_line(row.snippet())
    # the source line returns (dim 0) or assigns (dim -1): the snippet keeps which
    assert line.startswith("return ") == (dim == 0)
    healthy, _ = batch(0)
    out = _run_line(line, healthy)
    assert isinstance(out, torch.Tensor) and out.shape == healthy.shape
    # standardised over the step's own dimension: mean 0, (biased) variance 1 there
    assert torch.allclose(out.mean(dim), torch.zeros(1), atol=1e-5)
    assert torch.allclose(out.var(dim, unbiased=False), torch.ones(1), atol=1e-3)
    by_hand = module(healthy)  # the hand-written op, up to its unbiased std
    n = healthy.shape[dim]
    assert torch.allclose(out, by_hand * math.sqrt(n / (n - 1)), atol=1e-3)
    if dim == 0:
        assert "layer_norm" not in line and "over dim 0" in row.describe()


@pytest.mark.parametrize("act", [MySoftplus(), Log1pSoftplus()], ids=["log(1+exp)", "log1p"])
def test_a_hand_written_softplus_gets_f_softplus_never_a_softmax_shift(
    act: nn.Module, tmp_path: Path
) -> None:
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(200 + step)
        x = torch.randn(16, 5, generator=g)
        if step == 2:
            x[2] = x[2] * 400.0  # one reading in raw units: exp overflows
        return x, x[:, :1]

    fail, d = _fail_and_diagnose(_act_net(act), batch, tmp_path)
    assert fail == 2
    assert "softmax" not in d.cause.statement
    row = _builtin_row(d)
    assert row.finite and "F.softplus" in row.describe()
    line = _code_line(row.snippet())
    assert line.startswith("return F.softplus(x)")
    # by hand: F.softplus is the same function on healthy values, and finite on the raw row
    z = torch.randn(4, 16)
    assert torch.allclose(_run_line(line, z), torch.log(1 + torch.exp(z)), atol=1e-6)
    assert torch.isfinite(_run_line(line, z * 400.0)).all()
    for r in d.results:  # no row calls a shifted exp a softmax here
        assert "softmax" not in r.describe(), r.describe()


# ------------------------------------------------------------------ 5. a spike snapshot
def _spiking_loop(
    mode: str, tmp: Path | None = None, skip: int | None = None, steps: int = 70
) -> tuple[int | None, list[float], list[str]]:
    """An MLP regression: ``"warmup"`` raises the learning rate every step (0.01 x (1 + t));
    ``"batch"`` feeds step 15 a batch in other units (x30). Under the guard (``tmp``) or
    in plain torch; the first step whose loss is not finite, the losses, the snapshots."""
    data = _regression()
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    grow = (lambda t: 1.0 + t) if mode == "warmup" else (lambda t: 1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, grow)
    guard = None
    if tmp is not None:
        guard = nbdebug.NaNGuard(
            model, opt, directory=tmp, patience=0, loss_fn=F.mse_loss, scheduler=sched
        )
    losses: list[float] = []
    failed = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for s in range(steps):
            x, y = data[s % 20]
            if mode == "batch" and s == 15:
                x, y = x * 30, y * 30
            if s == skip:
                sched.step()
                continue
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            losses.append(loss.item())
            if not math.isfinite(loss.item()):
                failed = s
            if guard is not None:
                try:
                    if guard.check(loss, inputs=x, target=y):
                        opt.step()
                except nbdebug.NonFiniteError:
                    break
            elif failed is not None:
                break
            else:
                opt.step()
            sched.step()
    if guard is not None:
        guard.close()
    paths = [str(p) for p in guard.snapshots] if guard is not None else []
    return failed, losses, paths


def _first_spike(paths: list[str]) -> str:
    return next(p for p in paths if nbdebug.load_snapshot(p).kind == "spike")


def test_a_spike_snapshot_of_a_rising_learning_rate_is_a_spike_not_transient(
    tmp_path: Path,
) -> None:
    failed, losses, _ = _spiking_loop("warmup")
    assert failed is not None
    _, _, paths = _spiking_loop("warmup", tmp_path)
    path = _first_spike(paths)
    snap = nbdebug.load_snapshot(path)
    s = snap.step
    assert s is not None and s < failed
    # plain torch: the spike step is finite, far above the steps before it, and the same
    assert math.isfinite(losses[s]) and losses[s] > 10 * sorted(losses[:s])[s // 2]
    assert losses[s] == pytest.approx(snap.reason["loss"], rel=1e-4)
    d = nbdebug.diagnose(path, model=_mlp, progress=False)
    st = d.cause.statement
    assert d.cause.kind in (FixKind.RERUN, FixKind.DIVERGED) and not d.cause.finite
    assert f"step {s} is a spike, not a failing step" in st
    assert f"{snap.reason['spikes'][0]['z']:.1f} robust sigmas" in st
    assert "not reproducible" not in st and "transient" not in st
    assert d.verdict is not Verdict.TRANSIENT
    over = d.over_steps
    lower = over.replay("lower_lr")
    assert lower.counts and lower.change in st
    # by hand: the window's first state, lr x0.1 of step s-1's, through the replayed steps
    w = snap.rewind
    model = _mlp()
    model.load_state_dict(w.model_state)
    held = 0.1 * 0.01 * (1.0 + (s - 1))
    opt = torch.optim.SGD(model.parameters(), lr=held)
    data = _regression()
    for step in lower.steps:  # beyond the spike the window repeats its batch
        x, y = data[min(step, s) % 20]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert math.isfinite(loss.item()) and loss.item() < losses[s] / 10


def test_a_spike_from_one_batch_in_other_units_points_at_skipping_it(tmp_path: Path) -> None:
    failed, _, _ = _spiking_loop("batch", steps=30)
    assert failed is not None and failed > 15
    # plain torch: the same loop without the batch of step 15 stays finite
    assert _spiking_loop("batch", skip=15, steps=30)[0] is None
    _, _, paths = _spiking_loop("batch", tmp_path, steps=30)
    path = _first_spike(paths)
    assert nbdebug.load_snapshot(path).step == 15
    d = nbdebug.diagnose(path, model=_mlp, progress=False)
    st = d.cause.statement
    assert d.cause.kind in (FixKind.RERUN, FixKind.DIVERGED)
    assert "step 15 is a spike, not a failing step" in st
    assert "skipping the failing batch (step 15) keeps the run finite" in st
    assert d.verdict is not Verdict.TRANSIENT and "transient" not in st
