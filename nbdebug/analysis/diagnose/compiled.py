"""Whether a compiled model's NaN is the compiler's, for :func:`nbdebug.diagnose`: the
snapshot's step replayed eagerly and under ``torch.compile`` with its recorded back end
(the compiler verdict of the replay comparison, provided lazily through
:mod:`nbdebug.core.sources`), as one sentence of the diagnosis' notes."""

from __future__ import annotations

from ...core.snapshot import SnapshotError
from ...core.snapshot.resolve import ResolvedStep
from ...core.sources import COMPILER_VERDICT, provider

__all__ = ["compiler_note"]


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
