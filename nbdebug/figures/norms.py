"""Per-layer norm plot of a :class:`~nbdebug.core.trace.result.Trace`.

One x category per module call (in forward order; ``"input"`` and ``"loss"`` at the ends),
the L2 norm of every recorded tensor on a log y axis:

* ``"forward"``: the batch, every module output and the loss;
* ``"backward"``: the gradients arriving at / leaving each module;
* ``"param grad"``: the gradients of each module's parameters;
* ``"non-finite"``: red crosses on events holding NaN/Inf;
* ``"current event"`` (always the last trace): one marker a widget moves by changing only
  that trace's ``x``/``y`` (see :func:`norm_points`).

Norms are over the finite elements, so a NaN tensor still has a place on the plot. Zero
norms cannot sit on a log axis: they are drawn at a floor one decade
below the smallest positive norm, and the hover text gives the real value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from ..core.text import fmt_num
from ..core.trace.events import Event
from ..core.trace.result import Trace
from ..core.vocab import EventKind, Phase
from .palette import BLUE, GREEN, ORANGE, RED

#: Names of the figure's traces, in order; the widget finds the marker by
#: ``CURRENT_TRACE``, which is always ``fig.data[-1]``.
FORWARD_TRACE = "forward"
#: the target's tensors, markers without a line (present when the trace recorded a target:
#: it meets the output at the loss, it does not feed the first module)
TARGET_TRACE = "target"
BACKWARD_TRACE = "backward"
PARAM_TRACE = "param grad"
NONFINITE_TRACE = "non-finite"
CURRENT_TRACE = "current event"

INPUT_X = "input"
LOSS_X = "loss"


@dataclass
class NormPoints:
    """Where each event of a trace sits on the norm plot.

    Attributes
    ----------
    x : list of str
        ``x[i]`` is the category of ``trace.events[i]`` (module name, ``#n`` for the n-th
        call of a module called more than once).
    y : list of float
        ``y[i]`` is its norm, clamped to ``floor`` (log axis).
    floor : float
    categories : list of str
        The x axis order: input, modules in forward order, loss.
    """

    x: list[str]
    y: list[float]
    floor: float
    categories: list[str]

    def __repr__(self) -> str:
        return (
            f"NormPoints({len(self.x)} events, {len(self.categories)} categories, "
            f"floor={self.floor:.3g})"
        )


def event_categories(trace: Trace) -> list[str]:
    """The x category of every event: ``"input"``, ``"loss"``, or the module name
    (``"<model>"`` for the model itself), with ``" #n"`` for the n-th call of a module that
    is called more than once (``Event.call`` numbers calls across the whole model)."""
    calls: dict[str, list[int]] = {}
    for e in trace.events:
        if e.phase in (Phase.FORWARD, Phase.BACKWARD) and e.call >= 0:
            seen = calls.setdefault(e.module, [])
            if e.call not in seen:
                seen.append(e.call)
    out = []
    for e in trace.events:
        if e.phase == Phase.INPUT:
            out.append(INPUT_X)
        elif e.phase == Phase.LOSS:
            out.append(LOSS_X)
        else:
            name = e.module or "<model>"
            seen = calls.get(e.module, [])
            out.append(
                f"{name} #{seen.index(e.call) + 1}" if len(seen) > 1 and e.call in seen else name
            )
    return out


def norm_points(trace: Trace) -> NormPoints:
    """The position of every event of ``trace`` on :func:`norm_figure`'s axes."""
    positive = [
        e.stats.norm for e in trace.events if e.stats.norm > 0 and math.isfinite(e.stats.norm)
    ]
    floor = min(positive) / 10 if positive else 1e-12
    ceiling = max(positive) * 10 if positive else 1.0
    xs = event_categories(trace)
    ys = [
        # a tensor with no finite element (all NaN/Inf) is drawn at the top, with the
        # non-finite crosses: at the floor a NaN loss would read as a tiny one
        ceiling
        if e.stats.numel and e.stats.n_nonfinite == e.stats.numel
        else (e.stats.norm if e.stats.norm > 0 and math.isfinite(e.stats.norm) else floor)
        for e in trace.events
    ]
    cats: list[str] = []
    seen: set[str] = set()
    has_input = has_loss = False
    for e, c in zip(trace.events, xs):
        if e.phase == Phase.INPUT:
            has_input = True
        elif e.phase == Phase.LOSS:
            has_loss = True
        elif c not in seen and e.phase == Phase.FORWARD:
            seen.add(c)
            cats.append(c)
    # modules seen only in the backward (or only as a partial trace) go after the forward ones
    for e, c in zip(trace.events, xs):
        if e.phase == Phase.BACKWARD and c not in seen:
            seen.add(c)
            cats.append(c)
    cats = ([INPUT_X] if has_input else []) + cats + ([LOSS_X] if has_loss else [])
    return NormPoints(xs, ys, floor, cats)


def _hover(e: Event) -> str:
    s = e.stats
    bad = f"<br>NaN {s.n_nan}, Inf {s.n_inf}" if not s.finite else ""
    norm = fmt_num(s.norm_as_is, nan="NaN")
    if not s.finite and s.n_nonfinite < s.numel:
        norm += f" (finite elements {s.norm:.4g})"
    return (
        f"#{e.index} {e.phase} {e.module or '<model>'} {e.name}<br>"
        f"norm {norm}<br>{tuple(e.shape)} {e.dtype}{bad}"
    )


def norm_figure(
    trace: Trace, *, current: Event | int | None = None, points: NormPoints | None = None
) -> go.Figure:
    """Forward activation norms and backward gradient norms per module, log y axis.

    Parameters
    ----------
    trace : Trace
        The result of :func:`nbdebug.trace` (a partial trace works too).
    current : Event or int, optional
        The event (or its index) the ``"current event"`` marker is put on; without it the
        marker trace is empty.
    points : NormPoints, optional
        ``norm_points(trace)``, when the caller already has it.

    Returns
    -------
    plotly.graph_objects.Figure
        Traces named ``forward``, ``target`` (when a target was recorded), ``backward``,
        ``param grad``, ``non-finite`` and, last, ``current event``.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"norm_figure expects an nbdebug Trace; got {type(trace).__qualname__}.")
    pts = points if points is not None else norm_points(trace)
    hovers = [_hover(e) for e in trace.events]

    def scatter_of(idx: list[int], **kw: Any) -> go.Scatter:
        return go.Scatter(
            x=[pts.x[i] for i in idx],
            y=[pts.y[i] for i in idx],
            customdata=idx,
            text=[hovers[i] for i in idx],
            hovertemplate="%{text}<extra></extra>",
            **kw,
        )

    fig = go.Figure()
    for name, idx in trace_groups(trace).items():
        fig.add_trace(scatter_of(idx, name=name, **_GROUP_STYLE[name]))
    bad = [e.index for e in trace.events if not e.stats.finite]
    fig.add_trace(
        scatter_of(
            bad,
            mode="markers",
            marker={"color": RED, "size": 11, "symbol": "x"},
            name=NONFINITE_TRACE,
        )
    )
    fig.add_trace(_current_trace(trace, pts, current))
    fig.update_layout(
        # the title on its own line above the legend (they used to collide at the top)
        title={"text": f"Per-layer norms: {trace.model_name}", "x": 0.01, "y": 0.98},
        yaxis={"type": "log", "title": "L2 norm", "exponentformat": "e"},
        xaxis={"categoryorder": "array", "categoryarray": pts.categories, "tickangle": -45},
        margin={"l": 60, "r": 20, "t": 70, "b": 100},
        height=400,
        legend={"orientation": "h", "y": 1.01, "yanchor": "bottom", "x": 0, "xanchor": "left"},
        template="plotly_white",
    )
    return fig


#: how each group of events is drawn (see :func:`trace_groups`)
_GROUP_STYLE: dict[str, dict[str, Any]] = {
    FORWARD_TRACE: {"mode": "lines+markers", "line": {"color": BLUE}, "marker": {"size": 6}},
    BACKWARD_TRACE: {"mode": "lines+markers", "line": {"color": ORANGE}, "marker": {"size": 6}},
    TARGET_TRACE: {
        "mode": "markers",
        "marker": {"color": BLUE, "size": 8, "symbol": "square-open"},
    },
    PARAM_TRACE: {"mode": "markers", "marker": {"color": GREEN, "size": 5, "symbol": "diamond"}},
}


def trace_groups(trace: Trace) -> dict[str, list[int]]:
    """The event indices of each line of the plot: ``forward`` (the batch, the module
    outputs, the loss), ``target`` (only when a target was recorded), ``backward`` and
    ``param grad``, in that order."""
    groups: dict[str, list[int]] = {
        FORWARD_TRACE: [],
        TARGET_TRACE: [],
        BACKWARD_TRACE: [],
        PARAM_TRACE: [],
    }
    for e in trace.events:
        if e.phase == Phase.BACKWARD:
            group = PARAM_TRACE if e.kind == EventKind.PARAM_GRAD else BACKWARD_TRACE
        else:
            group = TARGET_TRACE if e.kind == EventKind.TARGET else FORWARD_TRACE
        groups[group].append(e.index)
    if not groups[TARGET_TRACE]:
        del groups[TARGET_TRACE]
    return groups


def _current_trace(trace: Trace, pts: NormPoints, current: Event | int | None) -> go.Scatter:
    """The ``"current event"`` marker, on ``current`` (empty without it)."""
    cx: list[str] = []
    cy: list[float] = []
    if current is not None:
        i = current.index if isinstance(current, Event) else int(current)
        if not 0 <= i < len(trace.events):
            raise ValueError(
                f"current must be an event of this trace (0..{len(trace.events) - 1}); got {i}."
            )
        cx, cy = [pts.x[i]], [pts.y[i]]
    return go.Scatter(
        x=cx,
        y=cy,
        mode="markers",
        marker={"size": 16, "color": "rgba(0,0,0,0)", "line": {"color": "black", "width": 2}},
        name=CURRENT_TRACE,
        hoverinfo="skip",
    )
