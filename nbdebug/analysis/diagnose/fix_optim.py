"""The optimisation fixes: ``clip_grad`` (clip the gradient norm), ``lower_lr`` (a lower
learning rate for the update) and ``scaler`` (a GradScaler with a lower scale)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from ...core.stats import is_finite_number
from ...core.vocab import FixKind
from .fix import Fix, Replay

__all__ = ["ClipGradFix", "LowerLRFix", "ScalerFix"]


class ClipGradFix(Fix):
    """Clip the total gradient norm before the update.

    Parameters
    ----------
    max_norm : float
        The norm to clip to (positive, finite).
    why : str
        Where ``max_norm`` comes from, for the text.

    Examples
    --------
    >>> nbdebug.diagnose(model, x, y, loss_fn, optimizer=opt, fixes=[nbdebug.ClipGradFix(1.0)])
    """

    kind = FixKind.CLIP_GRAD

    def __init__(self, max_norm: float, *, why: str = "the recent gradient norm"):
        super().__init__()
        if not (is_finite_number(max_norm) and max_norm > 0):
            raise ValueError(f"max_norm must be a positive finite number; got {max_norm!r}.")
        self.max_norm = float(max_norm)
        self.why = why

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        if replay.optimizer is None:
            raise ValueError("no optimizer to step: gradient clipping changes nothing here.")
        old = replay.clip_norm
        replay.clip_norm = self.max_norm
        try:
            yield
        finally:
            replay.clip_norm = old

    def _what(self) -> str:
        return f"the gradient norm to {self.max_norm:.4g} ({self.why})"

    def describe(self) -> str:
        return f"clip {self._what()}"

    def action(self) -> str:
        return f"clipping {self._what()}"

    def snippet(self) -> str:
        return (
            "loss.backward()\n"
            f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={self.max_norm:.4g})\n"
            "optimizer.step()"
        )


class LowerLRFix(Fix):
    """The learning rate of every parameter group times ``factor`` for the update.

    Parameters
    ----------
    factor : float
        The multiplier (``0.1``: ten times lower).
    lr : float, optional
        The step's learning rate, for the text.

    Examples
    --------
    >>> nbdebug.diagnose(model, x, y, loss_fn, optimizer=opt, fixes=[nbdebug.LowerLRFix(0.01)])
    """

    kind = FixKind.LOWER_LR

    def __init__(self, factor: float = 0.1, *, lr: float | None = None):
        super().__init__()
        self.factor = float(factor)
        self.lr = lr

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        if replay.optimizer is None:
            raise ValueError("no optimizer to step: the learning rate changes nothing here.")
        old = replay.lr_factor
        replay.lr_factor = old * self.factor
        try:
            yield
        finally:
            replay.lr_factor = old

    def describe(self) -> str:
        lr = f" ({self.lr:.3g} -> {self.lr * self.factor:.3g})" if self.lr else ""
        return f"learning rate x{self.factor:g} for the update{lr}"

    def action(self) -> str:
        return f"a {self.describe()}"

    def snippet(self) -> str:
        return (
            "for g in optimizer.param_groups:\n"
            f"    g['lr'] *= {self.factor:g}  # or a warm-up / a lower peak in the scheduler"
        )


class ScalerFix(Fix):
    """A GradScaler whose scale is lowered to ``scale`` for the step.

    Parameters
    ----------
    scale : float
        The scale the step's GradScaler is set to.

    Examples
    --------
    >>> nbdebug.diagnose(snap, fixes=[nbdebug.ScalerFix(256.0)])
    """

    kind = FixKind.SCALER

    def __init__(self, scale: float):
        super().__init__()
        self.scale = float(scale)

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        s = replay.scaler
        if s is None:
            raise ValueError("the step has no GradScaler: there is no scale to lower.")
        old = s.state_dict()
        s.load_state_dict({**old, "scale": self.scale})
        try:
            yield
        finally:
            s.load_state_dict(old)

    def describe(self) -> str:
        return f"GradScaler with a lower scale ({self.scale:.4g})"

    def snippet(self) -> str:
        return (
            f"scaler = torch.amp.GradScaler(init_scale={self.scale:.4g}, growth_interval=2000)"
            "  # or keep the overflowing op in float32"
        )
