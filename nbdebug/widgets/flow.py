"""The Flow tab: gradient flow over time (:func:`nbdebug.figures.flow.flow_figure`) as a
panel, for a live guard, a snapshot or a directory of snapshots.

>>> panel = FlowPanel(guard)          # or a Snapshot, a snapshot path, a directory
>>> panel                             # displays the widget in a notebook
>>> panel.open_step(537)              # what clicking step 537 does: its snapshot, if any
>>> panel.refresh()                   # a live guard's steps since

Clicking a step of the figure (plotly's ``FigureWidget`` back end) or choosing it in the
snapshot list opens the snapshot written at that step: its path, kind and message here,
and, in the debugger (``nbdebug.debug(snapshot)``), its replay in the Step tab.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from ..core.flow import MAX_PARAMS, Z_THRESHOLD, FlowData, flow_data
from ..core.guard import NaNGuard
from ..core.snapshot import SnapshotError, load_snapshot
from ..core.trace.result import TraceError
from ..figures.flow import flow_figure
from .plot import PlotView
from .tabs import TabContext, TabHost

if TYPE_CHECKING:  # pragma: no cover
    from ..core.snapshot import Snapshot

#: what opening a snapshot may raise, said in the panel instead
OPEN_ERRORS = (SnapshotError, TraceError, ValueError, TypeError, OSError)


class FlowPanel:
    """Gradient flow over time, with the steps' snapshots one click away.

    Parameters
    ----------
    source : NaNGuard, Snapshot, str or os.PathLike
        A live guard, a snapshot (or its path) or a directory of snapshots.
    threshold : float
        The robust z a parameter crosses (default 6, the spike detector's).
    max_params : int
        Parameters shown at most (default 30; then the top ones by max |z|).
    on_open : callable, optional
        ``on_open(path)`` after a step's snapshot is opened (the debugger replays it).
    backend : {"auto", "figurewidget", "output"}, optional
        How the figure is drawn (clicks need ``"figurewidget"``; the list works always).

    Attributes
    ----------
    widget : ipywidgets.VBox
    data : FlowData
        The numbers drawn.
    summary : ipywidgets.HTML
        Where each spike began, the skipped and non-finite steps.
    plot : PlotView
    chooser : ipywidgets.Dropdown
        The steps with a snapshot.
    detail : ipywidgets.HTML
        The snapshot opened (or why none was).
    opened : str or None
        The path of the snapshot opened last.
    """

    def __init__(
        self,
        source: object,
        *,
        threshold: float = Z_THRESHOLD,
        max_params: int = MAX_PARAMS,
        on_open: Callable[[str], object] | None = None,
        backend: str | None = None,
    ):
        if on_open is not None and not callable(on_open):
            raise TypeError(f"on_open must be callable or None; got {type(on_open).__qualname__}.")
        self.source = source
        self.threshold, self.max_params = threshold, max_params
        self.on_open = on_open
        self.opened: str | None = None
        self.data: FlowData = flow_data(source, threshold=threshold, max_params=max_params)
        self.summary = widgets.HTML()
        self.plot = PlotView(flow_figure(self.data), backend=backend)
        self.chooser = widgets.Dropdown(
            description="snapshot", layout=widgets.Layout(width="420px")
        )
        self.open_button = widgets.Button(description="open", icon="folder-open")
        self.open_button.on_click(lambda _b: self._open_chosen())
        self.refresh_button = widgets.Button(
            description="refresh",
            icon="refresh",
            tooltip="read the guard's steps since",
            layout=widgets.Layout(display="" if isinstance(source, NaNGuard) else "none"),
        )
        self.refresh_button.on_click(lambda _b: self.refresh())
        self.detail = widgets.HTML()
        self._show()
        hint = (
            "click a step of the figure, or choose it here, to open its snapshot"
            if self.plot.backend == "figurewidget"
            else "choose a step to open its snapshot"
        )
        self.widget = widgets.VBox(
            [
                self.summary,
                self.plot.widget,
                widgets.HBox([self.chooser, self.open_button, self.refresh_button]),
                widgets.HTML(f"<small>{hint}</small>"),
                self.detail,
            ]
        )

    def _show(self) -> None:
        d = self.data
        self.summary.value = (
            f"<b>Gradient flow</b> · {html.escape(d.summary())}<br><small>"
            f"rows: {html.escape(d.rule)}; colour: each parameter's robust z "
            f"(log10, median/MAD of its own steps; above {d.threshold:g}: crossed); grey: "
            "not measured</small>"
        )
        self.chooser.options = [(self._label(s), s) for s in d.snapshots] or [("none", None)]
        self.chooser.value = next(iter(d.snapshots), None)
        self.chooser.disabled = self.open_button.disabled = not d.snapshots
        if self.plot.backend == "figurewidget":
            for trace in self.plot.figure.data:
                trace.on_click(self._on_click)

    def _label(self, step: int) -> str:
        kind = "spike" if step in self.data.spikes else ""
        kind = kind or ("non-finite" if step in self.data.nonfinite else "")
        name = Path(self.data.snapshots[step]).name
        return f"step {step}" + (f" · {kind}" if kind else "") + f" · {name}"

    def _on_click(self, _trace: Any, points: Any, _state: Any) -> None:
        if points.xs:
            self.open_step(int(points.xs[0]))

    def _open_chosen(self) -> None:
        if self.chooser.value is not None:
            self.open_step(int(self.chooser.value))

    def open_step(self, step: int) -> str | None:
        """Open the snapshot written at ``step`` (what a click does): its path, kind and
        message in :attr:`detail`, then ``on_open(path)``. Returns the path, or ``None``
        when no snapshot was written at that step (:attr:`detail` says which steps have
        one) or it cannot be opened (:attr:`detail` says why)."""
        path = self.data.snapshots.get(int(step))
        if path is None:
            have = ", ".join(str(s) for s in self.data.snapshots) or "none"
            self.detail.value = (
                f"<i>no snapshot was written at step {int(step)}; steps with one: {have}.</i>"
            )
            return None
        self.chooser.value = int(step)
        try:
            snap = load_snapshot(path)  # the header: no model, no weight read
            self.detail.value = _snapshot_html(snap, path)
            self.opened = path
            if self.on_open is not None:
                self.on_open(path)
        except OPEN_ERRORS as e:
            self.detail.value = (
                f"<span class='nbdebug-error'>could not open {html.escape(path)}: "
                f"{html.escape(str(e))}</span>"
            )
            return None
        return path

    def refresh(self) -> None:
        """Read the source again (a live guard's steps since) and redraw."""
        self.data = flow_data(self.source, threshold=self.threshold, max_params=self.max_params)
        self.plot.replace(flow_figure(self.data))
        self._show()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def __repr__(self) -> str:
        d = self.data
        return (
            f"FlowPanel({len(d.steps)} steps x {len(d.names)} of {d.n_params} parameters, "
            f"{len(d.spike_runs)} spike(s), {len(d.snapshots)} snapshot(s))"
        )


def _snapshot_html(snap: Snapshot, path: str) -> str:
    e = html.escape
    head = f"<b>step {snap.step} · {e(snap.kind or 'snapshot')}</b> <code>{e(path)}</code>"
    return f"<div class='nbdebug-detail'>{head}<br>{e(snap.message)}</div>"


def has_flow(snap: Snapshot) -> bool:
    """Whether a snapshot has a flow to show: per-layer signals, or spike findings."""
    signals = snap.signals
    return (signals is not None and len(signals) > 0) or any(r.get("spikes") for r in snap.history)


def add_flow_tab(dbg: TabHost, ctx: TabContext) -> None:
    """Add the Flow tab to a snapshot's debugger when the snapshot has a flow to show
    (:func:`has_flow`): opening a step's snapshot replays it in the Step tab, on a copy of
    the debugger's model. The debugger adds it right after its History tab."""
    snap = ctx.snapshot
    if snap is None or not has_flow(snap):
        return

    def on_open(path: str) -> None:
        other = load_snapshot(path, model=ctx.model) if ctx.model is not None else None
        if other is None:
            return  # no model to replay on: the panel shows the path and the message
        try:
            trace, error = other.trace(loss_fn=ctx.loss_fn), None
        except TraceError as err:
            if err.trace is None:
                raise
            trace, error = err.trace, str(err)
        dbg.show_trace(trace, error=error, label=f"step {other.step} opened from the Flow tab")
        dbg.select_tab("Step")

    dbg.add_tab("Flow", FlowPanel(snap, on_open=on_open, backend=ctx.backend))
