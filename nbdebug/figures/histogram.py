"""Histogram of one event's log10|x| (the 32 fixed bins of
:class:`~nbdebug.core.stats.Histogram`)."""

from __future__ import annotations

import plotly.graph_objects as go

from ..core.trace.events import Event
from .palette import BLUE, RED


def histogram_title(ev: Event) -> str:
    """Title of :func:`histogram_figure`: what the counts cover, zeros and non-finite values."""
    h = ev.hist
    if not h.sampled:
        return (
            f"log10|x| of #{ev.index}: {h.total} values, {h.n_zero} zeros, {h.n_nonfinite} NaN/Inf"
        )
    # the bins and zeros come from the sample; the NaN/Inf count is the tensor's, exact
    return (
        f"log10|x| of #{ev.index}: a sample of {h.total} of {ev.stats.numel} values, "
        f"{h.n_zero} zeros; {ev.stats.n_nonfinite} NaN/Inf in all"
    )


def histogram_bins(ev: Event) -> tuple[list[float], list[int]]:
    """(bin centres, counts) of the event's log10|x| histogram."""
    h = ev.hist
    edges = h.edges
    centres = ((edges[:-1] + edges[1:]) / 2).tolist()
    return centres, [int(c) for c in h.counts]


def histogram_figure(ev: Event) -> go.Figure:
    """Bar chart of the event's log10|x| histogram.

    Parameters
    ----------
    ev : Event
        Any event of a trace; ``ev.hist.counts`` has shape ``(32,)`` over the fixed edges
        ``ev.hist.edges`` (shape ``(33,)``, log10 units).

    Returns
    -------
    plotly.graph_objects.Figure
        One bar trace (x: bin centres in log10 units, y: counts); the title gives the number
        of values, of exact zeros and of NaN/Inf, which have no bin.
    """
    if not isinstance(ev, Event):
        raise TypeError(f"histogram_figure expects an nbdebug Event; got {type(ev).__qualname__}.")
    x, y = histogram_bins(ev)
    width = x[1] - x[0] if len(x) > 1 else 1.0
    fig = go.Figure(
        go.Bar(
            x=x,
            y=y,
            width=width * 0.9,
            marker={"color": BLUE},
            name="log10|x|",
            hovertemplate="log10|x| ~ %{x:.2f}: %{y}<extra></extra>",
        )
    )
    if ev.stats.numel and ev.stats.n_nonfinite == ev.stats.numel:
        # nothing has a bin: say so instead of an empty plot with a -1..1 count axis
        fig.add_annotation(
            text=f"all {ev.stats.numel} values are NaN/Inf (NaN {ev.stats.n_nan}, "
            f"Inf {ev.stats.n_inf}): no finite value to bin",
            xref="paper",
            yref="paper",
            x=0.5,
            y=0.5,
            showarrow=False,
            font={"color": RED},
        )
        fig.update_yaxes(visible=False)
    fig.update_layout(
        title={"text": histogram_title(ev), "x": 0.01, "font": {"size": 12}},
        xaxis={"title": "log10 |x|"},
        yaxis={"title": "count"},
        height=240,
        margin={"l": 50, "r": 10, "t": 40, "b": 40},
        template="plotly_white",
        showlegend=False,
    )
    return fig
