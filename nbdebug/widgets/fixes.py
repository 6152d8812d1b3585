"""The Fixes tab: candidate fixes replayed on the failing step, ranked
(:func:`nbdebug.diagnose`), with a *try* button per fix and the snippet to copy.

Layout, top to bottom: a "diagnose" button (the replays run on request: a few training
steps of the model), the cause in one sentence, the ranked table
(:func:`nbdebug.figures.report.diagnosis_table`), one row of buttons per fix (*try #k*:
trace the step with that fix and show it, e.g. in the Step tab) and the snippet of the
last fix tried, in a text box to copy from.

>>> panel = FixesPanel(lambda: nbdebug.diagnose(snap), on_try=show_trace)
>>> panel.run()            # what the "diagnose" button does
>>> panel.try_fix(1)       # what "try #1" does
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Protocol

import ipywidgets as widgets

from ..analysis.diagnose import Diagnosis, diagnose
from ..analysis.diagnose.over_steps import NO_WINDOW
from ..core.trace.result import Trace
from ..figures.replays import replays_figure
from ..figures.report import diagnosis_table
from .plot import PlotView
from .style import STYLE
from .tabs import FeatureTab, TabContext, TabHost


class TriedFix(Protocol):
    """What ``on_try`` is told of the fix tried: a row of :attr:`Diagnosis.results`."""

    @property
    def rank(self) -> int: ...

    def describe(self) -> str: ...


class FixesPanel:
    """Fixes panel; see the module docstring.

    Parameters
    ----------
    diagnose : callable
        ``diagnose() -> Diagnosis``: runs the replays (called by the button or :meth:`run`).
    on_try : callable, optional
        ``on_try(trace, row)`` with the trace of the step with the fix applied and its
        :class:`~nbdebug.analysis.diagnose.FixResult`.
    diagnosis : Diagnosis, optional
        Shown at once, without the button being pressed.

    Attributes
    ----------
    widget : ipywidgets.VBox
    diagnosis : Diagnosis or None
    tried : Trace or None
        The trace of the last fix tried.
    snippet : ipywidgets.Textarea
        The code of the last fix tried (or the top fix), to copy.
    """

    def __init__(
        self,
        diagnose: Callable[[], Diagnosis] | None = None,
        *,
        on_try: Callable[[Trace, TriedFix], object] | None = None,
        diagnosis: Diagnosis | None = None,
    ) -> None:
        if diagnose is None and diagnosis is None:
            raise TypeError(
                "FixesPanel needs diagnose=(a callable returning a Diagnosis) or diagnosis=."
            )
        if diagnosis is not None and not isinstance(diagnosis, Diagnosis):
            raise TypeError(
                f"diagnosis must be an nbdebug Diagnosis; got {type(diagnosis).__qualname__}."
            )
        self._diagnose = diagnose
        self._on_try = on_try
        self.diagnosis: Diagnosis | None = None
        self.tried: Trace | None = None
        self.button = widgets.Button(
            description="diagnose",
            icon="stethoscope",
            tooltip="replay the failing step with each candidate fix (a few training steps)",
            disabled=diagnose is None,
        )
        self.button.on_click(lambda _b: self.run())
        self.status = widgets.HTML(
            "<span class='note'>Replays the failing step once per candidate fix and ranks them "
            "by which one makes it finite.</span>"
        )
        self.cause = widgets.HTML()
        # the replays over steps: the verdict, then loss and grad norm per replay
        self.story = widgets.VBox()
        self.table = widgets.HTML()
        self.tries = widgets.VBox()
        self.snippet = widgets.Textarea(
            value="",
            placeholder="the code of a fix, to copy",
            layout=widgets.Layout(width="100%", height="6em"),
        )
        self.widget = widgets.VBox(
            [
                widgets.HTML(STYLE),
                widgets.HBox([self.button, self.status]),
                self.cause,
                self.story,
                self.table,
                self.tries,
                self.snippet,
            ]
        )
        self.widget.add_class("nbdebug-fixes")
        if diagnosis is not None:
            self.show(diagnosis)

    def run(self) -> Diagnosis:
        """Run the diagnosis (the button) and show it."""
        if self._diagnose is None:
            raise ValueError("this panel was given a diagnosis, not a way to run one.")
        self.button.disabled = True
        self.status.value = "<span class='note'>replaying ...</span>"
        try:
            d = self._diagnose()
        except Exception as e:
            self.status.value = (
                f"<span class='bad'>{html.escape(type(e).__name__)}: {html.escape(str(e))}</span>"
            )
            raise
        finally:
            self.button.disabled = False
        self.show(d)
        return d

    def show(self, d: Diagnosis) -> None:
        """Display ``d``: the cause, the table, a *try* button per fix."""
        self.diagnosis = d
        buttons = []
        for r in d.results:
            b = widgets.Button(
                description=f"try #{r.rank}",
                tooltip=f"trace the step with: {r.describe()}",
                disabled=not r.applies,
                layout=widgets.Layout(width="auto"),
            )
            b.on_click(lambda _b, rank=r.rank: self.try_fix(rank))
            label = widgets.HTML(
                f"<code>{html.escape(r.kind)}</code> {html.escape(r.describe())}"
                + (" <b>finite</b>" if r.finite else " <span class='bad'>not finite</span>")
            )
            buttons.append(widgets.HBox([b, label]))
        with self.widget.hold_sync():
            n = sum(r.finite for r in d.results)
            self.status.value = (
                f"<span class='note'>{len(d.results)} replays, {n} finite end to end</span>"
            )
            self.cause.value = f"<p><b>Cause:</b> {html.escape(d.cause.statement)}</p>"
            self.story.children = _story(d)
            self.table.value = diagnosis_table(d)
            self.tries.children = buttons
            self.snippet.value = d.results[0].snippet() if d.results else ""

    def try_fix(self, rank: int) -> Trace:
        """Trace the step with the fix of rank ``rank`` and hand it to ``on_try``."""
        if self.diagnosis is None:
            raise ValueError("nothing diagnosed yet: run() first.")
        row = next((r for r in self.diagnosis.results if r.rank == rank), None)
        if row is None:
            raise ValueError(
                f"no fix of rank {rank}; the ranks are 1..{len(self.diagnosis.results)}."
            )
        tr = self.diagnosis.trace_with(row.fix)
        self.tried = tr
        self.snippet.value = row.snippet()
        self.status.value = (
            f"<span class='note'>tried #{rank} ({html.escape(row.describe())}): "
            f"{html.escape(tr.summary())}</span>"
        )
        if self._on_try is not None:
            self._on_try(tr, row)
        return tr

    def __repr__(self) -> str:
        if self.diagnosis is None:
            return "FixesPanel(not diagnosed yet)"
        return f"FixesPanel({len(self.diagnosis.results)} fixes; cause {self.diagnosis.cause.kind})"


def _story(d: Diagnosis) -> tuple[widgets.Widget, ...]:
    """The verdict of the replays over steps and their curves; the one sentence of a
    snapshot without a rewind window; nothing for a model and its batch."""
    if d.over_steps is None:
        return (widgets.HTML(f"<p class='note'>{NO_WINDOW}</p>"),) if NO_WINDOW in d.notes else ()
    verdict = widgets.HTML(f"<p><b>Over steps:</b> {html.escape(d.over_steps.summary())}</p>")
    return (verdict, PlotView(replays_figure(d.over_steps)).widget)


def build_tab(dbg: TabHost, ctx: TabContext) -> None:
    """The Fixes tab: :func:`nbdebug.diagnose` of the debugger's snapshot (or model and
    batch) on request; *try* shows the step with that fix in the Step tab."""

    def run() -> Diagnosis:
        if ctx.snapshot is not None:
            return diagnose(ctx.snapshot, loss_fn=ctx.loss_fn, progress=False)
        return diagnose(ctx.model, ctx.inputs, ctx.target, ctx.loss_fn, progress=False)

    def on_try(tr: Trace, row: TriedFix) -> None:
        dbg.show_trace(tr, label=f"with fix #{row.rank} applied: {row.describe()}")
        dbg.select_tab("Step")

    dbg.add_tab("Fixes", FixesPanel(run, on_try=on_try))


FEATURE_TAB = FeatureTab(
    "Fixes",
    applies=lambda ctx: (
        ctx.model is not None and (ctx.snapshot is not None or ctx.inputs is not None)
    ),
    build=build_tab,
    order=15,
)
