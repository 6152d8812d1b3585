"""The drift panel: a :class:`nbdebug.DriftReport` shown as a widget.

Layout: the headline (what changed, does the model care) with the alarm and the summary,
the exposure bars (each feature's share of the prediction shift), the feature table sorted
by drift with quadrants coloured (HTML, so it renders in every front end), a feature
selector driving the raw / SHAP overlay, the PCA map of SHAP space and the cluster share
bars (stacked, full width: nothing is clipped). Wiring only: every number comes from the
report, every figure from :mod:`nbdebug.figures.drift` through
:class:`~nbdebug.widgets.plot.PlotView`.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets

from ..figures import drift as figs
from ..figures.palette import GREEN, RED
from .plot import PlotView
from .tabs import FeatureTab, TabContext, TabHost, as_table

if TYPE_CHECKING:  # pragma: no cover
    from ..analysis.drift import DriftReport


class DriftPanel:
    """Interactive view of a drift report.

    Parameters
    ----------
    report : DriftReport
    backend : {"auto", "figurewidget", "output"}, optional
        How figures are drawn (see :mod:`nbdebug.widgets.plot`).

    Attributes
    ----------
    widget : ipywidgets.VBox
        Put this in a layout or display it.
    feature : ipywidgets.Dropdown
        The feature shown in the overlay; its options are sorted by drift.
    table : ipywidgets.HTML
        The feature table.
    exposure, overlay, map, shares : PlotView
    """

    def __init__(self, report: DriftReport, *, backend: str | None = None):
        from ..analysis.drift import DriftReport

        if not isinstance(report, DriftReport):
            raise TypeError(
                f"DriftPanel needs a DriftReport (from nbdebug.drift); got "
                f"{type(report).__qualname__}."
            )
        self.report = report
        order = [str(f) for f in report.features.index]
        quadrants = list(report.features["quadrant"])
        self.summary = widgets.HTML(self._summary_html())
        self.exposure = PlotView(figs.exposure_bars(report), backend=backend)
        self.table = widgets.HTML(
            figs.feature_table_html(report),
            layout=widgets.Layout(max_height="420px", overflow="auto"),
        )
        self.feature = widgets.Dropdown(
            options=[(f"{f}  [{q}]", f) for f, q in zip(order, quadrants)],
            value=order[0],
            description="feature",
            layout=widgets.Layout(width="420px"),
        )
        self.overlay = PlotView(figs.feature_overlay(report, order[0]), backend=backend)
        self.map = PlotView(figs.shap_map(report, max_points=20_000), backend=backend)
        self.shares = PlotView(figs.cluster_shares(report), backend=backend)
        self.feature.observe(self._on_feature, names="value")
        self.widget = widgets.VBox(
            [
                self.summary,
                self.exposure.widget,
                self.table,
                widgets.VBox([self.feature, self.overlay.widget]),
                self.map.widget,
                self.shares.widget,
            ]
        )

    def _summary_html(self) -> str:
        r = self.report
        color = RED if r.alarm else GREEN
        badge = "DRIFT" if r.alarm else "no drift"
        rest = (
            r.details[len(r.headline) :].strip() if r.details.startswith(r.headline) else r.details
        )
        return (
            f'<div style="line-height:1.4"><span style="background:{color};color:white;'
            f'padding:2px 8px;border-radius:4px;font-weight:bold">{badge}</span> '
            f"<b>{html.escape(r.headline)}</b>"
            f"<details><summary>details</summary>{html.escape(rest)}</details></div>"
        )

    def select(self, feature: str) -> None:
        """Show ``feature`` in the overlay (same as choosing it in the dropdown)."""
        if feature not in self.report.feature_names:
            raise ValueError(
                f"unknown feature {feature!r}; expected one of {self.report.feature_names[:5]}..."
            )
        self.feature.value = feature

    def _on_feature(self, change: dict[str, Any]) -> None:
        feature = change["new"]
        new = figs.feature_overlay(self.report, feature)
        with self.overlay.batch_update() as f:
            for old, tr in zip(f.data, new.data):
                old.x = tr.x
            for ann, text in zip(f.layout.annotations, figs.overlay_titles(self.report, feature)):
                ann.text = text

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def __repr__(self) -> str:
        return (
            f"DriftPanel(alarm={self.report.alarm}, feature={self.feature.value!r}, "
            f"features={len(self.report.feature_names)})"
        )


def build_tab(dbg: TabHost, ctx: TabContext) -> None:
    """The Drift tab: the reference batch against the debugger's current batch."""
    if ctx.model is None or ctx.inputs is None:
        raise TypeError(
            "reference= needs the model and its current batch "
            "(debug(model, inputs, reference=...))."
        )
    from ..analysis.drift import drift

    report = drift(ctx.model, ctx.reference, as_table(ctx.inputs))
    dbg.add_tab("Drift", DriftPanel(report, backend=ctx.backend))
    # a red DRIFT badge in the tab: the header's badge is then not a green "healthy"
    dbg.set_warned("Drift", report.alarm)


FEATURE_TAB = FeatureTab(
    "Drift", applies=lambda ctx: ctx.reference is not None, build=build_tab, order=30
)
