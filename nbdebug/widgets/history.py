"""The History tab (snapshots): what the guard recorded over the steps before the failure."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

import ipywidgets as widgets

from ..figures.history import history_figure
from .plot import PlotView

if TYPE_CHECKING:
    import pandas as pd


def history_table_html(rows: pd.DataFrame) -> str:
    """The last history rows as an HTML table: ``time`` as a clock time (UTC), values not
    measured at a step (the parameter norm every few steps, no GradScaler) as "–", and
    columns measured at none of these steps left out."""
    import pandas as pd

    shown = rows.copy()
    if "time" in shown.columns:
        t = pd.to_numeric(shown["time"], errors="coerce")
        shown["time"] = pd.to_datetime(t, unit="s", utc=True).dt.strftime("%H:%M:%S")
    shown = shown.loc[:, [c for c in shown.columns if shown[c].notna().any()]]
    return str(shown.to_html(index=False, float_format=lambda v: f"{v:.4g}", border=0, na_rep="–"))


class HistoryPanel:
    """Loss, gradient norm, parameter norm, learning rate and GradScaler scale per step,
    the failing step marked, and the last recorded rows.

    Parameters
    ----------
    history : pandas.DataFrame
        ``Snapshot.history_frame()``.
    failing_step : int, optional
    reason : str, optional
        Why the snapshot was written.
    """

    def __init__(
        self,
        history: pd.DataFrame,
        *,
        failing_step: int | None = None,
        reason: str | None = None,
        backend: str | None = None,
    ):
        self.history = history
        self.failing_step = failing_step
        self.plot = PlotView(history_figure(history, failing_step=failing_step), backend=backend)
        head = []
        if failing_step is not None:
            head.append(f"<b>failing step {int(failing_step)}</b>")
        if reason:
            head.append(html.escape(str(reason)))
        self.summary = widgets.HTML(
            " · ".join(head) + f" <small>({len(history)} steps recorded)</small>"
        )
        self.table = widgets.HTML(
            history_table_html(history.tail(8)), layout=widgets.Layout(overflow="auto")
        )
        self.widget = widgets.VBox(
            [self.summary, self.plot.widget, widgets.HTML("<b>last steps</b>"), self.table]
        )

    def __repr__(self) -> str:
        return f"HistoryPanel({len(self.history)} steps, failing_step={self.failing_step})"
