"""The Layers tab: the parameter table (sortable) and the grad/weight ratio bar plot."""

from __future__ import annotations

import html
import math
from collections.abc import Mapping
from typing import Any

import ipywidgets as widgets

from ..analysis.checks.grad import RatioVerdict, param_verdicts, ratio_verdict
from ..core.trace.result import PARAMS_COLUMNS, Trace
from ..figures.layers import EXPLODING, VANISHING, ratio_figure
from .plot import PlotView
from .style import STYLE

#: Columns the table can be sorted by (``Trace.params_frame()`` columns, plus the name).
SORT_COLUMNS = tuple(c for c in PARAMS_COLUMNS if c not in ("shape", "dtype", "requires_grad"))
_SHOWN = tuple(c for c in PARAMS_COLUMNS if c not in ("name", "requires_grad"))


def _cell(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return html.escape(str(v))


def _shown(row: Any, col: str) -> str:
    """A table cell: NaN and inf as such (a NaN gradient is not a zero one), "–" for no
    gradient, "n/a" for the ratio of a zero weight (undefined)."""
    v = row[col]
    if col in ("grad_norm", "ratio") and isinstance(v, float):
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if math.isnan(v):
            if row["grad_n_nan"]:
                return "NaN"
            if col == "ratio" and row["norm"] == 0 and not math.isnan(row["grad_norm"]):
                return "n/a (zero weight)"
    return _cell(v)


def params_table_html(
    frame: Any,
    selected: str | None = None,
    verdicts: Mapping[str, RatioVerdict] | None = None,
) -> str:
    """HTML table of a ``Trace.params_frame()`` (already sorted); rows with a non-finite
    weight or gradient, or a vanishing or exploding ratio, are marked, and the
    ``selected`` parameter is highlighted.

    ``verdicts`` (parameter name -> :func:`~nbdebug.analysis.checks.grad.param_verdict`)
    says which ratios are vanishing or exploding: the Layers panel passes the trace's, so
    the table marks the parameters Checks flags (a bias or a norm scale is not judged).
    Without it a row's ratio is judged alone (``ratio_verdict``)."""
    head = "".join(f"<th>{c}</th>" for c in ("name", *_SHOWN))
    body = []
    for name, row in frame.iterrows():
        bad = row["n_nan"] or row["n_inf"] or row["grad_n_nan"] or row["grad_n_inf"]
        verdict = (
            verdicts.get(str(name), "not judged")
            if verdicts is not None
            else ratio_verdict(row["ratio"])
        )
        off = verdict in ("vanishing", "exploding")
        cls = "nbdebug-bad" if bad else ("nbdebug-warn" if off else "")
        if name == selected:
            cls += " nbdebug-selected"
        cells = "".join(f"<td>{_shown(row, c)}</td>" for c in _SHOWN)
        body.append(
            f"<tr class='{cls}'><td "
            f"style='text-align:left'>{html.escape(str(name))}</td>{cells}</tr>"
        )
    return (
        f"{STYLE}<table "
        f"class='nbdebug-params'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    )


class LayersPanel:
    """The Layers tab.

    Attributes
    ----------
    widget : ipywidgets.VBox
    sort_by : ipywidgets.Dropdown
        One of ``SORT_COLUMNS``.
    descending : ipywidgets.Checkbox
    table : ipywidgets.HTML
    verdicts : dict of str to RatioVerdict
        Each parameter's ``param_verdict``: the rule the table's marking and the plot's
        colours share with the health checks.
    plot : PlotView
        ``ratio_figure(trace)``.
    """

    def __init__(self, trace: Trace, *, backend: str | None = None):
        self.trace = trace
        self._frame = trace.params_frame()
        self.verdicts = param_verdicts(trace.params, trace.module_types)
        self.selected: str | None = None
        self.sort_by = widgets.Dropdown(
            options=list(SORT_COLUMNS), value="name", description="sort by"
        )
        self.descending = widgets.Checkbox(value=False, description="descending", indent=False)
        self.table = widgets.HTML(layout=widgets.Layout(max_height="320px", overflow="auto"))
        self.plot = PlotView(ratio_figure(trace), backend=backend)
        self.sort_by.observe(self._render, names="value")
        self.descending.observe(self._render, names="value")
        self._render()
        legend = widgets.HTML(
            f"<small>grad/weight ratio: below {VANISHING:g} the gradient vanishes, "
            f"above {EXPLODING:g} it explodes; "
            "red rows hold NaN/Inf; a zero weight (e.g. a bias initialised to 0) has no "
            "ratio.</small>"
        )
        self.widget = widgets.VBox(
            [widgets.HBox([self.sort_by, self.descending]), legend, self.table, self.plot.widget]
        )

    def sorted_frame(self) -> Any:
        """The parameter table in the order shown."""
        col, asc = self.sort_by.value, not self.descending.value
        if col == "name":
            return self._frame.sort_index(ascending=asc, kind="stable")
        return self._frame.sort_values(col, ascending=asc, na_position="last", kind="stable")

    def _render(self, _change: Any = None) -> None:
        if not len(self._frame):
            self.table.value = "<i>the model has no parameters</i>"
            return
        self.table.value = params_table_html(self.sorted_frame(), self.selected, self.verdicts)

    def select(self, name: str) -> None:
        """Highlight parameter ``name`` (e.g. from a health-check finding)."""
        if name not in self._frame.index:
            raise ValueError(f"no parameter named {name!r} in this trace.")
        self.selected = name
        self._render()

    def __repr__(self) -> str:
        return f"LayersPanel({len(self._frame)} parameters, sorted by {self.sort_by.value})"
