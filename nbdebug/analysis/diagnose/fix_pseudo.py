"""The pseudo-causes: rows of a diagnosis that change nothing in the step.
``weights_corrupted`` (the weights were non-finite before the step: no change to it can
repair it), ``not_reproducible`` (a plain re-run of the same step) and the recorded
update (:class:`UpdateRecorded`: the guard saw the optimizer step make the weights
non-finite and did not roll it back, so the snapshot holds the weights after it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...core.vocab import FixKind, UpdateFault
from .fix import Fix
from .fix_optstate import valid_eps

__all__ = ["NotReproducible", "UpdateRecorded", "WeightsCorrupted"]

#: The fix kind that answers each fault of a recorded update (its cause's kind).
_FAULT_FIX: dict[UpdateFault, FixKind] = {
    UpdateFault.EPS_BELOW_NORMAL: FixKind.OPTIMIZER_EPS,
    UpdateFault.ZERO_OVER_ZERO: FixKind.OPTIMIZER_EPS,
    UpdateFault.LR_OVERFLOW: FixKind.LOWER_LR,
    UpdateFault.STATE_NONFINITE: FixKind.RESET_STATE,
    UpdateFault.STATE_OVERFLOW: FixKind.STATE_FLOAT32,
}


def _owner(qual: str) -> str:
    return qual.rsplit(".", 1)[0] if "." in qual else ""


class WeightsCorrupted(Fix):
    """A finding rather than a fix: the weights were already non-finite when the step
    started, so no change to this step can repair it. The replay runs the step as is.

    Parameters
    ----------
    params : list of str
        The parameters and buffers that hold NaN/Inf.
    earlier : str
        Which earlier step to look at, in words.
    directory : str or None
        The guard's snapshot directory (that of the snapshot diagnosed).
    snapshot : str or None
        The latest snapshot file in it before this step, where one exists.
    """

    kind = FixKind.WEIGHTS_CORRUPTED

    def __init__(
        self,
        params: list[str],
        *,
        earlier: str = "",
        directory: str | None = None,
        snapshot: str | None = None,
    ):
        super().__init__()
        self.params = list(params)
        self.module = _owner(self.params[0]) if self.params else None
        self.earlier = earlier
        self.directory = directory
        self.snapshot = snapshot

    def finding(self) -> str:
        """What was found: ``"fc.weight, 1.running_var already held NaN/Inf before this
        step"`` (the first four names)."""
        names = ", ".join(self.params[:4]) + (" ..." if len(self.params) > 4 else "")
        return f"{names} already held NaN/Inf before this step"

    def describe(self) -> str:
        return f"none possible: {self.finding()}"

    def snippet(self) -> str:
        look = f"  # {self.earlier}" if self.earlier else ""
        if self.snapshot is not None:
            first = (
                f"earlier = nbdebug.load_snapshot({self.snapshot!r})  # the latest before{look}\n"
            )
        elif self.directory is not None:
            first = f"# no earlier snapshot in {self.directory!r}{look}\n"
        else:
            first = f"# {self.earlier}\n" if self.earlier else ""
        where = f", directory={self.directory!r}" if self.directory is not None else ""
        return f"{first}guard = nbdebug.NaNGuard(model, optimizer{where}, param_norm_every=1)"


class NotReproducible(Fix):
    """A plain, bit-identical re-run of the step (same weights, batch, RNG): when it is
    finite, the recorded failure is not reproducible (non-determinism, a stateful module,
    or hardware); when it is not, its kind is ``rerun`` (:meth:`reproduced`): the
    failure reproduces, and the row only holds the plain replay's numbers."""

    kind = FixKind.NOT_REPRODUCIBLE
    #: the run recorded a NaN loss that the stored batch does not reproduce: the data the
    #: step saw was not the data stored (set by the diagnosis)
    pipeline: bool = False

    def reproduced(self) -> None:
        """The plain replay was non-finite: the row is the ``rerun``, not a cause."""
        self.kind = FixKind.RERUN

    def describe(self) -> str:
        return "nothing: the same step replayed as it was"

    def snippet(self) -> str:
        if self.kind == FixKind.RERUN:
            return ""
        if self.pipeline:
            return (
                "# the step saw other data than the batch stored: check the input pipeline\n"
                "# (DataLoader workers, buffers reused before the step finished, in-place "
                "transforms)\nx, y = x.clone(), y.clone()  # before model(x): then the "
                "guard stores what the step saw"
            )
        return (
            "torch.use_deterministic_algorithms(True)  # then re-run; check modules that keep "
            "state between calls, and the hardware"
        )


def _number(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


class UpdateRecorded(Fix):
    """A finding rather than a fix: the guard saw this step's optimizer update make a
    weight (or its state) non-finite and did not roll it back (``check_update=True``), so
    the snapshot holds the weights after that update and no replay of the step can show a
    fix working. The weights were finite before it (the guard watched every update). Its
    ``kind`` is the fix kind that answers the recorded fault (``optimizer_eps`` for an eps
    below the smallest normal, ``lower_lr`` for an overflowing step size, ...); the replay
    runs the step as it is.

    Parameters
    ----------
    reason : mapping
        The snapshot's reason (kind ``"optimizer"``): ``message``, ``param``, ``state``,
        ``fault``, ``eps``, ``lr``, ``dtype``, ``optimizer``.
    """

    def __init__(self, reason: Mapping[str, Any]):
        super().__init__()
        self.message = str(reason.get("message", "the optimizer step made a weight non-finite"))
        self.param = str(reason.get("param", ""))
        self.state = reason.get("state")
        try:
            self.fault: UpdateFault | None = UpdateFault(reason.get("fault"))
        except ValueError:
            self.fault = None
        kind = _FAULT_FIX.get(self.fault) if self.fault is not None else None
        self.kind = kind or FixKind.OPTIMIZER_EPS
        self.eps = _number(reason.get("eps"))
        self.lr = _number(reason.get("lr"))
        self.dtype = str(reason.get("dtype", "float32"))
        self.optimizer = str(reason.get("optimizer", "optimizer"))
        self.module = _owner(self.param)
        self.op = f"{self.optimizer}.step"

    def remedy(self) -> str:
        """The change the recorded fault calls for, in words (not replayed)."""
        f = self.fault
        if f == UpdateFault.EPS_BELOW_NORMAL and self.eps is not None:
            dt = getattr(torch, self.dtype, torch.float32)
            return f"an eps of at least {valid_eps(dt):g} instead of {self.eps:g}"
        if f == UpdateFault.LR_OVERFLOW:
            lr = f" ({self.lr:.3g})" if self.lr is not None else ""
            return f"a learning rate{lr} small enough that lr x update stays in {self.dtype}"
        if f == UpdateFault.STATE_NONFINITE:
            return f"the optimizer state of {self.param} reset or reloaded from a checkpoint"
        if f == UpdateFault.STATE_OVERFLOW:
            return "the optimizer state in float32 (float32 master weights)"
        return "an optimizer eps that keeps the update's denominator away from 0"

    def describe(self) -> str:
        return (
            f"not replayed: the snapshot holds the weights after the {self.optimizer} update "
            f"that made {self.param} non-finite; {self.remedy()}"
        )

    def action(self) -> str:
        return self.remedy()

    def snippet(self) -> str:
        first = ""
        if self.fault == UpdateFault.EPS_BELOW_NORMAL and self.eps is not None:
            new = valid_eps(getattr(torch, self.dtype, torch.float32))
            first = (
                f"optimizer = torch.optim.{self.optimizer}(model.parameters(), lr=lr, "
                f"eps={new:g})  # was eps={self.eps:g}\n"
            )
        return (
            f"{first}guard = nbdebug.NaNGuard(model, optimizer, check_update='rollback')"
            "  # keeps the weights before a bad update: diagnose then replays the fixes"
        )
