"""Figures of a :class:`nbdebug.DriftReport`: pure functions, report in,
``plotly.graph_objects.Figure`` out (usable in a static HTML report and in the panel).

* :func:`feature_table_html`: features sorted by drift, quadrant and KS columns coloured
  (HTML: renders in every front end);
* :func:`exposure_bars`: each feature's share of the prediction shift;
* :func:`feature_overlay`: reference vs current distribution of one feature, raw and SHAP;
* :func:`shap_map`: 2-D PCA map of the SHAP rows, colour = cluster, marker = batch;
* :func:`cluster_shares`: each cluster's share of the reference and of the current batch.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from ..analysis.drift.exposure import EXPOSED_QUADRANTS, EXPOSURE_MIN
from ..core.text import fmt_num
from .palette import BLUE, LIGHT_GREY, MUTED_TEXT, ORANGE

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


TABLE_COLUMNS = {
    "quadrant": ("quadrant", ""),
    "exposure_share": ("share of prediction shift", ".0%"),
    "exposure": ("exposure", ".3g"),
    "exposure_noise": ("noise", ".2g"),
    "ks": ("KS input", ".3f"),
    "ks_p_adj": ("p adj input", ".2g"),
    "wasserstein": ("W / σ", ".2f"),
    "shap_ks": ("KS SHAP", ".3f"),
    "shap_importance": ("mean |SHAP|", ".3g"),
}


def feature_table_html(report: DriftReport, *, max_rows: int | None = None) -> str:
    """The feature table as HTML (pandas Styler), in the report's order (flagged first,
    then by exposure share). The feature and quadrant cells carry the quadrant colour, the
    share and KS cells a heat colour. HTML renders the same in JupyterLab, Notebook 7,
    VS Code, Colab and a static page (a plotly ``go.Table`` inside a ``FigureWidget``
    drops text with spaces in JupyterLab)."""
    f = report.features if max_rows is None else report.features.head(max_rows)
    # the feature is a column (a named index would add a header row with blank cells)
    shown = pd.DataFrame(
        {
            "feature": [str(i) for i in f.index],
            **{
                label: [fmt_num(v, spec, nan="–") if spec else str(v) for v in f[col]]
                for col, (label, spec) in TABLE_COLUMNS.items()
            },
        }
    )
    quad = list(f["quadrant"])
    heat = {
        "share of prediction shift": [heat_color(float(v), 1.0) for v in f["exposure_share"]],
        "KS input": [heat_color(float(v), 1.0) for v in f["ks"]],
        "KS SHAP": [heat_color(float(v), 1.0) for v in f["shap_ks"]],
    }

    def colours(frame: pd.DataFrame) -> pd.DataFrame:
        out = pd.DataFrame("", index=frame.index, columns=frame.columns)
        out["quadrant"] = [f"background-color: {quadrant_color(q)}" for q in quad]
        out["feature"] = [f"background-color: {quadrant_color(q)}; font-weight: bold" for q in quad]
        for col, fills in heat.items():
            out[col] = [f"background-color: {c}" for c in fills]
        return out

    styler = (
        shown.style.apply(colours, axis=None)
        .hide(axis="index")
        .set_caption(
            f"Features by drift ({report.correction}-corrected at alpha={report.alpha:g}; "
            f"exposure in {report.output})"
        )
        .set_table_styles(
            [
                {"selector": "", "props": "border-collapse: collapse; font-size: 12px;"},
                {"selector": "th, td", "props": "padding: 2px 8px; text-align: left;"},
                {"selector": "caption", "props": "caption-side: top; font-weight: bold;"},
                {"selector": "thead th", "props": f"background-color: {LIGHT_GREY};"},
            ]
        )
    )
    return styler.to_html()


def exposure_bars(report: DriftReport, *, top: int = 12) -> go.Figure:
    """Each feature's share of the prediction shift (its exposure above noise), largest
    first, coloured by quadrant; hover gives the exposure and its noise in output units.
    When no feature's exposure is material (see :mod:`nbdebug.analysis.drift.exposure`),
    the shares only divide up noise: the bars are grey and the title says so."""
    f = report.features.sort_values("exposure_share", ascending=False, kind="stable").head(top)
    f = f.iloc[::-1]  # largest at the top of a horizontal bar chart
    material = bool(report.features["quadrant"].isin(EXPOSED_QUADRANTS).any())
    title = "Share of the prediction shift, by feature"
    if not material:
        title += (
            f"<br><sup>no feature moves predictions materially (each within noise or under "
            f"{EXPOSURE_MIN:.0%} of the output's spread): the shares divide up noise</sup>"
        )
    fig = go.Figure(
        go.Bar(
            x=f["exposure_share"].to_numpy(),
            y=[str(i) for i in f.index],
            orientation="h",
            marker_color=[
                quadrant_color(q, 0.8) if q != "none" and material else LIGHT_GREY
                for q in f["quadrant"]
            ],
            marker_line=dict(color=MUTED_TEXT, width=0.5),
            text=[f"{v:.0%}" for v in f["exposure_share"]],
            textposition="outside",
            customdata=np.c_[f["exposure"].to_numpy(), f["exposure_noise"].to_numpy()],
            hovertext=list(f["quadrant"]),
            hovertemplate="%{y}: %{x:.0%} of the prediction shift<br>exposure %{customdata[0]:.3g}"
            " (noise %{customdata[1]:.2g})<br>%{hovertext}<extra></extra>",
        )
    )
    fig.update_layout(
        title=dict(text=title, x=0, xanchor="left"),
        xaxis=dict(
            tickformat=".0%", range=[0, min(1.0, float(f["exposure_share"].max()) * 1.25 + 0.05)]
        ),
        yaxis=dict(automargin=True),
        height=max(220, 60 + 24 * len(f) + (0 if material else 20)),
        margin=dict(l=10, r=30, t=40 if material else 60, b=30),
        showlegend=False,
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
        f"`{feature}` input<br>KS {row['ks']:.2f}, p adj {row['ks_p_adj']:.2g}",
        f"`{feature}` SHAP<br>exposure {row['exposure']:.3g} "
        f"({row['exposure_share']:.0%} of shift)",
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
    fig.update_annotations(font_size=12)
    fig.update_layout(
        barmode="overlay",
        height=340,
        margin=dict(l=40, r=10, t=60, b=40),
        legend=dict(orientation="h", y=-0.25, x=0),
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
        title=dict(text="SHAP space (PCA): colour = cluster, ○ reference, × current", x=0),
        xaxis_title=f"PC1 ({v[0]:.0%} of SHAP variance)",
        yaxis_title=f"PC2 ({v[1]:.0%})",
        height=460,
        autosize=True,
        margin=dict(l=50, r=20, t=50, b=40),
        legend=dict(orientation="h", x=0, y=-0.18, yanchor="top"),
    )
    return fig


def cluster_shares(report: DriftReport) -> go.Figure:
    """Each cluster's share of the reference and of the current batch (grouped horizontal
    bars, one row per cluster named by what defines it)."""
    t = report.clusters
    labels = [f"C{c}: {n}" for c, n in zip(t.index, t["name"])]
    fig = go.Figure(
        [
            go.Bar(
                y=labels,
                x=t[col].to_numpy(),
                name=batch,
                orientation="h",
                marker_color=color,
                text=[f"{v:.0%}" for v in t[col]],
                textposition="outside",
            )
            for col, batch, color in (
                ("share_reference", "reference", REFERENCE_COLOR),
                ("share_current", "current", CURRENT_COLOR),
            )
        ]
    )
    ct = report.cluster_test
    top = float(max(t["share_reference"].max(), t["share_current"].max())) if len(t) else 1.0
    fig.update_layout(
        barmode="group",
        title=dict(
            text=f"Cluster shares: permutation p={ct.p_value:.3g} (corrected {ct.p_adjusted:.3g})",
            x=0,
        ),
        xaxis=dict(tickformat=".0%", title="share of batch", range=[0, min(1.0, top * 1.2 + 0.05)]),
        yaxis=dict(automargin=True, autorange="reversed"),
        height=max(260, 110 + 48 * len(t)),
        autosize=True,
        margin=dict(l=10, r=20, t=50, b=40),
        legend=dict(orientation="h", x=0, y=-0.15, yanchor="top"),
    )
    return fig
