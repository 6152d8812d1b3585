"""The Step tab: walk through a recorded trace event by event.

Buttons (first / previous / next / last, jump to origin, next non-finite), a slider, a
phase filter and a module-name filter move a :class:`~nbdebug.widgets.cursor.Cursor`;
the event list (module tree), the detail pane, the histogram and the marker of the
per-layer norm plot follow it. Stepping only reads the recorded trace and sends small
diffs: the norm plot is never redrawn, only its ``"current event"`` trace moves.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go

from ..core.text import fmt_num, row_numbers
from ..core.trace.events import Event
from ..core.trace.result import Trace
from ..core.vocab import Phase
from ..figures.histogram import histogram_bins, histogram_figure, histogram_title
from ..figures.norms import norm_figure, norm_points
from .cursor import PHASE_FILTERS, Cursor
from .plot import PlotView
from .style import STYLE

_PHASE_MARK = {Phase.INPUT: "in ", Phase.FORWARD: "fwd", Phase.LOSS: "los", Phase.BACKWARD: "bwd"}
_NBSP = "\u00a0"


def event_label(ev: Event, category: str, *, origin: int | None = None) -> str:
    """One line of the event list: index, a mark (``*`` origin, ``!`` non-finite), phase,
    the module (its norm-plot ``category``) indented by its depth, and the tensor."""
    mark = "*" if ev.index == origin else ("!" if not ev.stats.finite else _NBSP)
    if ev.phase == Phase.INPUT:
        what = f"[input {ev.name}]"
    elif ev.phase == Phase.LOSS:
        what = "[loss]"
    elif ev.phase == Phase.BACKWARD:
        what = f"{category} grad {ev.name}"
    else:
        what = f"{category} {ev.name}"
    indent = _NBSP * 2 * max(ev.depth, 0)
    return (
        f"{ev.index:>5}".replace(" ", _NBSP)
        + f" {mark} {_PHASE_MARK.get(ev.phase, ev.phase)} {indent}{what}"
    )


def detail_html(ev: Event | None, trace: Trace) -> str:
    """The detail pane of one event as HTML."""
    if ev is None:
        return "<div class='nbdebug-detail'><i>no events recorded</i></div>"
    e = html.escape
    s = ev.stats
    origin = trace.origin is not None and trace.origin.index == ev.index
    head = f"<b>#{ev.index} {e(ev.phase)}</b> · <code>{e(ev.module or '<model>')}</code>"
    if ev.module_type:
        head += f" ({e(ev.module_type)})"
    if origin:
        head += " <span class='nbdebug-badge nbdebug-badge-bad'>origin</span>"
    rows = [
        ("phase", ev.phase),
        ("module", ev.module or "<model>"),
        ("tensor", f"{ev.kind}: {ev.name}"),
        ("shape", str(tuple(ev.shape))),
        ("dtype", ev.dtype),
    ]
    if ev.param:
        rows.append(("param", ev.param))
    if ev.op:
        rows.append(("op", ev.op))
    if ev.source:
        rows.append(("source", ev.source))
    info = "".join(
        f"<tr><th style='text-align:left'>{e(k)}</th><td style='text-align:left'>{e(v)}</td></tr>"
        for k, v in rows
    )
    names = ["norm", "mean", "std", "min", "max", "absmax", "zero_frac", "n_nan", "n_inf"]
    vals = s.as_dict()
    bad = {"n_nan", "n_inf"} if not s.finite else set()
    shown = {k: fmt_num(vals[k]) for k in names}
    if s.numel and s.n_nonfinite == s.numel:
        # no finite element: the moments are not 0, there are none (zero_frac stays: no
        # element is zero, as Event.stats and to_frame() say)
        for k in ("norm", "mean", "std", "min", "max", "absmax"):
            shown[k] = "NaN" if s.n_nan else "inf"
        bad |= {"norm"}
    elif not s.finite:
        names = [*names[:1], "norm (finite)", *names[1:]]
        shown["norm (finite)"] = shown["norm"]
        shown["norm"] = "NaN" if s.n_nan else "inf"
        bad |= {"norm"}
    stats = "".join(
        f"<tr><th style='text-align:left'>{k}</th><td "
        f"class='{'nbdebug-bad' if k in bad and shown[k] != '0' else ''}'>{shown[k]}</td></tr>"
        for k in names
    )
    if not s.finite:
        rows_txt = (
            row_numbers(ev.samples, None) if ev.samples else "not per row (no batch dimension)"
        )
        nonfinite = f"<div class='nbdebug-bad'>non-finite rows: {e(rows_txt)}</div>"
    else:
        nonfinite = "<div>non-finite rows: none</div>"
    note = f"<div><i>{e(ev.note)}</i></div>" if ev.note else ""
    return (
        f"<div class='nbdebug-detail'><div>{head}</div>{nonfinite}{note}"
        f"<div "
        f"style='display:flex;gap:16px;align-items:flex-start'><table>{info}</table><table>{stats}</table></div></div>"
    )


class StepPanel:
    """The Step tab of the debugger.

    Attributes
    ----------
    widget : ipywidgets.VBox
    cursor : Cursor
    buttons : dict of str to ipywidgets.Button
        ``"first"``, ``"prev"``, ``"next"``, ``"last"``, ``"origin"``, ``"nonfinite"``.
    slider : ipywidgets.IntSlider
        Position among the visible events.
    phase, module_filter : ipywidgets.ToggleButtons, ipywidgets.Text
    events : ipywidgets.Select
        The event list (value: the event index).
    detail : ipywidgets.HTML
    histogram, norms : PlotView
    """

    def __init__(self, trace: Trace, *, backend: str | None = None):
        self.trace = trace
        self.cursor = Cursor(trace)
        origin = trace.origin.index if trace.origin is not None else None
        self._points = norm_points(trace)
        self._labels = [
            event_label(ev, self._points.x[ev.index], origin=origin) for ev in trace.events
        ]
        self._syncing = False
        self.buttons = self._build_buttons()
        self._build_controls()
        ev0 = self.cursor.event
        self.histogram = PlotView(
            histogram_figure(ev0) if ev0 is not None else go.Figure(), backend=backend
        )
        self.norms = PlotView(norm_figure(trace, current=ev0, points=self._points), backend=backend)
        self.slider.observe(self._on_slider, names="value")
        self.events.observe(self._on_select, names="value")
        self.phase.observe(self._on_filter, names="value")
        self.module_filter.observe(self._on_filter, names="value")
        self._fill_list()
        self._show()
        self.widget = self._layout()

    # ---- building ----------------------------------------------------------------------
    def _build_buttons(self) -> dict[str, widgets.Button]:
        """The moves: first, prev, next, last, jump to origin, next non-finite."""
        trace = self.trace

        def button(key: str, description: str, tooltip: str, icon: str = "") -> widgets.Button:
            b = widgets.Button(
                description=description,
                tooltip=tooltip,
                icon=icon,
                layout=widgets.Layout(width="auto"),
            )
            b.on_click(lambda _b: self._move(key))
            return b

        buttons = {
            "first": button("first", "first", "first event", "fast-backward"),
            "prev": button("prev", "prev", "previous event", "step-backward"),
            "next": button("next", "next", "next event", "step-forward"),
            "last": button("last", "last", "last event", "fast-forward"),
            "origin": button(
                "origin", "jump to origin", "where the first NaN/Inf was produced", "crosshairs"
            ),
            "nonfinite": button(
                "nonfinite", "next non-finite", "next event holding NaN/Inf", "exclamation-triangle"
            ),
        }
        buttons["origin"].button_style = "danger" if trace.origin is not None else ""
        buttons["origin"].disabled = trace.origin is None and trace.first_nonfinite is None
        # a healthy trace has no non-finite event to go to
        buttons["nonfinite"].disabled = not any(not ev.stats.finite for ev in trace.events)
        return buttons

    def _build_controls(self) -> None:
        """The slider, the filters, the event list and the detail pane."""
        self.slider = widgets.IntSlider(
            min=0,
            max=0,
            value=0,
            description="step",
            continuous_update=True,
            readout=False,
            layout=widgets.Layout(width="60%"),
        )
        self.position = widgets.HTML()
        self.phase = widgets.ToggleButtons(
            options=list(PHASE_FILTERS),
            value="all",
            description="phase",
            style={"button_width": "84px", "description_width": "initial"},
        )
        self.module_filter = widgets.Text(
            value="",
            placeholder="module name contains",
            description="module",
            continuous_update=False,
            style={"description_width": "initial"},
        )
        self.events = widgets.Select(
            options=[], rows=16, layout=widgets.Layout(width="44%", min_width="320px")
        )
        self.events.add_class("nbdebug-events")
        self.detail = widgets.HTML(layout=widgets.Layout(width="100%"))
        self.detail.add_class("nbdebug-detail")

    def _layout(self) -> widgets.VBox:
        toolbar = widgets.HBox(
            list(self.buttons.values()), layout=widgets.Layout(flex_flow="row wrap")
        )
        filters = widgets.HBox(
            [self.phase, self.module_filter], layout=widgets.Layout(flex_flow="row wrap")
        )
        right = widgets.VBox(
            [self.detail, self.histogram.widget], layout=widgets.Layout(width="56%")
        )
        return widgets.VBox(
            [
                widgets.HTML(STYLE),
                toolbar,
                widgets.HBox([self.slider, self.position]),
                # the norm plot right under the controls: its marker is watched while stepping
                self.norms.widget,
                filters,
                widgets.HBox([self.events, right]),
            ]
        )

    # ---- wiring ------------------------------------------------------------------------
    def _move(self, key: str) -> None:
        c = self.cursor
        self._jump(
            {
                "first": c.first,
                "prev": c.prev,
                "next": c.next,
                "last": c.last,
                "origin": c.to_origin,
                "nonfinite": c.next_nonfinite,
            }[key]
        )

    def goto(self, index: int) -> None:
        """Show ``trace.events[index]`` (clearing filters that hide it), e.g. from a finding."""
        self._jump(lambda: self.cursor.goto(index))

    def _jump(self, move: Callable[[], object]) -> None:
        c = self.cursor
        before = (c.phase, c.module)
        move()
        if (c.phase, c.module) != before:  # a jump cleared the filters
            self._sync_filters()
            self._fill_list()
        self._show()

    def _on_slider(self, change: dict[str, Any]) -> None:
        if not self._syncing:
            self.cursor.seek(change["new"])
            self._show()

    def _on_select(self, change: dict[str, Any]) -> None:
        if not self._syncing and change["new"] is not None:
            self.cursor.goto(change["new"])
            self._show()

    def _on_filter(self, _change: dict[str, Any]) -> None:
        if self._syncing:
            return
        self.cursor.set_filter(phase=self.phase.value, module=self.module_filter.value)
        self._fill_list()
        self._show()

    def _sync_filters(self) -> None:
        self._syncing = True
        try:
            self.phase.value = self.cursor.phase
            self.module_filter.value = self.cursor.module
        finally:
            self._syncing = False

    def _fill_list(self) -> None:
        vis = self.cursor.visible
        self._syncing = True
        try:
            with self.events.hold_sync(), self.slider.hold_sync():
                self.events.options = [(self._labels[i], i) for i in vis]
                self.slider.max = max(len(vis) - 1, 0)
                self.events.disabled = self.slider.disabled = not vis
        finally:
            self._syncing = False

    def _show(self) -> None:
        """Bring every view to the cursor's event."""
        c = self.cursor
        ev = c.event
        pos = c.position
        self._syncing = True
        try:
            with (
                self.events.hold_sync(),
                self.slider.hold_sync(),
                self.detail.hold_sync(),
                self.position.hold_sync(),
            ):
                if pos is not None:
                    self.slider.value = pos
                    self.events.value = c.index
                self.position.value = (
                    f"event {ev.index + 1} / {len(self.trace.events)} · {len(c)} shown"
                    if ev is not None
                    else "no events"
                )
                self.detail.value = detail_html(ev, self.trace)
                idx = c.index if c.index is not None else -1
                at_first = not c.visible or idx <= c.visible[0]
                at_last = not c.visible or idx >= c.visible[-1]
                self.buttons["first"].disabled = self.buttons["prev"].disabled = at_first
                self.buttons["next"].disabled = self.buttons["last"].disabled = at_last
        finally:
            self._syncing = False
        if ev is None:
            return
        _x, y = histogram_bins(ev)
        with self.histogram.batch_update() as f:
            f.data[0].y = y
            f.layout.title.text = histogram_title(ev)
        with self.norms.batch_update() as f:
            f.data[-1].x = [self._points.x[ev.index]]
            f.data[-1].y = [self._points.y[ev.index]]

    def __repr__(self) -> str:
        return f"StepPanel({self.cursor!r})"
