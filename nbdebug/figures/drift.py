"""Figures of a :class:`nbdebug.analysis.drift.DriftReport`: pure functions, report in,
``plotly.graph_objects.Figure`` out (usable in a static HTML report and in the panel).

* :func:`feature_table`: features sorted by drift, quadrant and KS columns coloured;
* :func:`feature_overlay`: reference vs current distribution of one feature, raw and SHAP;
* :func:`shap_map`: 2-D PCA map of the SHAP rows, colour = cluster, marker = batch;
* :func:`cluster_shares`: each cluster's share of the reference and of the current batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from ..core.text import fmt_num
from .palette import BLUE, LIGHT_GREY, ORANGE

if TYPE_CHECKING:  # pragma: no cover
    from ..analysis.drift import DriftReport

REFERENCE_COLOR = BLUE
CURRENT_COLOR = ORANGE
REFERENCE_SYMBOL = "circle"
CURRENT_SYMBOL = "x"
# quadrant -> (r, g, b)
QUADRANT_RGB: dict[str, tuple[int, int, int]] = {
    "input+explanation": (214, 39, 40),
    "input only": (255, 127, 14),
    "explanation only": (148, 103, 189),
    "none": (255, 255, 255),
}
CLUSTER_COLORS = qualitative.Plotly


def quadrant_color(quadrant: str, alpha: float = 0.35) -> str:
    """Fill colour of a quadrant ("none" is white)."""
    r, g, b = QUADRANT_RGB.get(quadrant, (255, 255, 255))
    if quadrant == "none":
        return "rgba(255,255,255,1)"
    return f"rgba({r},{g},{b},{alpha})"


def heat_color(value: float, vmax: float, rgb: tuple[int, int, int] = (214, 39, 40)) -> str:
    """White-to-``rgb`` fill for ``value`` in ``[0, vmax]`` (NaN/negative: white)."""
    if not (isinstance(value, (int, float)) and math.isfinite(value)) or vmax <= 0 or value <= 0:
        return "rgba(255,255,255,1)"
    a = min(1.0, value / vmax) * 0.6
    return f"rgba({rgb[0]},{rgb[1]},{rgb[2]},{a:.3f})"


def cluster_color(c: int) -> str:
    return CLUSTER_COLORS[c % len(CLUSTER_COLORS)]


def feature_table(report: DriftReport, *, max_rows: int | None = None) -> go.Figure:
    """The feature table, in the report's order (flagged first, then by KS).

    The feature and quadrant cells carry the quadrant colour; the KS cells a heat colour.
    """
    f = report.features if max_rows is None else report.features.head(max_rows)
    quad_fill = [quadrant_color(q) for q in f["quadrant"]]
    ks_fill = [heat_color(float(v), 1.0) for v in f["ks"]]
    sks_fill = [heat_color(float(v), 1.0) for v in f["shap_ks"]]
    white = ["rgba(255,255,255,1)"] * len(f)
    header = [
        "feature",
        "quadrant",
        "KS input",
        "p adj",
        "W / σ",
        "KS SHAP",
        "p adj",
        "W / σ SHAP",
        "mean |SHAP|",
    ]
    values = [
        [str(i) for i in f.index],
        list(f["quadrant"]),
        [fmt_num(float(v), ".3f", nan="–") for v in f["ks"]],
        [fmt_num(float(v), ".2g", nan="–") for v in f["ks_p_adj"]],
        [fmt_num(float(v), ".2f", nan="–") for v in f["wasserstein"]],
        [fmt_num(float(v), ".3f", nan="–") for v in f["shap_ks"]],
        [fmt_num(float(v), ".2g", nan="–") for v in f["shap_ks_p_adj"]],
        [fmt_num(float(v), ".2f", nan="–") for v in f["shap_wasserstein"]],
        [fmt_num(float(v), ".3g", nan="–") for v in f["shap_importance"]],
    ]
    fills = [quad_fill, quad_fill, ks_fill, white, white, sks_fill, white, white, white]
    fig = go.Figure(
        go.Table(
            columnwidth=[3, 2.2, 1.2, 1.2, 1.1, 1.2, 1.2, 1.2, 1.3],
            header=dict(values=header, fill_color=LIGHT_GREY, align="left", font=dict(size=12)),
            cells=dict(
                values=values, fill_color=fills, align="left", font=dict(size=11), height=22
            ),
        )
    )
    fig.update_layout(
        title=f"Features by drift ({report.correction}-corrected at alpha={report.alpha:g})",
        margin=dict(l=10, r=10, t=40, b=10),
        height=min(600, 90 + 23 * len(f)),
    )
    return fig


def _index(report: DriftReport, feature: str) -> int:
    try:
        return report.feature_names.index(feature)
    except ValueError:
        raise ValueError(
            f"unknown feature {feature!r}; expected one of the report's "
            f"{len(report.feature_names)} "
            f"features, e.g. {report.feature_names[:3]}."
        ) from None


def overlay_titles(report: DriftReport, feature: str) -> tuple[str, str]:
    """Subplot titles of :func:`feature_overlay` for ``feature``."""
    row = report.features.loc[feature]
    return (
        f"`{feature}` input: KS {row['ks']:.2f}, p adj {row['ks_p_adj']:.2g}",
        f"`{feature}` SHAP: KS {row['shap_ks']:.2f}, p adj {row['shap_ks_p_adj']:.2g}",
    )


def feature_overlay(report: DriftReport, feature: str) -> go.Figure:
    """Reference vs current distribution of one feature: raw values (left) and SHAP
    values (right), as overlaid density histograms on shared bins.

    Traces, in order: reference input, current input, reference SHAP, current SHAP.
    """
    j = _index(report, feature)
    titles = overlay_titles(report, feature)
    fig = make_subplots(rows=1, cols=2, subplot_titles=titles, horizontal_spacing=0.1)
    series = [
        (report.reference[:, j], "reference", REFERENCE_COLOR, 1, "input", True),
        (report.current[:, j], "current", CURRENT_COLOR, 1, "input", True),
        (report.reference_shap[:, j], "reference", REFERENCE_COLOR, 2, "shap", False),
        (report.current_shap[:, j], "current", CURRENT_COLOR, 2, "shap", False),
    ]
    for x, name, color, col, group, legend in series:
        fig.add_trace(
            go.Histogram(
                x=x,
                name=name,
                legendgroup=name,
                showlegend=legend,
                marker_color=color,
                opacity=0.55,
                histnorm="probability density",
                bingroup=group,
                nbinsx=40,
            ),
            row=1,
            col=col,
        )
    fig.update_layout(
        barmode="overlay",
        height=320,
        margin=dict(l=40, r=10, t=50, b=40),
        legend=dict(orientation="h", y=-0.2),
    )
    fig.update_xaxes(title_text="value", row=1, col=1)
    fig.update_xaxes(title_text=f"SHAP ({report.output})", row=1, col=2)
    fig.update_yaxes(title_text="density", row=1, col=1)
    return fig


def shap_map(report: DriftReport, *, max_points: int | None = None) -> go.Figure:
    """2-D PCA map of the pooled SHAP rows: colour = cluster, marker = batch
    (reference: circles, current: crosses). One trace per (cluster, batch), legend
    grouped by cluster. ``max_points`` keeps every n-th row when given."""
    is_cur = report.is_current
    step = 1 if not max_points else max(1, math.ceil(len(is_cur) / max_points))
    fig = go.Figure()
    for c in range(int(report.cluster_test.k)):
        name = str(report.clusters.loc[c, "name"]) if c in report.clusters.index else ""
        for cur, batch, symbol in (
            (False, "reference", REFERENCE_SYMBOL),
            (True, "current", CURRENT_SYMBOL),
        ):
            mask = (report.labels == c) & (is_cur == cur)
            rows = mask.nonzero()[0][::step]
            fig.add_trace(
                go.Scattergl(
                    x=report.pca[rows, 0],
                    y=report.pca[rows, 1],
                    mode="markers",
                    name=f"C{c} {batch}",
                    legendgroup=f"C{c}",
                    marker=dict(color=cluster_color(c), symbol=symbol, size=6, opacity=0.6),
                    customdata=rows,
                    hovertemplate=f"C{c} {batch}, row %{{customdata}}<br>{name}<extra></extra>",
                )
            )
    v = report.pca_variance
    fig.update_layout(
        title="SHAP space (PCA): colour = cluster, ○ reference, × current",
        xaxis_title=f"PC1 ({v[0]:.0%} of SHAP variance)",
        yaxis_title=f"PC2 ({v[1]:.0%})",
        height=420,
        margin=dict(l=40, r=10, t=50, b=40),
    )
    return fig


def cluster_shares(report: DriftReport) -> go.Figure:
    """Each cluster's share of the reference and of the current batch (grouped bars)."""
    t = report.clusters
    labels = [f"C{c}: {n}" for c, n in zip(t.index, t["name"])]
    fig = go.Figure(
        [
            go.Bar(
                x=labels,
                y=t["share_reference"].to_numpy(),
                name="reference",
                marker_color=REFERENCE_COLOR,
                text=[f"{v:.0%}" for v in t["share_reference"]],
            ),
            go.Bar(
                x=labels,
                y=t["share_current"].to_numpy(),
                name="current",
                marker_color=CURRENT_COLOR,
                text=[f"{v:.0%}" for v in t["share_current"]],
            ),
        ]
    )
    ct = report.cluster_test
    fig.update_layout(
        barmode="group",
        title=f"Cluster shares: chi-square p={ct.p_value:.3g} (corrected {ct.p_adjusted:.3g})",
        yaxis=dict(tickformat=".0%", title="share of batch"),
        height=420,
        margin=dict(l=40, r=10, t=50, b=80),
    )
    return fig
