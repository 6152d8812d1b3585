"""Grad/weight norm ratio per parameter: a bar plot on a log axis with the vanishing and
exploding bands shaded."""

from __future__ import annotations

import math

import plotly.graph_objects as go

from ..analysis.checks.base import EXPLODING_RATIO as EXPLODING
from ..analysis.checks.base import VANISHING_RATIO as VANISHING
from ..analysis.checks.grad import param_verdict
from ..core.text import fmt_num
from ..core.trace.result import Trace, shown_grad_norm
from .palette import BLUE, GREY, PURPLE, RED

#: the ``name`` of the band labels' annotations (in the right margin, beside their bands)
BAND_LABEL = "band label"

# grad norm / weight norm below VANISHING: the gradient vanishes; above EXPLODING: it
# explodes. One judgement (analysis's param_verdict: which parameters can be called so,
# and what their ratio says) for the plot and the health checks.


def ratio_figure(trace: Trace) -> go.Figure:
    """Bar per parameter of ``grad_norm / norm`` on a log y axis.

    Parameters
    ----------
    trace : Trace
        Its ``params`` (one :class:`~nbdebug.core.trace.events.ParamInfo` each) are plotted in
        model order. Parameters without a gradient are left out; zero ratios and
        zero weights (undefined ratio) get no bar; non-finite gradients are drawn full height in
        red, with the reason on hover. A bar is red where the health checks flag the
        parameter (:func:`~nbdebug.analysis.checks.grad.param_verdict`), grey where they do
        not judge its ratio (a bias or norm scale, an embedding), blue otherwise.

    Returns
    -------
    plotly.graph_objects.Figure
        One bar trace named ``"grad/weight"``; the bands below ``VANISHING`` and above
        ``EXPLODING`` are shaded and labelled in the right margin (annotations named
        :data:`BAND_LABEL`), where no bar can cover the label.
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"ratio_figure expects an nbdebug Trace; got {type(trace).__qualname__}.")
    params = [p for p in trace.params if p.ratio is not None]
    good = [r for p in params if (r := p.ratio) is not None and 0 < r < math.inf]
    lo = min([*good, VANISHING]) / 10
    hi = max([*good, EXPLODING]) * 10
    names, ys, colors, texts = [], [], [], []
    for p in params:
        r = p.ratio
        assert r is not None
        bad_grad = p.grad_n_nan + p.grad_n_inf
        if bad_grad:  # a non-finite gradient: full height, red
            y, color = hi, RED
            note = f"grad NaN {p.grad_n_nan}, Inf {p.grad_n_inf}"
        elif math.isnan(r):  # a zero weight: the ratio is undefined, no bar
            y, color = None, GREY
            note = "weight norm 0: no ratio"
        else:
            y = min(max(r, lo), hi)
            verdict = param_verdict(p, trace.module_types.get(p.module, ""))
            color = {"vanishing": RED, "exploding": RED, "not judged": GREY}.get(verdict, BLUE)
            note = f"ratio {r:.3g}" + (" (not judged: 1-D or sparse)" if color == GREY else "")
        names.append(p.name)
        ys.append(y)
        colors.append(color)
        texts.append(
            f"{p.name} {tuple(p.shape)}<br>norm {fmt_num(p.norm)}, grad norm "
            f"{fmt_num(shown_grad_norm(p), nan='NaN')}<br>{note}"
        )
    fig = go.Figure(
        go.Bar(
            x=names,
            y=ys,
            marker={"color": colors},
            text=texts,
            textposition="none",
            hovertemplate="%{text}<extra></extra>",
            name="grad/weight",
        )
    )
    llo, lhi = math.log10(lo), math.log10(hi)
    bands = (
        (lo, VANISHING, PURPLE, f"vanishing<br>< {VANISHING:g}"),
        (EXPLODING, hi, RED, f"exploding<br>> {EXPLODING:g}"),
    )
    for y0, y1, color, label in bands:
        fig.add_hrect(y0=y0, y1=y1, fillcolor=color, opacity=0.12, line_width=0)
        # the label sits in the right margin, beside its band, where no bar can cover it;
        # annotations on a log axis take log10 coordinates (shapes take data values)
        fig.add_annotation(
            x=1,
            xref="paper",
            xanchor="left",
            xshift=6,
            y=(math.log10(y0) + math.log10(y1)) / 2,
            yanchor="middle",
            align="left",
            text=label,
            showarrow=False,
            font={"color": color, "size": 11},
            name=BAND_LABEL,
        )
    fig.update_layout(
        title={"text": "Gradient / weight norm per parameter", "x": 0.01},
        # ticks as 1e-05, like the band labels (plotly's default reads "10μ")
        yaxis={
            "type": "log",
            "title": "grad norm / weight norm",
            "range": [llo, lhi],
            "exponentformat": "e",
        },
        xaxis={"tickangle": -45},
        height=380,
        margin={"l": 60, "r": 90, "t": 40, "b": 110},
        template="plotly_white",
        showlegend=False,
    )
    return fig
