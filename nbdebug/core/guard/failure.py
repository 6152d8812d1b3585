"""A guarded step that failed: :class:`NonFiniteError`, what the guard raises when it is
told to stop, and :func:`last_error`, the last one raised in this process."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..vocab import FailureKind

__all__ = ["NonFiniteError", "last_error", "record_error", "streak_error"]

_last: NonFiniteError | None = None


class NonFiniteError(RuntimeError):
    """A guarded training step was not finite and the guard was told to stop.

    Attributes
    ----------
    path : pathlib.Path or None
        The snapshot of the first bad step of the current run of bad steps (``None``
        only when ``max_snapshots`` was exhausted).
    step : int
        That step.
    reason : dict
        ``"kind"`` (``"loss"``, ``"grad"``, ``"weights"``, ``"scale"``, ``"rank"``) and
        ``"message"``, with the measured values.
    """

    def __init__(self, message: str, *, path: Path | None, step: int, reason: dict[str, Any]):
        super().__init__(message)
        self.path = path
        self.step = step
        self.reason = reason

    @property
    def kind(self) -> FailureKind:
        """The failure kind of the step (``reason["kind"]``)."""
        return FailureKind(self.reason["kind"])

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (_rebuild_error, (str(self), self.path, self.step, self.reason))


def _rebuild_error(
    message: str, path: Path | None, step: int, reason: dict[str, Any]
) -> NonFiniteError:
    return NonFiniteError(message, path=path, step=step, reason=reason)


def record_error(err: NonFiniteError) -> NonFiniteError:
    """Remember ``err`` as the last error a guard raised (:func:`last_error`)."""
    global _last
    _last = err
    return err


def last_error() -> NonFiniteError | None:
    """The last :class:`NonFiniteError` a guard raised in this process (or, failing
    that, the one IPython stored in ``sys.last_exc`` / ``sys.last_value``)."""
    if _last is not None:
        return _last
    for name in ("last_exc", "last_value"):
        err = getattr(sys, name, None)
        if isinstance(err, NonFiniteError):
            return err
    return None


def streak_error(
    message: str,
    first: tuple[Path | None, int, dict[str, Any]],
    *,
    raised: bool,
    streak: int,
    patience: int | None,
) -> NonFiniteError:
    """The error of a guard told to stop: ``raised`` (``on_nonfinite="raise"``) names this
    step, else the run of ``streak`` bad steps past ``patience`` and its ``first`` (path,
    step, reason)."""
    first_path, first_step, first_reason = first
    saved = (
        f"Snapshot: {first_path}"
        if first_path is not None
        else "No snapshot was written (max_snapshots reached, or the write failed)"
    )
    if raised:
        text = f"{message}. {saved}"
    else:
        text = (
            f"{streak} non-finite steps in a row (patience={patience}); the first, "
            f"step {first_step}: {first_reason['message']}. {saved}"
        )
    return NonFiniteError(text, path=first_path, step=first_step, reason=first_reason)
