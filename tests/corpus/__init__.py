"""A corpus of failing training loops for ``nbdebug.diagnose`` (issue 31, item 7).

Each :class:`Scenario` is a small model trained with a real optimizer under a
:class:`nbdebug.NaNGuard` until it goes non-finite by itself (seeded, CPU), drawn from a
public bug report or forum thread (``source``), with the right fix ``kind`` named and the
same loop with that fix applied by hand in plain torch (``loop(True)``), which stays
finite. Categories: data, numerics, optimisation, precision, state, transient.

``window=True`` marks the runs that diverge through their updates: their right fix
(``lower_lr`` / ``clip_grad``) can only be shown by replays over several steps (the guard's
rewind window); a diagnosis of the single failing step names it through the ``diverged``
cause, whose sentence says to lower the learning rate or clip the gradient norm.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nbdebug

Batch = tuple[Any, Any]

CATEGORIES = ("data", "numerics", "optimisation", "precision", "state", "transient")


@dataclass
class Loop:
    """One training loop: what :func:`run` trains."""

    model: Callable[[], nn.Module]
    batch: Callable[[int], Batch]
    loss_fn: Callable[..., torch.Tensor]
    opt: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    steps: int = 40
    schedule: Callable[[int], float] | None = None  # a LambdaLR factor
    clip: float | None = None
    #: after the backward, before the guard's check (a prefetch into the batch's buffer)
    after_backward: Callable[[int, Batch], None] | None = None
    #: before the first step: the model as the run starts it (a checkpoint reloaded)
    start: Callable[[nn.Module], None] | None = None


@dataclass(frozen=True)
class Scenario:
    name: str
    category: str
    kind: str  # the right fix's kind
    source: str  # the public report it is drawn from
    loop: Callable[[bool], Loop]  # loop(fixed): the failing loop, or the one fixed by hand
    window: bool = False  # needs replays over steps (the rewind window) to show its fix


def sgd(lr: float = 0.05, momentum: float = 0.9) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda m: torch.optim.SGD(m.parameters(), lr=lr, momentum=momentum)


def adam(lr: float = 1e-3, **kw: Any) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda m: torch.optim.Adam(m.parameters(), lr=lr, **kw)


def gen(step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * salt + step)


def _call(model: nn.Module, x: Any) -> Any:
    return model(*x) if isinstance(x, tuple) else model(x)


def _finite_params(model: nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


@dataclass
class Outcome:
    failed: int | None  # the step that failed (None: the run stayed finite)
    snapshot: Path | None
    losses: list[float]


def run(loop: Loop, directory: Path | None = None) -> Outcome:
    """Train ``loop``; with ``directory`` under a guard writing its snapshot there (the
    run stops at the first step it reports), without it checking loss, gradients and
    weights by hand."""
    torch.manual_seed(0)
    model = loop.model()
    if loop.start is not None:
        loop.start(model)
    opt = (loop.opt or sgd())(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, loop.schedule) if loop.schedule else None
    guard = None
    if directory is not None:
        guard = nbdebug.NaNGuard(
            model,
            opt,
            directory=directory,
            loss_fn=loop.loss_fn,
            scheduler=sched,
            param_norm_every=1,
        )
    losses: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # spike warnings on the way up
        for step in range(loop.steps):
            x, y = loop.batch(step)
            loss = loop.loss_fn(_call(model, x), y)
            loss.backward()
            if loop.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), loop.clip)
            if loop.after_backward is not None:
                loop.after_backward(step, (x, y))
            if guard is not None:
                if not guard.check(loss, inputs=x, target=y, step=step):
                    return Outcome(step, Path(guard.snapshots[-1]), losses)
            elif not math.isfinite(float(loss)) or not all(
                p.grad is None or bool(torch.isfinite(p.grad).all()) for p in model.parameters()
            ):
                return Outcome(step, None, losses)
            losses.append(float(loss))
            try:
                opt.step()
            except nbdebug.NonFiniteError:  # the guard's check of the update itself
                assert guard is not None
                return Outcome(step, Path(guard.snapshots[-1]), losses)
            if sched is not None:
                sched.step()
            opt.zero_grad()
            if guard is None and not _finite_params(model):
                return Outcome(step, None, losses)
    return Outcome(None, None, losses)


def scenarios() -> list[Scenario]:
    """Every scenario of the corpus, by category."""
    from . import data, numerics, optimisation, precision, state, transient

    return [
        *data.SCENARIOS,
        *numerics.SCENARIOS,
        *precision.SCENARIOS,
        *state.SCENARIOS,
        *optimisation.SCENARIOS,
        *transient.SCENARIOS,
    ]


def right(s: Scenario, kind: str) -> bool:
    """Whether a row of ``kind`` names the scenario's right fix (for a scenario that needs
    the window, the ``diverged`` cause names it: lower the learning rate or clip)."""
    return kind == s.kind or (s.window and kind == "diverged")
