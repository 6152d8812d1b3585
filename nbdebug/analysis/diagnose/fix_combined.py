"""All the epsilon fixes of one module applied together, as one ``epsilon`` candidate: a
hand-written log-softmax needs the ``exp`` shift and the ``log`` clamp at once, and each
alone leaves the step non-finite."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

from ...core.vocab import FixKind
from .fix import LOCALITY, Fix, Replay
from .fix_epsilon import EpsilonFix

__all__ = ["CombinedFix", "combined"]


class CombinedFix(Fix):
    """Several :class:`EpsilonFix` of one module (or the loss) in the same replay.

    Parameters
    ----------
    fixes : sequence of EpsilonFix
        Two or more, all aimed at the same module.

    Examples
    --------
    >>> CombinedFix([EpsilonFix("head", "exp"), EpsilonFix("head", "log")])
    """

    kind = FixKind.EPSILON

    def __init__(self, fixes: Sequence[EpsilonFix]):
        super().__init__()
        if len(fixes) < 2 or len({f.module for f in fixes}) != 1:
            raise ValueError(
                "CombinedFix needs two or more epsilon fixes of one module; got "
                f"{[(f.module, str(f.family)) for f in fixes]}."
            )
        self.fixes = list(fixes)
        self.module = fixes[0].module
        self.op = "+".join(str(f.family) for f in fixes)
        self.source = fixes[0].source

    @property
    def rank_locality(self) -> float:
        # after each epsilon alone and the built-in: more than one change
        return self.locality if self.locality is not None else LOCALITY[FixKind.EPSILON] + 0.6

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        with ExitStack() as stack:
            for f in self.fixes:
                stack.enter_context(f.apply(replay))
            yield

    def describe(self) -> str:
        changes = " and ".join(f.change() for f in self.fixes)
        return f"{changes} together in {self.fixes[0].place()}"

    def action(self) -> str:
        return f"{' and '.join(str(f.family) for f in self.fixes)} guarded together"

    def snippet(self) -> str:
        return "\n".join(f.snippet() for f in self.fixes)


def combined(eps: Sequence[EpsilonFix]) -> list[CombinedFix]:
    """One :class:`CombinedFix` per module with epsilon fixes of two or more families."""
    by: dict[str | None, list[EpsilonFix]] = {}
    for f in eps:
        by.setdefault(f.module, []).append(f)
    return [CombinedFix(fs) for fs in by.values() if len({f.family for f in fs}) > 1]
