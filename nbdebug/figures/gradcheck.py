"""Heatmaps of one gradcheck pair: analytic, numerical and ``|difference|`` side by side.

The three heatmaps share one colour axis (a diverging scale symmetric around 0, so the
``|difference|`` panel reads on the same scale as the Jacobians), the y axis is the output
element and the x axis the input element, as in ``J[r, c] = d out[r] / d in[c]``. The
worst element (furthest out of tolerance) is outlined on all three. Jacobians larger than
``max_cells`` in a direction are cropped to a window around the worst element; the title
says which part is shown.
"""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..analysis.gradcheck.result import GradcheckResult, PairCheck, element_index
from ..analysis.gradcheck.verdicts import (
    BACKWARD_WRONG,
    FLOAT32_PRECISION,
    NON_DIFFERENTIABLE,
    OK,
    SKIPPED,
    index_text,
)
from .palette import BLUE, GREEN, GREY, ORANGE, RED

PANELS = ("analytic", "numerical", "|difference|")
#: names of the three marker traces (after the three heatmaps)
WORST_TRACE = "worst element"
#: the colour of each verdict (and of a module the sweep skipped), in titles and badges
VERDICT_COLOR = {
    OK: GREEN,
    FLOAT32_PRECISION: BLUE,
    NON_DIFFERENTIABLE: ORANGE,
    BACKWARD_WRONG: RED,
    SKIPPED: GREY,
}


def pick_pair(obj: PairCheck | GradcheckResult, index: int | None = None) -> PairCheck | None:
    """The pair to draw: ``obj`` itself, ``obj.pairs[index]``, or the worst pair."""
    if isinstance(obj, PairCheck):
        return obj
    if index is not None:
        return obj.pairs[index]
    return obj.worst


def window(pair: PairCheck, max_cells: int) -> tuple[int, int, int, int]:
    """``(r0, r1, c0, c1)``: the rows/columns drawn, at most ``max_cells`` each, around the
    worst element."""
    R, C = pair.analytic.shape
    r, c = pair.worst

    def span(n: int, at: int) -> tuple[int, int]:
        if n <= max_cells:
            return 0, n
        lo = min(max(0, at - max_cells // 2), n - max_cells)
        return lo, lo + max_cells

    r0, r1 = span(R, r)
    c0, c1 = span(C, c)
    return r0, r1, c0, c1


def gradcheck_figure(
    obj: PairCheck | GradcheckResult | None,
    index: int | None = None,
    *,
    max_cells: int = 64,
    height: int = 360,
) -> go.Figure:
    """Three heatmaps (analytic, numerical, ``|difference|``) of one pair.

    Parameters
    ----------
    obj : PairCheck or GradcheckResult or None
        The pair, or a result (then ``index`` picks the pair; default: the worst one).
        ``None`` gives an empty figure with a note.
    max_cells : int
        At most this many rows and columns are drawn (a window around the worst element).

    Returns
    -------
    plotly.graph_objects.Figure
        Traces: the heatmaps named after :data:`PANELS`, then three ``"worst element"``
        markers.
    """
    pair = pick_pair(obj, index) if obj is not None else None
    if pair is None or pair.analytic.size == 0:
        return empty_figure(
            "no gradcheck result to show" if pair is None else f"{pair.label}: nothing to check"
        )
    r0, r1, c0, c1 = window(pair, max_cells)
    text = _hover(pair, r0, r1, c0, c1)
    fig = make_subplots(rows=1, cols=3, subplot_titles=PANELS, horizontal_spacing=0.06)
    m = _add_heatmaps(fig, pair, (r0, r1, c0, c1), text)
    r, c = pair.worst
    for j in range(1, 4):
        fig.add_trace(_worst_marker(r, c, text[r - r0][c - c0]), row=1, col=j)
    _label_axes(fig, pair)
    shown = ""
    R, C = pair.analytic.shape
    if (r1 - r0, c1 - c0) != (R, C):
        shown = f" (rows {r0}-{r1 - 1} of {R}, columns {c0}-{c1 - 1} of {C})"
    color = VERDICT_COLOR.get(pair.verdict, "black")
    fig.update_layout(
        title={
            "text": f"{pair.label}: <span style='color:{color}'>{pair.verdict}</span>{shown}",
            "x": 0.01,
        },
        coloraxis={
            "colorscale": "RdBu_r",
            "cmin": -m,
            "cmax": m,
            "colorbar": {"title": {"text": "value"}, "thickness": 12},
        },
        height=height,
        margin={"l": 60, "r": 20, "t": 70, "b": 50},
    )
    return fig


def _add_heatmaps(
    fig: go.Figure, pair: PairCheck, shown: tuple[int, int, int, int], text: list[list[str]]
) -> float:
    """The three heatmaps of the ``shown`` window ``(r0, r1, c0, c1)`` on one colour axis;
    returns the axis' half range (the largest finite magnitude, 1 when there is none)."""
    r0, r1, c0, c1 = shown
    a = pair.analytic[r0:r1, c0:c1]
    n = pair.numerical[r0:r1, c0:c1]
    d = np.abs(a - n)
    blocks = [_finite(a), _finite(n), _finite(d)]
    m = (
        max((float(np.nanmax(np.abs(b))) for b in blocks if np.isfinite(b).any()), default=1.0)
        or 1.0
    )
    xs = list(range(c0, c1))
    ys = list(range(r0, r1))
    heatmaps = [
        go.Heatmap(
            z=z,
            x=xs,
            y=ys,
            name=name,
            coloraxis="coloraxis",
            text=text,
            hovertemplate=f"<b>{name}</b><br>%{{text}}<br>value %{{z:.4g}}<extra></extra>",
        )
        for name, z in zip(PANELS, blocks)
    ]
    fig.add_traces(heatmaps, rows=[1, 1, 1], cols=[1, 2, 3])
    return m


def _worst_marker(row: int, col: int, hover: str) -> go.Scatter:
    """The outline of the worst element (on each of the three heatmaps)."""
    return go.Scatter(
        x=[col],
        y=[row],
        mode="markers",
        name=WORST_TRACE,
        showlegend=False,
        marker={
            "symbol": "square-open",
            "size": 16,
            "color": "black",
            "line": {"width": 3},
        },
        hovertemplate=f"worst element<br>{hover}<extra></extra>",
    )


def _label_axes(fig: go.Figure, pair: PairCheck) -> None:
    """x: the input element, y: the output element (rows top down), on all three."""
    in_label = (
        "random projection" if pair.mode == "projections" else f"{pair.input} element (checked)"
    )
    out_label = "" if pair.mode == "projections" else f"{pair.output} element (checked)"
    for j in range(1, 4):
        fig.update_xaxes(title_text=in_label, row=1, col=j)
        fig.update_yaxes(
            autorange="reversed", row=1, col=j, title_text=out_label if j == 1 else None
        )


def empty_figure(message: str, *, height: int = 360) -> go.Figure:
    """A figure with only a centred note (same size as the heatmaps)."""
    fig = go.Figure()
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(
        height=height,
        xaxis={"visible": False},
        yaxis={"visible": False},
        margin={"l": 60, "r": 20, "t": 70, "b": 50},
    )
    return fig


def _finite(z: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(z), z, np.nan)


def _hover(pair: PairCheck, r0: int, r1: int, c0: int, c1: int) -> list[list[str]]:
    if pair.mode == "projections":
        return [[f"projection {c}" for c in range(c0, c1)] for _ in range(r0, r1)]
    outs = [index_text(element_index(int(pair.rows[r]), pair.output_shape)) for r in range(r0, r1)]
    ins = [index_text(element_index(int(pair.cols[c]), pair.input_shape)) for c in range(c0, c1)]
    return [[f"d {pair.output}{o} / d {pair.input}{i}" for i in ins] for o in outs]


__all__ = [
    "PANELS",
    "VERDICT_COLOR",
    "WORST_TRACE",
    "empty_figure",
    "gradcheck_figure",
    "pick_pair",
    "window",
]
