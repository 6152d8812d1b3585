"""Whether a compiled model's NaN is the compiler's: :func:`compiler_verdict` replays the
snapshot's step eagerly and compiled (:func:`~nbdebug.analysis.compare.compare_replays`)
and says which of the two makes the NaN or Inf, in one sentence."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ...core.batch import LossFn
from ...core.snapshot import Snapshot, load_snapshot
from ...core.snapshot.load import ModelSource
from ...core.sources import COMPILER_VERDICT, PRECISION_EVIDENCE, provide
from ...core.text import fmt_num
from .config import ReplayConfig
from .record import OpRecord, Recording
from .result import Difference, ReplayComparison

__all__ = ["CompilerVerdict", "compiler_verdict", "precision_evidence", "register"]


@dataclass(frozen=True)
class CompilerVerdict:
    """What :func:`compiler_verdict` found.

    Attributes
    ----------
    compiler : bool or None
        ``True``: the NaN is the compiler's (the eager replay stays finite, the compiled
        one does not); ``False``: it is not (the eager replay makes it too); ``None``:
        undecided (neither replay makes a NaN or Inf here, or one of them raised).
    sentence : str
        The verdict in one sentence (also ``str(verdict)``).
    backend : str
        The ``torch.compile`` back end the compiled replay ran with.
    first : Difference or None
        The first record where the eager and the compiled replays differ (the compiled
        side is compared at module boundaries: a module's output, then the gradients).
    eager_origin : OpRecord or None
        The eager replay's first non-finite value (the op that makes it), if any.
    comparison : ReplayComparison
        The whole comparison.
    """

    compiler: bool | None
    sentence: str
    backend: str
    first: Difference | None
    eager_origin: OpRecord | None
    comparison: ReplayComparison

    def __str__(self) -> str:
        return self.sentence


def compiler_verdict(
    snapshot: Snapshot | str | os.PathLike[str],
    *,
    loss_fn: LossFn | None = None,
    model: ModelSource | None = None,
    rtol: float | None = None,
) -> CompilerVerdict | None:
    """Say whether the NaN of a compiled model's snapshot is the compiler's: its step
    replayed eagerly and under ``torch.compile`` with the recorded back end (the
    snapshot's ``compiled`` field), compared op by op (:func:`compare_replays`).

    Parameters
    ----------
    snapshot : Snapshot or str or PathLike
        The snapshot (a path is loaded with ``model=``).
    loss_fn : callable, optional
        The loss (the snapshot's recorded one by default).
    model : torch.nn.Module or callable, optional
        The architecture, for a path.
    rtol : float, optional
        As for :func:`compare_replays`.

    Returns
    -------
    CompilerVerdict or None
        ``None`` for a snapshot of a model that ran eagerly (no ``compiled`` field).

    Raises
    ------
    ValueError
        The compiled replay cannot run here (the back end is not installed, no C++
        compiler for inductor on CPU), named before any replay.
    SnapshotError
        The snapshot cannot be loaded or replayed (no model, no loss function).

    Examples
    --------
    >>> v = nbdebug.analysis.compare.compiler_verdict(snap)
    >>> v.compiler, v.sentence
    (True, "The NaN is the compiler's: ...")
    """
    from . import compare_replays  # the package's entry point, defined in its __init__

    snap = snapshot if isinstance(snapshot, Snapshot) else load_snapshot(snapshot, model=model)
    settings = snap.compiled
    if settings is None:
        return None
    backend = str(settings.get("backend") or "inductor")
    compiled = ReplayConfig(compile=True, backend=backend, name=f"compiled ({backend})")
    r = compare_replays(snap, a="eager", b=compiled, loss_fn=loss_fn, rtol=rtol)
    eager_bad, compiled_bad = (_first_nonfinite(rec) for rec in r.recordings)
    compiler: bool | None = None
    at = f"step {snap.step}" if snap.step is not None else "the step"
    if r.errors:
        sentence = f"Cannot tell whether the NaN is the compiler's: {r.summary()}"
    elif eager_bad is not None:
        compiler = False
        also = "too" if compiled_bad is not None else "alone (the compiled one stays finite)"
        sentence = (
            f"The {_kind(eager_bad)} is not the compiler's: the eager replay of {at} makes it "
            f"{also}, first at {_where(eager_bad)}."
        )
    elif compiled_bad is not None:
        compiler = True
        d = r.first
        first = (
            f"the first difference is {d.where()}: {fmt_num(d.a)} eager vs {fmt_num(d.b)} compiled"
            if d is not None
            else f"its first non-finite value is at {_where(compiled_bad)}"
        )
        sentence = (
            f"The {_kind(compiled_bad)} is the compiler's: the eager replay of {at} stays "
            f"finite and the torch.compile ({backend}) replay does not; {first}."
        )
    else:
        sentence = (
            f"Cannot tell whether the NaN is the compiler's: neither the eager nor the "
            f"torch.compile ({backend}) replay of {at} makes a NaN or Inf here."
        )
    return CompilerVerdict(compiler, sentence, backend, r.first, eager_bad, r)


def _first_nonfinite(recording: Recording) -> OpRecord | None:
    """The first record of ``recording`` holding a NaN or Inf."""
    return next((r for r in recording.records if not bool(torch.isfinite(r.value).all())), None)


def _kind(record: OpRecord) -> str:
    return "NaN" if bool(torch.isnan(record.value).any()) else "Inf"


def _where(record: OpRecord) -> str:
    """``torch.log in 'head' at model.py:12 (forward)``."""
    module = repr(record.module) if record.module else "the model"
    at = f" at {record.source}" if record.source else ""
    what = f"the {record.op} of {module}" if record.op == "output" else f"{record.op} in {module}"
    return f"{what}{at} ({record.phase})"


def precision_evidence(
    source: object, inputs: object = None, target: object = None, *, loss_fn: LossFn | None = None
) -> str:
    """The step as it ran against the step in float64, op by op (:func:`compare_replays`
    with ``a="eager"``, ``b="float64"``), in one sentence: the first op whose output
    differs beyond what the dtype explains, with both values (the evidence that a NaN or
    Inf is a precision problem), or that they agree."""
    from . import compare_replays  # the package's entry point, defined in its __init__

    return compare_replays(
        source, inputs, target, a="eager", b="float64", loss_fn=loss_fn
    ).summary()


def register() -> None:
    """Provide :func:`compiler_verdict` and :func:`precision_evidence` to the layers that
    read them lazily (``diagnose``, through :mod:`nbdebug.core.sources`)."""
    provide(COMPILER_VERDICT, compiler_verdict)
    provide(PRECISION_EVIDENCE, precision_evidence)
