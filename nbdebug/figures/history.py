"""The training history a :class:`~nbdebug.NaNGuard` keeps, as one figure.

:func:`history_figure` stacks one panel per recorded quantity (loss, total gradient
norm, total parameter norm, learning rate, GradScaler scale) over a shared step axis,
marks non-finite values (which plotly cannot draw) with red crosses at the top of their
panel, marks skipped steps, and draws a vertical line at the failing step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..core.text import fmt_num
from .palette import BLUE, ORANGE, RED

if TYPE_CHECKING:
    import pandas as pd

#: (column, panel title) in display order. ``loss`` is always shown; the others only when
#: the history holds at least one value for them.
PANELS: tuple[tuple[str, str], ...] = (
    ("loss", "loss"),
    ("grad_norm", "gradient norm"),
    ("param_norm", "parameter norm"),
    ("lr", "learning rate"),
    ("scale", "GradScaler scale"),
)

_ALWAYS_RECORDED = frozenset({"loss", "grad_norm"})
_LINE = BLUE
_BAD = RED
_SKIP = ORANGE


def _column(history: pd.DataFrame, name: str) -> np.ndarray:
    import pandas as pd

    if name not in history.columns:
        return np.full(len(history), np.nan)
    return pd.to_numeric(history[name], errors="coerce").to_numpy(dtype=float, na_value=np.nan)


def history_figure(history: pd.DataFrame, *, failing_step: int | None = None) -> go.Figure:
    """Plot a guard's rolling history.

    Parameters
    ----------
    history : pandas.DataFrame
        One row per step, as returned by ``Snapshot.history_frame()``: a numeric ``step``
        column and any of ``loss``, ``grad_norm``, ``param_norm``, ``lr``, ``scale``
        (floats; NaN/inf allowed) and ``skipped`` (bool). Other columns are ignored.
    failing_step : int, optional
        Step to mark with a vertical line (the step the snapshot was written at).

    Returns
    -------
    plotly.graph_objects.Figure
        One row per panel, shared x axis ``step``. Traces are named after the column
        (``"loss"``, ``"grad_norm"``, ...); non-finite values are a separate marker trace
        per panel named ``"<column> non-finite"``; skipped steps a trace named
        ``"skipped"`` in the loss panel. A panel uses a log axis when all its finite
        values are positive and span more than 20x (the loss: more than 1000x).

    Raises
    ------
    TypeError
        ``history`` is not a DataFrame.
    ValueError
        ``history`` has no ``step`` column.
    """
    _check_history(history, failing_step)
    steps = _column(history, "step")
    panels = [
        (col, title, _column(history, col))
        for col, title in PANELS
        if col == "loss" or (col in history.columns and history[col].notna().any())
    ]
    fig = make_subplots(
        rows=len(panels),
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.04 if len(panels) > 3 else 0.08,
        subplot_titles=[title for _, title, _ in panels],
    )
    skipped = np.zeros(len(history), dtype=bool)
    if "skipped" in history.columns:
        skipped = history["skipped"].fillna(False).astype(bool).to_numpy()
    for row, (col, title, y) in enumerate(panels, start=1):
        finite = np.isfinite(y)
        shown = np.where(finite, y, np.nan)
        fig.add_trace(_line_trace(steps, shown, col, title), row=row, col=1)
        fin_vals = shown[finite]
        _scale_axis(fig, row, col, fin_vals)
        # Non-finite values sit at the top of the panel: plotly cannot draw inf or NaN.
        # Loss and grad norm are recorded every step, so NaN there is a real NaN; the
        # parameter norm (measured every few steps), learning rate and scale are NaN where
        # not measured, so only inf counts there.
        if col not in history.columns:
            bad = np.zeros(len(y), dtype=bool)
        else:
            bad = ~finite if col in _ALWAYS_RECORDED else np.isinf(y)
        if bad.any():
            top = float(fin_vals.max()) if fin_vals.size else 1.0
            fig.add_trace(_nonfinite_trace(steps[bad], y[bad], top, col, title), row=row, col=1)
        if row == 1 and skipped.any():
            lo = float(fin_vals.min()) if fin_vals.size else 0.0
            fig.add_trace(_skipped_trace(steps[skipped], lo), row=1, col=1)
    if failing_step is not None:
        _mark_failing_step(fig, int(failing_step))
    fig.update_xaxes(title_text="step", row=len(panels), col=1)
    fig.update_layout(
        height=max(260, 170 * len(panels)),
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
        hovermode="x",
        template="plotly_white",
    )
    return fig


def _check_history(history: object, failing_step: object) -> None:
    import pandas as pd

    if not isinstance(history, pd.DataFrame):
        raise TypeError(
            f"history must be a pandas DataFrame (Snapshot.history_frame()); got "
            f"{type(history).__qualname__}."
        )
    if "step" not in history.columns:
        raise ValueError(f"history must have a 'step' column; got columns {list(history.columns)}.")
    if failing_step is not None and not isinstance(failing_step, (int, np.integer)):
        raise TypeError(
            f"failing_step must be an int or None; got {type(failing_step).__qualname__}."
        )


def _line_trace(steps: np.ndarray, shown: np.ndarray, col: str, title: str) -> go.Scatter:
    """A panel's values (NaN where not finite: gaps)."""
    return go.Scatter(
        x=steps,
        y=shown,
        name=col,
        mode="lines+markers" if len(steps) <= 60 else "lines",
        line={"color": _LINE, "width": 1.5},
        marker={"size": 4},
        connectgaps=col not in _ALWAYS_RECORDED,
        showlegend=False,
        hovertemplate=f"step %{{x}}<br>{title} %{{y:.4g}}<extra></extra>",
    )


def _scale_axis(fig: go.Figure, row: int, col: str, fin_vals: np.ndarray) -> None:
    """A log axis when the values span decades (a diverging loss, exploding norms); a
    constant (e.g. a fixed learning rate) centred, so 0.01 does not read as 0."""
    positive = fin_vals.size > 0 and bool((fin_vals > 0).all())
    log = positive and float(fin_vals.max()) / float(fin_vals.min()) > (
        1e3 if col == "loss" else 20
    )
    if log:
        fig.update_yaxes(type="log", row=row, col=1)
    elif fin_vals.size and float(fin_vals.min()) == float(fin_vals.max()):
        v = float(fin_vals[0])
        pad = abs(v) * 0.5 or 1.0
        fig.update_yaxes(range=[v - pad, v + pad], row=row, col=1)


def _nonfinite_trace(
    steps: np.ndarray, values: np.ndarray, top: float, col: str, title: str
) -> go.Scatter:
    """Red crosses at the top of the panel for the non-finite ``values``."""
    return go.Scatter(
        x=steps,
        y=[top] * len(steps),
        name=f"{col} non-finite",
        mode="markers",
        marker={"symbol": "x", "size": 10, "color": _BAD},
        text=[fmt_num(v) for v in values],
        showlegend=False,
        hovertemplate=f"step %{{x}}<br>{title} %{{text}}<extra></extra>",
    )


def _skipped_trace(steps: np.ndarray, low: float) -> go.Scatter:
    """Orange triangles at the bottom of the loss panel for the skipped updates."""
    return go.Scatter(
        x=steps,
        y=[low] * len(steps),
        name="skipped",
        mode="markers",
        marker={"symbol": "triangle-up", "size": 9, "color": _SKIP},
        showlegend=False,
        hovertemplate="step %{x}: update skipped<extra></extra>",
    )


def _mark_failing_step(fig: go.Figure, step: int) -> None:
    """A dashed line through every panel at ``step``, labelled in the top panel."""
    fig.add_vline(x=step, line={"color": _BAD, "dash": "dash", "width": 1.5}, row="all", col=1)
    # inside the top panel, beside the line: above it the label would collide with the
    # panel's title whenever the failing step is mid-history
    fig.add_annotation(
        x=step,
        y=1.0,
        xref="x",
        yref="y domain",
        xanchor="left",
        yanchor="top",
        xshift=4,
        text=f"failing step {step}",
        showarrow=False,
        font={"color": _BAD},
        bgcolor="rgba(255,255,255,0.85)",
    )
