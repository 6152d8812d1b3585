"""Gradient flow over time: a parameter x step heatmap of the guard's per-layer signals.

:func:`flow_figure` draws, for a live :class:`~nbdebug.NaNGuard`, a snapshot (its stored
history and signals) or a directory of snapshots (their histories merged), one heatmap
per signal (each parameter's gradient norm; its update ratio ``||dw|| / ||w||``) over the
steps held, coloured by each parameter's robust z-score; above them a strip of the steps
the guard flagged (spikes, skipped updates, non-finite steps, steps with a snapshot); a
ring on the cell where each spike began and a dotted line at each spike. The numbers and
their rules are :mod:`nbdebug.core.flow`'s.

Colour: red above the parameter's median, blue below, saturated from the threshold on; a
cell not measured (NaN) is left out, so the grey background shows through: never a
colour of its own, never the white of ``z = 0``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..core.flow import MAX_PARAMS, Z_THRESHOLD, FlowData, flow_data
from .palette import BLACK, LIGHT_GREY, ORANGE, RED

__all__ = ["MARKS", "PANELS", "flow_figure"]

#: (signal, panel title) in display order
PANELS: tuple[tuple[str, str], ...] = (
    ("grad_norm", "gradient norm"),
    ("update_ratio", "update ratio ||dw||/||w||"),
)
#: the marks of the strip above the heatmaps, top to bottom
MARKS = ("spike", "skipped", "non-finite", "snapshot")
_Z_CAP = 99.0  # z drawn at most (JSON has no inf); the colour saturates long before


def _short(name: str, width: int = 36) -> str:
    return name if len(name) <= width else "…" + name[-(width - 1) :]


def _sig4(a: np.ndarray) -> np.ndarray:
    """Values to 4 significant digits (a smaller figure to send; the hover shows 4)."""
    a = np.asarray(a, dtype=np.float64)
    with np.errstate(all="ignore"):
        ok = np.isfinite(a) & (a != 0)
        mag = np.where(ok, np.floor(np.log10(np.where(ok, np.abs(a), 1.0))), 0.0)
        scale = 10.0 ** (3 - mag)
        return np.where(ok, np.round(a * scale) / scale, a)


def _colour_axis(threshold: float, domain: tuple[float, float]) -> dict[str, Any]:
    """A diverging scale centred on 0, saturated red from the threshold on."""
    top = 1.5 * threshold
    t = 0.5 + 0.5 * threshold / top
    scale = [[0.0, "#2166ac"], [0.5, "#f7f7f7"], [t, "#f4a582"], [t, "#d6604d"], [1.0, "#67001f"]]
    return {
        "colorscale": scale,
        "cmin": -top,
        "cmax": top,
        "colorbar": {
            "title": {"text": "robust z", "side": "right"},
            "tickvals": [-top, -threshold, 0, threshold, top],
            "ticktext": [f"≤{-top:g}", f"{-threshold:g}", "0", f"{threshold:g}", f"≥{top:g}"],
            "len": domain[1] - domain[0],
            "y": (domain[0] + domain[1]) / 2,
            "yanchor": "middle",
            "thickness": 12,
        },
    }


def _headline(data: FlowData) -> str:
    """The first spike with a known origin (else the first spike), and how many runs."""
    if not data.spike_runs:
        return "no spike flagged"
    n = len(data.spike_runs)
    runs = f" · {n} runs of spikes" if n > 1 else ""
    if not data.origins:
        first = data.spike_runs[0]
        return f"spike at step {first}: no single parameter above z {data.threshold:g}{runs}"
    o = data.origins[0]
    who = _short(o.parameter, 40)
    return f"spike at step {o.spike_step}: {who} crossed first (step {o.step}){runs}"


def _strip(fig: go.Figure, data: FlowData) -> None:
    """The flagged steps, one row of marks each (row 1)."""
    marks = {
        "spike": (data.spikes, "triangle-down", RED),
        "skipped": (data.skipped, "x", ORANGE),
        "non-finite": (data.nonfinite, "x-thin-open", RED),
        "snapshot": (list(data.snapshots), "square", BLACK),
    }
    for mark in MARKS:
        steps, symbol, colour = marks[mark]
        text = [Path(data.snapshots[s]).name for s in steps] if mark == "snapshot" else None
        fig.add_trace(
            go.Scatter(
                x=steps,
                y=[mark] * len(steps),
                name=mark,
                mode="markers",
                marker={"symbol": symbol, "size": 10, "color": colour, "line": {"width": 2}},
                text=text,
                hovertemplate=f"step %{{x}}: {mark}"
                + (" %{text}" if text is not None else "")
                + "<extra></extra>",
            ),
            row=1,
            col=1,
        )
    fig.update_yaxes(
        type="category", categoryarray=list(MARKS), range=[len(MARKS) - 0.5, -0.5], row=1, col=1
    )


def _heatmap(fig: go.Figure, data: FlowData, signal: str, title: str, row: int) -> None:
    z = np.clip(np.round(data.z[signal], 2), -_Z_CAP, _Z_CAP)
    fig.add_trace(
        go.Heatmap(
            x=data.steps,
            y=data.names,
            z=z.T,
            customdata=_sig4(data.values[signal]).T,
            coloraxis="coloraxis",
            hoverongaps=False,
            name=signal,
            hovertemplate=f"%{{y}}<br>step %{{x}}<br>{title} %{{customdata:.4g}}"
            "<br>robust z %{z:.2f}<extra></extra>",
        ),
        row=row,
        col=1,
    )
    suffix = "" if row == 1 else str(row)
    # a cell not measured is left out: the grey below shows through (never a colour)
    fig.add_shape(
        type="rect",
        xref=f"x{suffix} domain",
        yref=f"y{suffix} domain",
        x0=0,
        x1=1,
        y0=0,
        y1=1,
        fillcolor=LIGHT_GREY,
        line={"width": 0},
        layer="below",
    )
    small = len(data.names) > 20
    fig.update_yaxes(
        tickvals=data.names,
        ticktext=[_short(n) for n in data.names],
        tickfont={"size": 9 if small else 11},
        autorange="reversed",
        automargin=True,
        row=row,
        col=1,
    )


def _origins(fig: go.Figure, data: FlowData) -> None:
    """A ring on the cell where each spike began, and a dashed line at each spike."""
    if "grad_norm" in data.z and data.origins:
        fig.add_trace(
            go.Scatter(
                x=[o.step for o in data.origins],
                y=[o.parameter for o in data.origins],
                name="origin",
                mode="markers",
                marker={"symbol": "circle-open", "size": 14, "color": BLACK, "line": {"width": 2}},
                text=[o.sentence(data.threshold) for o in data.origins],
                hovertemplate="%{text}<extra></extra>",
            ),
            row=2,
            col=1,
        )
    for s in data.spike_runs[:20]:
        fig.add_vline(x=s, line={"color": RED, "dash": "dot", "width": 1}, row="all", col=1)


def flow_figure(
    source: object, *, threshold: float = Z_THRESHOLD, max_params: int = MAX_PARAMS
) -> go.Figure:
    """Gradient flow over time: the parameter x step heatmaps (rules: module docstring).

    Parameters
    ----------
    source : NaNGuard, Snapshot, str, os.PathLike, FlowSource or FlowData
        A live guard, a snapshot (or its path), a directory of snapshots
        (:func:`flow_source`), or the numbers already computed (:func:`flow_data`).
    threshold : float
        The z a parameter crosses (default: the spike detector's, 6).
    max_params : int
        Rows shown at most (default 30; then the top ones by max |z|, the rule in the
        first panel's title).

    Returns
    -------
    plotly.graph_objects.Figure
        Row 1: the flagged steps (scatter traces ``"spike"``, ``"skipped"``,
        ``"non-finite"``, ``"snapshot"``); then one heatmap per measured signal (named
        ``"grad_norm"``, ``"update_ratio"``: ``z`` the robust z, parameters x steps,
        ``customdata`` the values), the ``"origin"`` rings in the first, a dotted line at
        each spike. The title names where the first spike began.
    """
    data = (
        source
        if isinstance(source, FlowData)
        else flow_data(source, threshold=threshold, max_params=max_params)
    )
    panels = [(k, t) for k, t in PANELS if k in data.z]
    panel_px = max(150, 12 * len(data.names) + 30)
    strip_px, gap_px, top_px, bottom_px = 80, 44, 80, 50
    plot_px = strip_px + len(panels) * (panel_px + gap_px)
    first_title = f"{panels[0][1]}: robust z per parameter ({data.rule})"
    fig = make_subplots(
        rows=1 + len(panels),
        cols=1,
        shared_xaxes=True,
        row_heights=[strip_px] + [panel_px] * len(panels),
        vertical_spacing=gap_px / plot_px,
        subplot_titles=["flagged steps", first_title]
        + [f"{t}: robust z per parameter" for _, t in panels[1:]],
    )
    _strip(fig, data)
    for row, (signal, title) in enumerate(panels, start=2):
        _heatmap(fig, data, signal, title, row)
    _origins(fig, data)
    last = fig.layout[f"yaxis{1 + len(panels)}"].domain
    top = fig.layout["yaxis2"].domain
    fig.update_xaxes(title_text="step", row=1 + len(panels), col=1)
    fig.update_layout(
        title={"text": f"<b>gradient flow</b> · {_headline(data)}", "x": 0.01, "xanchor": "left"},
        coloraxis=_colour_axis(data.threshold, (last[0], top[1])),
        height=plot_px + top_px + bottom_px,
        margin={"l": 10, "r": 20, "t": top_px, "b": bottom_px},
        showlegend=False,
        hovermode="closest",
        template="plotly_white",
    )
    return fig
