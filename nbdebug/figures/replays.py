"""The counterfactual replays over steps of a diagnosis, as one figure.

:func:`replays_figure` draws the loss and the gradient norm over the rewind window and
the steps beyond the failure, one curve per replay (:class:`~nbdebug.analysis.diagnose.
interventions.StepsReplay`), on log axes (linear when a value is not positive). A
non-finite value, which plotly cannot draw, is a cross in the replay's colour at the top
of its panel, never a 0; the healthy band's upper edge is a dashed line, the failing step
a vertical one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..analysis.diagnose.interventions import BAND_Z, Intervention, StepsReplay
from ..analysis.diagnose.over_steps import OverSteps
from ..core.text import fmt_num
from .palette import BLACK, BLUE, GREEN, GREY, OK, ORANGE, PURPLE, RED

__all__ = ["STYLES", "replays_figure"]

#: (colour, dash) per intervention: fixes solid, the tests of where the failure lies dotted.
STYLES: dict[Intervention, tuple[str, str]] = {
    Intervention.PLAIN: (BLACK, "solid"),
    Intervention.LOWER_LR: (BLUE, "solid"),
    Intervention.CLIP_GRAD: (ORANGE, "solid"),
    Intervention.SKIP_BATCH: (GREEN, "solid"),
    Intervention.RESET_MOMENTS: (PURPLE, "solid"),
    Intervention.EARLIER_STATE: (GREY, "dot"),
    Intervention.SAME_STATE: (GREY, "dash"),
}

_PANELS = (("loss", "loss"), ("grad_norm", "gradient norm"))


def _values(r: StepsReplay, key: str) -> list[float]:
    return list(r.loss if key == "loss" else r.grad_norm)


def _top(replays: Sequence[StepsReplay], key: str, log: bool, edge: float | None) -> float:
    """Where a non-finite value is drawn: above every finite value of the panel."""
    vals = [v for r in replays for v in _values(r, key) if math.isfinite(v)]
    vals += [edge] if edge is not None and math.isfinite(edge) else []
    if not vals:
        return 1.0
    hi, lo = max(vals), min(vals)
    return hi * 3.0 if log else hi + 0.1 * ((hi - lo) or abs(hi) or 1.0)


def _edge(over: OverSteps, key: str) -> float | None:
    ref = over.band
    med, mad = (ref.loss, ref.loss_mad) if key == "loss" else (ref.grad_norm, ref.grad_norm_mad)
    if med is None:
        return None
    return med + BAND_Z * (mad if mad is not None else 0.1 * abs(med))


def _add_replay(fig: go.Figure, r: StepsReplay, key: str, row: int, top: float) -> None:
    colour, dash = STYLES.get(r.intervention, (GREY, "solid"))
    ys = _values(r, key)
    shown = [v if math.isfinite(v) else None for v in ys]
    label = f"{r.intervention}: {r.change}"
    plain = r.intervention is Intervention.PLAIN
    fig.add_trace(
        go.Scatter(
            x=r.steps,
            y=shown,
            name=str(r.intervention),
            legendgroup=str(r.intervention),
            showlegend=row == 1,
            mode="lines+markers",
            # the plain replay broad and pale underneath: a fix that follows it shows
            line={"color": colour, "dash": dash, "width": 5 if plain else 2},
            opacity=0.4 if plain else 1.0,
            marker={"size": 4},
            text=[label] * len(ys),
            hovertemplate="%{text}<br>step %{x}: %{y:.4g}<extra></extra>",
        ),
        row=row,
        col=1,
    )
    bad = [(s, v) for s, v in zip(r.steps, ys) if not math.isfinite(v)]
    if bad:
        fig.add_trace(
            go.Scatter(
                x=[s for s, _ in bad],
                y=[top] * len(bad),
                name=f"{r.intervention} non-finite",
                legendgroup=str(r.intervention),
                showlegend=False,
                mode="markers",
                marker={"symbol": "x", "size": 11, "color": colour, "line": {"width": 1}},
                text=[f"{label}: {fmt_num(v)}" for _, v in bad],
                hovertemplate="%{text}<br>step %{x}<extra></extra>",
            ),
            row=row,
            col=1,
        )


def replays_figure(over: OverSteps) -> go.Figure:
    """Loss and gradient norm of every replay over steps.

    Parameters
    ----------
    over : OverSteps
        ``Diagnosis.over_steps`` (a snapshot with a rewind window).

    Returns
    -------
    plotly.graph_objects.Figure
        Two rows sharing the step axis (``loss``, ``gradient norm``); one trace per replay
        that ran, named after its intervention, and one ``"<intervention> non-finite"``
        marker trace where it went non-finite; the title is the verdict.

    Raises
    ------
    TypeError
        ``over`` is not an :class:`~nbdebug.analysis.diagnose.over_steps.OverSteps`.
    """
    if not isinstance(over, OverSteps):
        raise TypeError(
            f"replays_figure expects the OverSteps of a diagnosis (d.over_steps); got "
            f"{type(over).__qualname__}."
        )
    ran = [r for r in over.replays if r.steps]
    fig = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.1,
        subplot_titles=["loss", "gradient norm"],
    )
    for row, (key, _) in enumerate(_PANELS, start=1):
        finite = [v for r in ran for v in _values(r, key) if math.isfinite(v)]
        log = bool(finite) and min(finite) > 0
        edge = _edge(over, key)
        top = _top(ran, key, log, edge)
        for r in ran:
            _add_replay(fig, r, key, row, top)
        if edge is not None:
            fig.add_hline(y=edge, line={"color": OK, "dash": "dash", "width": 1}, row=row, col=1)
        if log:
            fig.update_yaxes(type="log", row=row, col=1)
    fig.add_vline(
        x=over.failing_step, line={"color": RED, "dash": "dash", "width": 1.5}, row="all", col=1
    )
    verdict = f"verdict: {over.verdict}" if over.verdict is not None else "no verdict"
    fig.update_xaxes(title_text="step", row=2, col=1)
    fig.update_layout(
        title={"text": f"replays over steps from step {over.start_step} ({verdict})", "x": 0.0},
        height=520,
        margin={"l": 60, "r": 20, "t": 70, "b": 40},
        hovermode="closest",
        template="plotly_white",
        legend={"orientation": "h", "y": -0.15},
    )
    return fig
