"""The pseudo-causes: rows of a diagnosis that change nothing in the step.
``weights_corrupted`` (the weights were non-finite before the step: no change to it can
repair it) and ``not_reproducible`` (a plain re-run of the same step)."""

from __future__ import annotations

from ...core.vocab import FixKind
from .fix import Fix

__all__ = ["NotReproducible", "WeightsCorrupted"]


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
