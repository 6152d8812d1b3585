"""What the replay comparison adds to :func:`nbdebug.diagnose` (provided lazily through
:mod:`nbdebug.core.sources`: features do not import each other), each as one sentence of the
diagnosis' notes: whether a compiled model's NaN is the compiler's (its snapshot's step
replayed eagerly and under ``torch.compile``), and the evidence of a ``float32`` fix (the
step as it ran against float64, op by op)."""

from __future__ import annotations

from collections.abc import Sequence

from ...core.snapshot import SnapshotError
from ...core.snapshot.resolve import ResolvedStep
from ...core.sources import COMPILER_VERDICT, PRECISION_EVIDENCE, provider
from ...core.trace import Trace
from ...core.vocab import FixKind
from .result import FixResult

__all__ = ["compiler_note", "precision_note"]

#: the dtypes whose overflow or underflow a float32 fix answers
_HALF = ("float16", "bfloat16")


def compiler_note(src: ResolvedStep) -> str | None:
    """The verdict's sentence for a snapshot of a ``torch.compile``'d model (its
    ``compiled`` field); ``None`` for any other source. A compiled replay that cannot run
    here (no back end, no C++ compiler) is said in the sentence, never raised."""
    snap = src.snapshot
    if snap is None or snap.compiled is None:
        return None
    verdict = provider(COMPILER_VERDICT)
    if verdict is None:
        return None
    try:
        found = verdict(snap, loss_fn=src.loss_fn)
    except (ValueError, RuntimeError, SnapshotError) as e:
        return f"whether the NaN is the compiler's could not be checked here: {e}"
    return None if found is None else str(found)


def precision_note(src: ResolvedStep, tr: Trace | None, results: Sequence[FixResult]) -> str | None:
    """The evidence of a ``float32`` fix that replayed finite, for an origin that ran in
    half precision: where the step as it ran first departs from float64 beyond what its
    dtype explains; ``None`` when no such fix is there."""
    origin = tr.origin if tr is not None else None
    if origin is None or origin.dtype not in _HALF:
        return None
    if not any(r.kind == FixKind.FLOAT32 and r.outcome.finite for r in results):
        return None
    evidence = provider(PRECISION_EVIDENCE)
    if evidence is None:
        return None
    try:
        if src.snapshot is not None:
            said = evidence(src.snapshot, loss_fn=src.loss_fn)
        else:
            said = evidence(src.model, src.inputs, src.target, loss_fn=src.loss_fn)
    except (ValueError, RuntimeError, SnapshotError) as e:
        return f"the float32 fix's evidence (the step against float64) could not be made: {e}"
    return f"evidence for float32: {said}"
