"""The two other forms of a guarded step: ``with guard.step(x, y) as s:`` (a
:class:`GuardedStep`) and ``@guard.wrap`` (:func:`wrap_step`). Both end in the guard's
``check()``; the guard steps the optimizer (through the scaler when there is one) when the
step is finite, then zeroes the gradients."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ..snapshot.write import Scaler
    from .reading import Loss

__all__ = ["GuardedStep", "StepOwner", "guarded_step", "wrap_step"]


class StepOwner(Protocol):
    """What a guarded step needs of its guard."""

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    @property
    def scaler(self) -> Scaler | None: ...

    #: the last step's outcome (an update watch sets it False when it rolls one back)
    ok: bool | None

    def check(
        self, loss: Loss, *, inputs: Any = None, target: Any = None, step: int | None = None
    ) -> bool: ...

    def mark_step_start(self) -> None: ...

    def scaler_unscaled(self) -> bool: ...


class GuardedStep:
    """What ``with guard.step(...) as s:`` yields: set ``s.loss`` in the block; after the
    block ``s.ok`` tells whether the step was finite (and the optimizer stepped)."""

    def __init__(self, guard: StepOwner, inputs: Any, target: Any, step: int | None):
        self.guard = guard
        self.inputs = inputs
        self.target = target
        self.step = step
        self.loss: Any = None
        self.ok: bool | None = None

    def __repr__(self) -> str:
        return f"GuardedStep(step={self.step}, ok={self.ok})"


@contextmanager
def guarded_step(
    guard: StepOwner, inputs: Any = None, target: Any = None, step: int | None = None
) -> Iterator[GuardedStep]:
    """See :meth:`NaNGuard.step`."""
    s = GuardedStep(guard, inputs, target, step)
    guard.mark_step_start()
    yield s
    _finish(guard, s)


def _finish(guard: StepOwner, s: GuardedStep) -> None:
    loss = s.loss
    if isinstance(loss, (tuple, list)) and loss:
        loss = loss[0]
    if loss is None:
        raise ValueError(
            "set s.loss inside the guarded step (with guard.step(...) as s: s.loss = ...)."
        )
    opt, scaler = guard.optimizer, guard.scaler
    try:
        s.ok = guard.check(loss, inputs=s.inputs, target=s.target, step=s.step)
        if opt is not None and scaler is not None:
            if s.ok:
                scaler.step(opt)  # type: ignore[attr-defined]
            if s.ok or guard.scaler_unscaled():
                # after unscale_() in the block the scaler expects its update(), also on
                # a step the guard skipped (the next unscale_() raises otherwise)
                scaler.update()  # type: ignore[attr-defined]
        elif s.ok and opt is not None:
            opt.step()
        if s.ok:
            s.ok = guard.ok  # the update watch rolled a non-finite update back
    finally:
        if opt is not None:
            opt.zero_grad(set_to_none=True)


def wrap_step(
    guard: StepOwner,
    fn: Callable[..., Any] | None,
    inputs: int | str,
    target: int | str | None,
) -> Any:
    """See :meth:`NaNGuard.wrap`."""

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(f)
        params = list(sig.parameters)

        def pick(bound: inspect.BoundArguments, which: int | str | None) -> Any:
            if which is None:
                return None
            name = params[which] if isinstance(which, int) and which < len(params) else which
            return bound.arguments.get(name) if isinstance(name, str) else None

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs)
            with guarded_step(guard, pick(bound, inputs), pick(bound, target)) as s:
                out = f(*args, **kwargs)
                s.loss = out
            return out

        return wrapper

    return deco(fn) if fn is not None else deco
