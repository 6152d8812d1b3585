"""The result types of :func:`nbdebug.diagnose`: :class:`StepOutcome` (what one replay
measured), :class:`FixResult` (a fix and its replay: one row), :class:`Cause` (the top
row in one sentence) and :class:`Diagnosis` (all of it, ranked)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ...core.display import show as show_result
from ...core.text import cost_text, fmt_num
from ...core.trace import Trace
from ...core.vocab import FixKind
from .fix import FixLike, kind_of

if TYPE_CHECKING:
    import pandas as pd

    from .interventions import StepsReplay, Verdict
    from .over_steps import OverSteps

__all__ = [
    "FRAME_COLUMNS",
    "Cause",
    "Diagnosis",
    "FixResult",
    "Reference",
    "StepOutcome",
    "safe_text",
]


@dataclass
class StepOutcome:
    """What one replay of the step measured.

    Attributes
    ----------
    forward, loss_finite, backward : bool
        Whether the model output, the loss and every parameter gradient were finite.
    update : bool or None
        Whether the weights after ``optimizer.step()`` were finite (``None`` without an
        optimizer).
    loss : float or None
    grad_norm : float or None
        The total gradient norm the update used (after unscaling and clipping).
    seconds : float
    error : str or None
        What the replay raised.
    skipped : str or None
        Why the replay did not run.
    first_loss : float or None
        With several steps: the first one's loss (``loss`` is the last's).
    steps : int
    weight_norm : float or None
        The norm of the weights after the (last) update (``None`` without an optimizer).
    """

    forward: bool = False
    loss_finite: bool = False
    backward: bool = False
    update: bool | None = None
    loss: float | None = None
    grad_norm: float | None = None
    seconds: float = 0.0
    error: str | None = None
    skipped: str | None = None
    first_loss: float | None = None
    steps: int = 1
    weight_norm: float | None = None

    @property
    def finite(self) -> bool:
        """The replay ran and everything it measured was finite."""
        return (
            self.error is None
            and self.skipped is None
            and self.loss_finite
            and self.backward
            and self.update is not False
        )

    def then(self, later: StepOutcome) -> None:
        """Fold in a later step replayed on the same batch: all must stay finite; the
        loss and the gradient norm are the last step's."""
        self.forward &= later.forward
        self.loss_finite &= later.loss_finite
        self.backward &= later.backward
        if self.update is not None:
            self.update = bool(self.update and later.update)
        if self.first_loss is None:
            self.first_loss = self.loss
        self.loss, self.grad_norm = later.loss, later.grad_norm
        self.weight_norm = later.weight_norm
        self.steps += 1

    def same_as(self, other: StepOutcome) -> bool:
        """Both replays ran and measured exactly the same (loss, gradient norm, weights
        after the update, finiteness): the change made no difference."""
        ran = self.error is None and self.skipped is None and other.error is None
        return (
            ran
            and other.skipped is None
            and self.finite == other.finite
            and _same_number(self.loss, other.loss)
            and _same_number(self.grad_norm, other.grad_norm)
            and _same_number(self.weight_norm, other.weight_norm)
        )


def _same_number(a: float | None, b: float | None) -> bool:
    return a == b or (a is not None and b is not None and a != a and b != b)


def safe_text(f: Callable[[], object], default: str) -> str:
    """``str(f())``; when a user's method raises, ``default`` and the error in words."""
    try:
        return str(f())
    except Exception as e:  # a user's describe() that raises: say so, keep going
        return f"{default} ({type(e).__name__}: {e})"


def _text_of(fix: FixLike, method: str) -> str:
    """``fix.method()`` as a string; ``""`` when the fix has no such method, the error
    in words when it raises."""
    fn = getattr(fix, method, None)
    return safe_text(fn, "") if callable(fn) else ""


@dataclass
class FixResult:
    """One row of a :class:`Diagnosis`: a fix and what its replay measured.

    Attributes
    ----------
    fix : Fix
    outcome : StepOutcome
    rank : int
        1 = the top row.
    applies : bool
        Whether the fix applied to the step.
    note : str
    deviation : float or None
        How far the finite replay's loss and gradient norm are from the healthy history.
    cost : float or None
        The replay's seconds over the plain replay's.
    unchanged : bool
        The replay is identical to the plain one (the fix changed nothing), or the plain
        one is finite as well (nothing needed fixing): it is no fix (``finite`` is
        false).
    """

    fix: FixLike
    outcome: StepOutcome
    rank: int = 0
    applies: bool = True
    note: str = ""
    deviation: float | None = None
    cost: float | None = None
    unchanged: bool = False

    @property
    def kind(self) -> FixKind:
        return kind_of(self.fix)

    @property
    def module(self) -> str | None:
        module: str | None = getattr(self.fix, "module", None)
        return module

    @property
    def rows(self) -> list[int]:
        return list(getattr(self.fix, "rows", []) or [])

    @property
    def finite(self) -> bool:
        return self.applies and self.outcome.finite and not self.unchanged

    def describe(self) -> str:
        """The fix's :meth:`~Fix.describe` (what it raised, if it raised)."""
        return safe_text(lambda: self.fix.describe(), type(self.fix).__name__)

    def action(self) -> str:
        """The fix's :meth:`~Fix.action` (``"dropping batch row 3"``); its description
        when it has none."""
        return _text_of(self.fix, "action") or self.describe()

    def snippet(self) -> str:
        return _text_of(self.fix, "snippet")


@dataclass
class Cause:
    """The diagnosed cause: the top-ranked row, in one sentence.

    Attributes
    ----------
    kind : FixKind
        The top row's kind (``"epsilon"``, ``"drop_rows"``, ..., ``"not_reproducible"``).
    module : str or None
    rows : list of int
    finite : bool
        Whether the top row's replay made the step finite end to end.
    statement : str
        The sentence.
    fix : Fix or None
    op, source : str or None
        The operation and its ``"file.py:line"``.
    """

    kind: FixKind
    module: str | None
    rows: list[int]
    finite: bool
    statement: str
    fix: FixLike | None = None
    op: str | None = None
    source: str | None = None

    def __str__(self) -> str:
        return self.statement


@dataclass(frozen=True)
class Reference:
    """The recent healthy history: medians of ``loss``, ``grad_norm`` and ``lr`` (``None``
    when the history holds no healthy row); with a divergence, the band of the steps before
    it began, with the MADs (scaled to a standard deviation) of ``loss`` and ``grad_norm``."""

    loss: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    loss_mad: float | None = None
    grad_norm_mad: float | None = None


class Retracer(Protocol):
    """What :meth:`Diagnosis.trace_with` needs: a trace of the step with a fix applied."""

    def trace(self, fix: FixLike | None = None) -> Trace: ...


#: The columns of :meth:`Diagnosis.to_frame`.
FRAME_COLUMNS = (
    "rank",
    "kind",
    "module",
    "rows",
    "change",
    "finite",
    "forward",
    "loss_ok",
    "backward",
    "update",
    "loss",
    "grad_norm",
    "loss_ref",
    "grad_norm_ref",
    "seconds",
    "cost",
    "snippet",
    "note",
)


def _module_label(module: str | None) -> str:
    if module is None:
        return "-"
    return module or "<model>"


@dataclass
class Diagnosis:
    """The outcome of :func:`nbdebug.diagnose`.

    Attributes
    ----------
    cause : Cause
        The top row: ``kind``, ``module``, ``rows``, ``finite`` and a one-sentence
        ``statement``.
    results : list of FixResult
        Ranked rows (``rank`` 1 first); rows that did not make the step finite come after
        those that did.
    trace : Trace or None
        The trace of the failing step as it was (where the NaN is produced).
    origin : str
        That origin in words.
    plain : StepOutcome
        The plain replay of the step.
    reference : dict
        The recent healthy ``loss`` and ``grad_norm`` (medians of the history) or ``None``.
    notes : list of str
    step : int or None
        The snapshot's step.
    over_steps : OverSteps or None
        The counterfactual replays over steps (a snapshot with a rewind window);
        :attr:`replays` and :attr:`verdict` read it.
    ok : bool
        ``True`` when the step replayed as it was is finite end to end: there is nothing
        to fix (property).
    """

    cause: Cause
    results: list[FixResult]
    trace: Trace | None
    origin: str
    plain: StepOutcome
    reference: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    step: int | None = None
    workbench: Retracer | None = field(default=None, repr=False)
    over_steps: OverSteps | None = field(default=None, repr=False)

    @property
    def replays(self) -> list[StepsReplay]:
        """The replays over steps, one per intervention (empty without a rewind window)."""
        return self.over_steps.replays if self.over_steps is not None else []

    @property
    def verdict(self) -> Verdict | None:
        """What the replays over steps point at (``None``: no window, or undecided)."""
        return self.over_steps.verdict if self.over_steps is not None else None

    @property
    def ok(self) -> bool:
        """The step replayed as it was is finite end to end: nothing to fix."""
        return self.plain.finite

    def summary(self) -> str:
        """The cause in one sentence (:attr:`Cause.statement`)."""
        return self.cause.statement

    def _record(self, r: FixResult) -> tuple[object, ...]:
        o = r.outcome
        ran = r.applies and o.skipped is None
        return (
            r.rank,
            r.kind.value,
            _module_label(r.module),
            r.rows,
            r.describe(),
            r.finite,
            o.forward if ran else None,
            o.loss_finite if ran else None,
            o.backward if ran else None,
            o.update if ran else None,
            o.loss,
            o.grad_norm,
            self.reference.get("loss"),
            self.reference.get("grad_norm"),
            o.seconds,
            r.cost,
            r.snippet(),
            r.note or o.error or o.skipped or "",
        )

    def to_frame(self) -> pd.DataFrame:
        """One row per fix, ranked: ``rank``, ``kind``, ``module``, ``rows``, ``change``,
        ``finite``, ``forward``, ``loss_ok``, ``backward``, ``update``, ``loss``,
        ``grad_norm``, ``loss_ref``, ``grad_norm_ref``, ``seconds``, ``cost`` (x the plain
        replay), ``snippet``, ``note``."""
        import pandas as pd

        recs = [self._record(r) for r in self.results]
        return pd.DataFrame.from_records(recs, columns=list(FRAME_COLUMNS))

    def table(self) -> str:
        """The ranked table as plain text (what the command line prints)."""
        df = self.to_frame()
        if df.empty:
            return "(no fixes)"
        show = df[
            ["rank", "kind", "module", "rows", "finite", "loss", "grad_norm", "cost", "change"]
        ]
        # formatted here, not by to_string's formatters (pandas skips them for NaN): a fix
        # whose replay never ran (no cost) reads "-", a replay's NaN loss reads "nan"
        ran = show["cost"].notna().tolist()
        shown = show.assign(
            rows=[",".join(map(str, v)) if v else "-" for v in show["rows"]],
            loss=[fmt_num(v) if r else "-" for v, r in zip(show["loss"], ran)],
            grad_norm=[fmt_num(v) if r else "-" for v, r in zip(show["grad_norm"], ran)],
            cost=[cost_text(v) for v in show["cost"]],
        )
        return str(shown.to_string(index=False, max_colwidth=70))

    def fix(self, which: int | str) -> FixLike:
        """The fix of rank ``which`` (1 = top) or the first of kind ``which``."""
        for r in self.results:
            if (isinstance(which, int) and r.rank == which) or r.kind == which:
                return r.fix
        raise KeyError(f"no fix of rank or kind {which!r} in this diagnosis.")

    def trace_with(self, which: int | str | FixLike) -> Trace:
        """Trace the failing step with one fix applied (rank, kind or the fix itself), on
        the diagnosis' own copies: what the debugger's *try* button shows."""
        if self.workbench is None:
            raise RuntimeError("this diagnosis keeps no copies of the step to replay.")
        fix = which if not isinstance(which, (int, str)) else self.fix(which)
        return self.workbench.trace(fix)

    def show(self, **options: object) -> object:
        """The Fixes panel for this diagnosis (an ``ipywidgets`` widget)."""
        return show_result(self, **options)

    def __repr__(self) -> str:
        head = f"Diagnosis(step {self.step}): " if self.step is not None else "Diagnosis: "
        lines = [head + self.cause.statement, f"origin: {self.origin}"]
        ref = self.reference
        if ref.get("loss") is not None or ref.get("grad_norm") is not None:
            lines.append(
                f"healthy history: loss {fmt_num(ref.get('loss'))}, "
                f"grad norm {fmt_num(ref.get('grad_norm'))}"
            )
        lines.append(self.table())
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
