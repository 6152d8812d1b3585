"""Failing training steps with a known right fix, for ``nbdebug.diagnose`` (tests and
``benchmarks/bench_diagnose.py``).

Each scenario trains a small model under a :class:`nbdebug.NaNGuard` for a few healthy
steps (so the snapshot carries a history), then feeds the step that fails; the guard writes
the snapshot. ``build(tmp)`` returns the arguments of ``diagnose`` and the objects the
test checks are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import nbdebug


@dataclass
class Case:
    name: str
    kind: str  # the right cause
    module: str | type | None = ...  # type: ignore[assignment]
    rows: list[int] | None = None
    build: Callable[[Path], dict[str, Any]] = field(default=lambda tmp: {})
    plain_step: Callable[[], None] | None = None


# ---------------------------------------------------------------------- models
class Normalize(nn.Module):
    """Per-row standardisation without an epsilon."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu = x.mean(dim=1, keepdim=True)
        sd = x.std(dim=1, keepdim=True)
        return (x - mu) / sd


class NormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = Normalize()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x))


class Block(nn.Module):
    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d)
        self.ln = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc(x))


class HalfNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = Block(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.enc(x)))


class HandSoftmax(nn.Module):
    """A softmax written by hand: exp overflows for large logits."""

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        e = torch.exp(z)
        return e / e.sum(dim=-1, keepdim=True)


class SoftmaxNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.softmax = HandSoftmax()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.softmax(self.fc(x))


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.d = d

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(self.d)
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
        return torch.softmax(scores, dim=-1) @ v


class AttnNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = Attention(8)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x, mask).mean(dim=1))


class ProbNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(x), dim=-1)


def nll_of_probs(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The negative log-likelihood written by hand on probabilities."""
    onehot = F.one_hot(y, p.shape[-1]).to(p.dtype)
    return -(torch.log(p) * onehot).sum(dim=-1).mean()


def mse_onehot(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (p - F.one_hot(y, p.shape[-1]).to(p.dtype)).pow(2).mean()


FLAKY = {"left": 0}  # a fault outside the model: NaN on the next `left` calls


class Flaky(nn.Module):
    """Injects NaN into its output while FLAKY["left"] > 0 (a transient fault)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if FLAKY["left"] > 0:
            FLAKY["left"] -= 1
            return x * float("nan")
        return x


class FlakyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)
        self.flaky = Flaky()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.flaky(self.fc(x))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


# ---------------------------------------------------------------------- training
def _train(
    model: nn.Module,
    tmp: Path,
    batches: list[tuple[Any, Any]],
    loss_fn: Callable[..., torch.Tensor],
    *,
    lr: float = 0.05,
    bad_lr: float | None = None,
) -> tuple[Path, torch.optim.Optimizer]:
    """Train under a guard; the last batch is the failing step. Returns the snapshot."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    guard = nbdebug.NaNGuard(
        model, opt, directory=tmp, patience=None, on_nonfinite="skip", param_norm_every=1
    )
    for step, (x, y) in enumerate(batches):
        if bad_lr is not None and step == len(batches) - 2:
            for g in opt.param_groups:
                g["lr"] = bad_lr
        out = model(*x) if isinstance(x, tuple) else model(x)
        loss = loss_fn(out, y)
        loss.backward()
        if guard.check(loss, inputs=x, target=y, step=step):
            opt.step()
        opt.zero_grad()
    assert guard.snapshots, "the scenario's last step did not fail"
    return guard.snapshots[0], opt


def _batches(n: int, make: Callable[[int], tuple[Any, Any]], bad: tuple[Any, Any]) -> list[Any]:
    return [make(i) for i in range(n)] + [bad]


def _xy(bs: int = 8, d: int = 8, classes: int = 3) -> Callable[[int], tuple[Any, Any]]:
    def make(i: int) -> tuple[Any, Any]:
        g = torch.Generator().manual_seed(100 + i)
        return torch.randn(bs, d, generator=g), torch.randint(0, classes, (bs,), generator=g)

    return make


def _snapshot_case(
    factory: Callable[[], nn.Module],
    bad: tuple[Any, Any],
    loss_fn: Callable[..., torch.Tensor],
    make: Callable[[int], tuple[Any, Any]] | None = None,
    *,
    prepare: Callable[[nn.Module], None] | None = None,
    before_bad: Callable[[], None] | None = None,
    **train: Any,
) -> Callable[[Path], dict[str, Any]]:
    def build(tmp: Path) -> dict[str, Any]:
        torch.manual_seed(0)
        model = factory()
        if prepare is not None:
            prepare(model)
        batches = _batches(6, make or _xy(), bad)
        if before_bad is not None:
            path, opt = _train_with_hook(model, tmp, batches, loss_fn, before_bad, **train)
        else:
            path, opt = _train(model, tmp, batches, loss_fn, **train)

        def arch() -> nn.Module:
            m = factory()
            if prepare is not None:
                prepare(m)
            return m

        return {
            "source": path,
            "model": arch,
            "loss_fn": loss_fn,
            "user_model": model,
            "user_optimizer": opt,
        }

    return build


def _train_with_hook(
    model: nn.Module,
    tmp: Path,
    batches: list[Any],
    loss_fn: Any,
    before_bad: Callable[[], None],
    **train: Any,
) -> tuple[Path, torch.optim.Optimizer]:
    healthy, bad = batches[:-1], batches[-1]
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    guard = nbdebug.NaNGuard(
        model, opt, directory=tmp, patience=None, on_nonfinite="skip", param_norm_every=1
    )
    for step, (x, y) in enumerate([*healthy, bad]):
        if step == len(healthy):
            before_bad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if guard.check(loss, inputs=x, target=y, step=step):
            opt.step()
        opt.zero_grad()
    assert guard.snapshots, "the scenario's last step did not fail"
    return guard.snapshots[0], opt


# ---------------------------------------------------------------------- the cases
def constant_row() -> tuple[Any, Any]:
    x, y = _xy()(99)
    x[3] = 0.7
    return x, y


def _half_overflow(model: nn.Module) -> None:
    with torch.no_grad():
        model.enc.fc.weight.mul_(100.0)  # type: ignore[union-attr, operator]
    model.half()


def _half_xy(i: int) -> tuple[Any, Any]:
    x, y = _xy()(i)
    return x.half(), y


def _half_bad() -> tuple[Any, Any]:
    x, y = _xy()(98)
    return (x * 2000.0).half(), y  # every row overflows float16 in enc.fc


def _half_ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.float(), y)


def _big_logits() -> tuple[Any, Any]:
    x, y = _xy()(97)
    x[1] = x[1] * -400.0  # logits far above 88: exp overflows float32
    x[5] = x[5] * -400.0
    return x, y


def _attn_make(i: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(300 + i)
    x = torch.randn(4, 5, 8, generator=g)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[:, 4] = False
    return (x, mask), torch.randint(0, 2, (4,), generator=g)


def _attn_bad() -> tuple[Any, Any]:
    (x, mask), y = _attn_make(96)
    mask[2] = False  # an all-padding sequence
    return (x, mask), y


def _zero_prob() -> tuple[Any, Any]:
    x, y = _xy()(95)
    x[4] = x[4] * 500.0  # a saturated softmax: some probabilities are exactly 0
    return x, y


def _flaky_bad() -> tuple[Any, Any]:
    return _xy()(94)


def _arm_flaky() -> None:
    FLAKY["left"] = 1


def _regression(i: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(200 + i)
    return torch.randn(8, 8, generator=g), 50.0 * torch.randn(8, 3, generator=g)


def _overflowing_lr(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """A learning rate (below float32's maximum) whose update overflows float32, while
    a tenth of it does not."""
    grads = torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters()))
    gmax = max(float(g.abs().max()) for g in grads)
    lr = 1e39 / gmax
    assert lr < 3e38, "the scenario needs larger gradients"
    return lr


def _lr_case(tmp: Path) -> dict[str, Any]:
    """Live: a model, a batch, an optimizer whose learning rate is far too high (the
    update overflows float32), and the guard's healthy history."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    guard = nbdebug.NaNGuard(model, opt, directory=tmp, param_norm_every=1)
    for step in range(6):
        x, y = _regression(step)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if guard.check(loss, inputs=x, target=y, step=step):
            opt.step()
        opt.zero_grad()
    x, y = _regression(50)
    lr = _overflowing_lr(model, x, y)
    for g in opt.param_groups:
        g["lr"] = lr
    return {
        "source": model,
        "inputs": x,
        "target": y,
        "loss_fn": F.mse_loss,
        "optimizer": opt,
        "history": guard,
        "user_model": model,
        "user_optimizer": opt,
    }


def _corrupted_case(tmp: Path) -> dict[str, Any]:
    """The update of step 5 (learning rate far too high) makes the weights Inf; the guard,
    which does not watch the updates here (``check_update=False``), sees it at step 6 and
    writes the snapshot."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    guard = nbdebug.NaNGuard(
        model,
        opt,
        directory=tmp,
        patience=None,
        on_nonfinite="skip",
        param_norm_every=1,
        check_update=False,
    )
    for step in range(8):
        x, y = _regression(step)
        if step == 5:
            lr = _overflowing_lr(model, x, y)
            for g in opt.param_groups:
                g["lr"] = lr
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if guard.check(loss, inputs=x, target=y, step=step):
            opt.step()
        opt.zero_grad()
        if guard.snapshots:
            break
    assert guard.snapshots
    return {
        "source": guard.snapshots[0],
        "model": MLP,
        "loss_fn": F.mse_loss,
        "user_model": model,
        "user_optimizer": opt,
        "earlier_step": 5,
    }


CASES = [
    Case(
        "constant row, normalisation without epsilon",
        "epsilon",
        "norm",
        [3],
        _snapshot_case(NormNet, constant_row(), F.cross_entropy),
    ),
    Case(
        "float16 overflow in one Linear",
        "float32",
        "enc",
        None,
        _snapshot_case(HalfNet, _half_bad(), _half_ce, _half_xy, prepare=_half_overflow, lr=0.01),
    ),
    Case(
        "exp overflow in a hand-written softmax",
        "epsilon",
        "softmax",
        [1, 5],
        _snapshot_case(SoftmaxNet, _big_logits(), mse_onehot),
    ),
    Case(
        "fully masked attention row",
        "epsilon",
        "attn",
        [2],
        _snapshot_case(AttnNet, _attn_bad(), F.cross_entropy, _attn_make),
    ),
    Case(
        "log of a zero probability",
        "epsilon",
        None,
        [4],
        _snapshot_case(ProbNet, _zero_prob(), nll_of_probs),
    ),
    Case("learning rate far too high", "lower_lr", None, None, _lr_case),
    Case("corrupted weights from an earlier step", "weights_corrupted", ..., None, _corrupted_case),
    Case(
        "non-reproducible NaN (a module that injects NaN once)",
        "not_reproducible",
        ...,
        None,
        _snapshot_case(FlakyNet, _flaky_bad(), F.cross_entropy, before_bad=_arm_flaky),
    ),
]
