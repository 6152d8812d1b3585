"""The debugger: a header and tabs, composed from one panel per file.

>>> dbg = nbdebug.debug(model, x, target=y, loss_fn=F.cross_entropy)
>>> dbg                      # displays the widget in a notebook
>>> dbg.current_event        # the event the Step tab shows, as data
>>> dbg.add_tab("Checks", panel.widget)

``debug`` takes a model and a batch (the conventions of :func:`nbdebug.trace`), a
:class:`~nbdebug.core.snapshot.Snapshot`, the path of a snapshot file (with ``model=``),
a directory of per-rank snapshots, or an already recorded
:class:`~nbdebug.core.trace.result.Trace` (:func:`~nbdebug.core.snapshot.resolve_source`
tells them apart). A Trace's ``show()`` is its debugger (:func:`register_viewers`).
"""

from __future__ import annotations

import html
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from ..core.batch import LossFn
from ..core.display import register_viewer
from ..core.options import options_from
from ..core.snapshot.load import ModelSource
from ..core.snapshot.resolve import Caller, resolve_source
from ..core.trace.events import Event
from ..core.trace.result import Trace, TraceError
from ..figures.palette import RED
from .cursor import Cursor
from .flow import add_flow_tab
from .history import HistoryPanel
from .layers import LayersPanel
from .plot import fit_figures
from .step import StepPanel
from .style import STYLE
from .tabs import DebugOptions, HasWidget, TabContext, add_feature_tabs

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from ..core.guard import NonFiniteError
    from ..core.snapshot import Snapshot
    from .ranks import RanksDebugger

    #: what :func:`debug` opens
    DebugSource = (
        torch.nn.Module
        | tuple[torch.nn.Module, Any]
        | tuple[torch.nn.Module, Any, Any]
        | Snapshot
        | NonFiniteError
        | str
        | os.PathLike[str]
        | Trace
        | TraceError
    )

TraceSource = Callable[[], Trace]


def close_widgets(root: object) -> int:
    """Close ``root`` and every widget reachable through its traits (children, layout,
    style, ...), so nothing stays registered in the kernel. Returns how many were closed."""
    seen: set[int] = set()
    stack = [root]
    n = 0
    while stack:
        w = stack.pop()
        if not isinstance(w, widgets.Widget) or id(w) in seen:
            continue
        seen.add(id(w))
        for v in list(w._trait_values.values()):
            if isinstance(v, widgets.Widget):
                stack.append(v)
            elif isinstance(v, (tuple, list)):
                stack.extend(x for x in v if isinstance(x, widgets.Widget))
        if w.comm is not None:
            w.close()
            n += 1
    return n


def _empty_trace(model_name: str, error: str) -> Trace:
    return Trace(
        events=[],
        origin=None,
        first_nonfinite=None,
        loss=None,
        params=[],
        model_name=model_name,
        error=error,
    )


def _run(source: TraceSource, model_name: str) -> tuple[Trace, str | None]:
    """Call ``source``; a model that raises gives its partial trace and the message."""
    try:
        return source(), None
    except TraceError as err:
        tr = err.trace if err.trace is not None else _empty_trace(model_name, str(err))
        return tr, str(err)


def status_text(trace: Trace, error: str | None, warned: bool) -> str:
    """The status the header's badge and the debugger's repr give: the trace's summary,
    or "no NaN/Inf" for a healthy trace beside errors or warnings of the health checks or
    another tab (it is not called "healthy" beside them)."""
    ok = trace.healthy and error is None
    return "no NaN/Inf" if ok and warned else trace.summary()


def header_html(
    trace: Trace,
    *,
    error: str | None = None,
    snapshot: str | None = None,
    extra: str = "",
    warned: bool = False,
) -> str:
    """The debugger's header: model class, parameter count, batch, loss, status badge
    (and ``extra`` HTML after the badge, e.g. the health-check counts). ``warned``: the
    health checks found errors or warnings, so a trace without NaN/Inf is not called
    "healthy" in green beside them (the badge reads "no NaN/Inf", in grey)."""
    e = html.escape
    loss = (
        "–"
        if trace.loss is None
        else (f"{trace.loss:.6g}" if math.isfinite(trace.loss) else str(trace.loss))
    )
    status = trace.summary()
    ok = trace.healthy and error is None
    cls = "nbdebug-badge-bad"
    if ok:
        cls = "nbdebug-badge-plain" if warned else "nbdebug-badge-ok"
    shown = status_text(trace, error, warned)
    badge = f"<span class='nbdebug-badge {cls}'>{e(shown)}</span>"
    parts = [
        f"<b>{e(trace.model_name)}</b>",
        f"{trace.n_params:,} parameters",
        f"batch <code>{e(trace.batch or '?')}</code>",
        f"loss {e(loss)}",
        f"{len(trace.events)} events",
    ]
    lines = [" · ".join(parts), f"<div style='margin-top:4px'>{badge} {extra}</div>"]
    if error and error not in status:
        lines.append(
            f"<div class='nbdebug-error' "
            f"style='color:{RED};margin-top:4px'><b>TraceError:</b> {e(error)}</div>"
        )
    if snapshot:
        lines.append(f"<div style='margin-top:4px'>{e(snapshot)}</div>")
    return "<div class='nbdebug-header'>" + "".join(lines) + "</div>"


class Debugger:
    """The debugger widget. Build it with :func:`debug`.

    Attributes
    ----------
    widget : ipywidgets.VBox
        Header and tabs; displaying the debugger displays this.
    trace : Trace
        The trace shown (the partial one when the model raised).
    error : str or None
        The ``TraceError`` message when the model raised.
    step, layers : StepPanel, LayersPanel
    history : HistoryPanel or None
        Only for a snapshot with a recorded history.
    tabs : ipywidgets.Tab
    rerun_button : ipywidgets.Button
        Traces again (the model and batch as they are now); disabled without a source.
    """

    def __init__(
        self,
        trace: Trace,
        *,
        error: str | None = None,
        source: TraceSource | None = None,
        history: pd.DataFrame | None = None,
        failing_step: int | None = None,
        reason: str | None = None,
        backend: str | None = None,
    ):
        if not isinstance(trace, Trace):
            raise TypeError(
                f"Debugger expects an nbdebug Trace; got {type(trace).__qualname__} "
                f"(use nbdebug.debug())."
            )
        self.trace = trace
        self.error = error
        self._source = source
        self._backend = backend
        self._snapshot_line = None
        if failing_step is not None or reason:
            self._snapshot_line = (
                "snapshot"
                + (f" of step {failing_step}" if failing_step is not None else "")
                + (f": {reason}" if reason else "")
            )
        self._label: str | None = None
        self._extra: list[tuple[str, widgets.Widget]] = []
        self._header_extra = ""
        self._warned = False
        self._warned_by: dict[str, bool] = {}  # tab title -> it found something wrong
        self._panels: dict[str, Any] = {}
        self._callbacks: list[Callable[[Debugger], Any]] = []
        self.header = widgets.HTML()
        self.rerun_button = widgets.Button(
            description="re-run",
            icon="refresh",
            disabled=source is None,
            tooltip="trace again with the model and batch as they are now"
            if source
            else "no model to re-run",
        )
        self.rerun_button.on_click(lambda _b: self.rerun())
        self.history: HistoryPanel | None = None
        if history is not None and len(history):
            self.history = HistoryPanel(
                history, failing_step=failing_step, reason=reason, backend=backend
            )
        self.tabs = widgets.Tab()
        # a FigureWidget drawn in a hidden tab has a default width until fitted when shown
        self.tabs.observe(self._on_tab_shown, names="selected_index")
        self._build_panels()
        self.widget = widgets.VBox(
            [
                widgets.HTML(STYLE),
                widgets.HBox(
                    [self.header, self.rerun_button],
                    layout=widgets.Layout(justify_content="space-between"),
                ),
                self.tabs,
            ]
        )
        self.widget.add_class("nbdebug-debugger")

    def _build_panels(self) -> None:
        self._render_header()
        self.step = StepPanel(self.trace, backend=self._backend)
        self.layers = LayersPanel(self.trace, backend=self._backend)
        self._layout_tabs()

    def _render_header(self) -> None:
        line = " · ".join(x for x in (self._snapshot_line, self._label) if x) or None
        self.header.value = header_html(
            self.trace,
            error=self.error,
            snapshot=line,
            extra=self._header_extra,
            warned=self._warned_or_alarmed(),
        )

    def _warned_or_alarmed(self) -> bool:
        return self._warned or any(self._warned_by.values())

    def set_header_extra(self, html_text: str, *, warned: bool = False) -> None:
        """HTML shown after the status badge (kept across re-runs until set again);
        ``warned``: it reports errors or warnings (see :func:`header_html`)."""
        self._header_extra = html_text
        self._warned = warned
        self._render_header()

    def set_warned(self, source: str, warned: bool) -> None:
        """Say whether the tab ``source`` (e.g. "Drift") found something wrong: while one
        did, the header does not call the trace "healthy" in green (it reads "no NaN/Inf",
        in grey) beside that tab's alarm."""
        self._warned_by[source] = bool(warned)
        self._render_header()

    def select_tab(self, title: str) -> None:
        """Bring the tab named ``title`` to the front."""
        titles = list(self.tabs.titles)
        if title not in titles:
            raise ValueError(f"no tab named {title!r}; the tabs are {titles}.")
        self.tabs.selected_index = titles.index(title)

    def _on_tab_shown(self, change: Mapping[str, object]) -> None:
        index = change["new"]
        if isinstance(index, int) and 0 <= index < len(self.tabs.children):
            fit_figures(self.tabs.children[index])

    def _layout_tabs(self) -> None:
        pairs: list[tuple[str, widgets.Widget]] = [
            ("Step", self.step.widget),
            ("Layers", self.layers.widget),
        ]
        if self.history is not None:
            pairs.append(("History", self.history.widget))
        pairs += self._extra
        with self.tabs.hold_sync():
            self.tabs.children = [w for _, w in pairs]
            self.tabs.titles = [t for t, _ in pairs]

    # ---- results as data ---------------------------------------------------------------
    @property
    def cursor(self) -> Cursor:
        """The Step tab's position over the events."""
        return self.step.cursor

    @property
    def current_event(self) -> Event | None:
        """The event the Step tab shows."""
        return self.step.cursor.event

    # ---- composition -------------------------------------------------------------------
    def add_tab(self, title: str, widget: widgets.Widget | HasWidget) -> None:
        """Add a tab (gradcheck, checks, drift, labels panels). ``widget`` is an ipywidget
        or an object with a ``.widget`` attribute; it is kept across re-runs."""
        if not isinstance(title, str) or not title:
            raise TypeError(f"tab title must be a non-empty string; got {title!r}.")
        w = getattr(widget, "widget", widget)
        if not isinstance(w, widgets.Widget):
            raise TypeError(
                f"add_tab expects an ipywidget or an object with .widget; got "
                f"{type(widget).__qualname__}."
            )
        self._extra.append((title, w))
        self._panels[title] = widget
        self._layout_tabs()

    def panel(self, title: str) -> Any:
        """The object given to :meth:`add_tab` for tab ``title`` (e.g. the ChecksPanel)."""
        if title not in self._panels:
            raise KeyError(f"no added tab named {title!r}; added tabs: {list(self._panels)}.")
        return self._panels[title]

    def on_retrace(self, callback: Callable[[Debugger], object]) -> None:
        """Call ``callback(debugger)`` after every re-run (e.g. to refresh an added tab)."""
        self._callbacks.append(callback)

    def rerun(self) -> Trace:
        """Trace again from the source (model and batch as they are now) and rebuild the
        Step and Layers tabs. Returns the new trace."""
        if self._source is None:
            raise ValueError(
                "this debugger was built from a recorded trace: there is nothing to re-run."
            )
        self.rerun_button.disabled = True
        try:
            trace, error = _run(self._source, self.trace.model_name)
        finally:
            self.rerun_button.disabled = False
        self.show_trace(trace, error=error)
        return self.trace

    def show_trace(
        self, trace: Trace, *, error: str | None = None, label: str | None = None
    ) -> None:
        """Show ``trace`` in the Step and Layers tabs (e.g. the step with a fix applied,
        from the Fixes tab), with ``label`` under the header; re-run goes back to the
        source. The tabs that follow re-runs are refreshed too."""
        if not isinstance(trace, Trace):
            raise TypeError(f"show_trace expects an nbdebug Trace; got {type(trace).__qualname__}.")
        old = (self.step.widget, self.layers.widget)
        self.trace, self.error, self._label = trace, error, label
        self._build_panels()
        for w in old:
            close_widgets(w)
        for cb in self._callbacks:
            cb(self)

    def close(self) -> None:
        """Close every widget of the debugger (they stop using kernel memory)."""
        close_widgets(self.widget)

    # ---- display -----------------------------------------------------------------------
    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def __repr__(self) -> str:
        ev = self.current_event
        at = f"at #{ev.index} {ev.label}" if ev is not None else "no events"
        status = status_text(self.trace, self.error, self._warned_or_alarmed())
        return f"Debugger({self.trace.model_name}: {len(self.trace.events)} events, {at}; {status})"


def debug(
    obj: DebugSource,
    inputs: object = None,
    target: object = None,
    loss_fn: LossFn | None = None,
    *,
    model: ModelSource | None = None,
    backend: str | None = None,
    **options: Any,
) -> Debugger | RanksDebugger:
    """Open the debugger.

    Parameters
    ----------
    obj : torch.nn.Module, tuple, Snapshot, NonFiniteError, str, os.PathLike, Trace or TraceError
        A model (then ``inputs`` is its batch: a tensor, tuple/list or dict, as for
        :func:`nbdebug.trace`; or a ``(model, inputs[, target])`` tuple), a snapshot (or
        the error a guard raised: its snapshot), the path of a snapshot file, a directory
        of a distributed run's per-rank snapshots (``step-...-rankN.nbsnap``: a
        :class:`~nbdebug.widgets.ranks.RanksDebugger` with a rank selector and the
        :func:`nbdebug.compare_ranks` table in its header), or a
        recorded trace (a ``TraceError``'s partial one).
    inputs, target, loss_fn
        As for :func:`nbdebug.trace` (model only; a snapshot takes ``loss_fn`` to override
        the recorded loss function).
    model : torch.nn.Module or callable, optional
        For a snapshot path (or a Snapshot loaded without one): the architecture (a module
        or a zero-argument factory), passed to :func:`nbdebug.load_snapshot`.
    backend : {"auto", "figurewidget", "output"}, optional
        How figures are drawn (see :mod:`nbdebug.widgets.plot`).
    reference : array, DataFrame or tensor, optional
        A reference batch (e.g. training data): adds a Drift tab comparing the batch to it
        through SHAP explanations (:func:`nbdebug.drift`; tabular models).
    labels, pred_probs : array-like, optional
        Given labels and out-of-fold class probabilities of the batch's samples: adds a
        Labels tab to review suspicious labels (:class:`nbdebug.LabelCleaner`), whose
        decisions are appended to ``journal`` (default ``"labels.journal.jsonl"``).

    ``reference``, ``labels``, ``pred_probs`` and ``journal`` are keyword-only options
    (:class:`~nbdebug.widgets.tabs.DebugOptions`); another name raises ``TypeError``.
    A model and batch (or a snapshot) also get a Gradcheck tab: the gradient check of
    every leaf module on the batch's first rows, run from the tab's button. A snapshot
    holding per-layer signals or spike findings gets a Flow tab after History: the
    gradient flow over its steps (:class:`~nbdebug.widgets.flow.FlowPanel`).

    Returns
    -------
    Debugger or RanksDebugger
        A directory gives a :class:`~nbdebug.widgets.ranks.RanksDebugger`. A model that
        raises gives a debugger showing the ``TraceError`` message and the partial trace.

    Raises
    ------
    SourceError
        A source of another form, a model without its batch, a batch beside a snapshot
        (a ``TypeError``, see :func:`~nbdebug.core.snapshot.resolve_source`).
    SnapshotError
        A file that cannot be read, a directory without a readable snapshot, a snapshot
        without a model (``needs_model`` set).
    """
    opts = options_from(DebugOptions, options, where="debug()", also=DEBUG_KEYWORDS)
    tabs = TabContext(options=opts, backend=backend)
    src = resolve_source(obj, inputs, target, model=model, caller=DEBUG_SOURCE)
    if src.trace is not None:
        if (
            src.inputs is not None
            or src.target is not None
            or loss_fn is not None
            or opts.reference is not None
        ):
            raise TypeError(
                "debug(trace) takes no inputs/target/loss_fn: the trace is already recorded."
            )
        dbg = Debugger(src.trace, error=src.error, backend=backend)
        add_feature_tabs(dbg, _recorded_context(src.trace, backend))
        return dbg
    if src.model is not None:
        ctx = replace(tabs, inputs=src.inputs, target=src.target, loss_fn=loss_fn)
        return _debug_model(src.model, ctx)
    if src.snapshot is not None:
        return _debug_snapshot(src.snapshot, replace(tabs, loss_fn=loss_fn))
    assert src.directory is not None  # the per-rank files of a distributed step
    return _debug_directory(src.directory, src.factory, loss_fn, backend)


#: what :func:`debug` opens (:func:`~nbdebug.core.snapshot.resolve_source`); a snapshot
#: needs its model
DEBUG_SOURCE = Caller("debug", need_model=True)


#: the keyword arguments of :func:`debug`'s signature (its options are DebugOptions')
DEBUG_KEYWORDS = ("inputs", "target", "loss_fn", "model", "backend")


def _recorded_context(tr: Trace, backend: str | None) -> TabContext:
    """The tabs' context of a recorded trace: the model, batch, target and loss function
    it ran with (``Trace.call``), so its Gradcheck and Fixes tabs apply as for a model."""
    call = tr.call
    if call is None:
        return TabContext(backend=backend)
    return TabContext(
        model=call.model,
        inputs=call.inputs,
        target=call.target,
        loss_fn=call.loss_fn,
        backend=backend,
    )


def _debug_model(net: torch.nn.Module, ctx: TabContext) -> Debugger:
    """The debugger of ``net`` on the batch of ``ctx``, re-run from the same batch."""
    from ..core.trace import trace as _trace

    def source() -> Trace:
        return _trace(net, ctx.inputs, target=ctx.target, loss_fn=ctx.loss_fn)

    # bad arguments (not a module, empty batch, no loss) raise here, before any widget
    tr, err = _run(source, type(net).__name__)
    dbg = Debugger(tr, error=err, source=source, backend=ctx.backend)
    add_feature_tabs(dbg, replace(ctx, model=net))
    return dbg


def _debug_snapshot(snap: Snapshot, ctx: TabContext) -> Debugger:
    """The debugger of a snapshot's replay (``ctx.loss_fn`` overrides the recorded one)."""

    def replay() -> Trace:
        return snap.trace(loss_fn=ctx.loss_fn)

    tr, err = _run(replay, snap.model_class or "snapshot")
    reason = f"{snap.kind}: {snap.message}" if snap.kind else snap.message
    dbg = Debugger(
        tr,
        error=err,
        source=replay,
        history=snap.history_frame(),
        failing_step=snap.step,
        reason=reason,
        backend=ctx.backend,
    )
    full = replace(ctx, model=snap.model, inputs=snap.inputs, snapshot=snap)
    add_flow_tab(dbg, full)  # next to History: the steps before this one, per parameter
    add_feature_tabs(dbg, full)
    return dbg


def _debug_directory(
    directory: str | os.PathLike[str],
    model: ModelSource | None,
    loss_fn: LossFn | None,
    backend: str | None,
) -> RanksDebugger:
    """The debugger over a distributed run's per-rank snapshots in ``directory``."""
    from .ranks import RanksDebugger

    def open_rank(path: str | os.PathLike[str]) -> Debugger:
        one = debug(path, model=model, loss_fn=loss_fn, backend=backend)
        assert isinstance(one, Debugger)  # a file: one snapshot's debugger
        return one

    return RanksDebugger(directory, open_rank, model=model, loss_fn=loss_fn)


def trace_panel(trace: Trace, *, backend: str | None = None) -> widgets.Widget:
    """The debugger's widget for a recorded ``Trace`` (``trace.show()``): what
    ``nbdebug.debug(trace)`` shows."""
    dbg = debug(trace, backend=backend)
    assert isinstance(dbg, Debugger)  # a trace: one debugger
    return dbg.widget


def register_viewers() -> None:
    """Register the debugger as the viewer of a ``Trace`` (the other results' panels are
    registered by :func:`nbdebug.widgets.display.register_viewers`; no panel file but
    this one composes the debugger)."""
    register_viewer("Trace", trace_panel)
