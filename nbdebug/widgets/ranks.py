"""The debugger over a directory of per-rank snapshots of one distributed step: the
compare-ranks table in the header, a rank selector, and the selected rank's debugger."""

from __future__ import annotations

import html
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import ipywidgets as widgets

from ..analysis.ranks import RanksReport, compare_ranks

#: Columns of the compare-ranks table shown in the header.
TABLE_COLUMNS = (
    "rank",
    "kind",
    "local_first",
    "culprit",
    "loss",
    "first_nonfinite",
    "params_agree",
    "first_differing_param",
)


if TYPE_CHECKING:
    from pathlib import Path

    import torch


class RankView(Protocol):
    """One rank's debugger, as the rank selector uses it."""

    @property
    def widget(self) -> widgets.Widget: ...

    def set_header_extra(self, html_text: str, *, warned: bool = False) -> None: ...
    def close(self) -> None: ...


def ranks_table_html(report: RanksReport) -> str:
    """The header's table: :meth:`RanksReport.to_frame` with :data:`TABLE_COLUMNS`."""
    df = report.to_frame()[list(TABLE_COLUMNS)]
    return df.to_html(index=False, na_rep="-", border=0, classes="nbdebug-ranks")


def ranks_report_html(report: RanksReport) -> str:
    """The report's summary in bold above :func:`ranks_table_html`."""
    return f"<div><b>{html.escape(report.summary())}</b>{ranks_table_html(report)}</div>"


class RanksDebugger:
    """Per-rank snapshots of one step. Build it with ``nbdebug.debug(directory, model=...)``.

    ``open_snapshot(path)`` builds one rank's debugger (``nbdebug.debug`` on the file: the
    app passes it in, so this panel does not import the app); the compare-ranks table goes
    into its header with ``set_header_extra``.

    Attributes
    ----------
    report : RanksReport
        :func:`nbdebug.compare_ranks` of the directory (replayed when a model is given).
    selector : ipywidgets.ToggleButtons
        The rank shown (a culprit rank first; its label is marked ``*``).
    table_html : str
        The report's summary and table, shown in every rank's debugger header
        (:meth:`Debugger.set_header_extra`).
    debugger : Debugger
        The selected rank's debugger (built when the rank is first selected).
    widget : ipywidgets.VBox
        The selector above the selected rank's debugger.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        open_snapshot: Callable[[Path], RankView],
        *,
        model: torch.nn.Module | Callable[[], torch.nn.Module] | None = None,
        loss_fn: Callable[..., Any] | None = None,
        step: int | None = None,
    ):
        self.report = compare_ranks(directory, model=model, loss_fn=loss_fn, step=step)
        self._open = open_snapshot
        self._debuggers: dict[int, RankView] = {}
        rows = self.report.rows
        first = next(  # the culprit whose replay shows the origin, else the first culprit
            (r.rank for r in rows if r.culprit and r.origin_phase is not None),
            next((r.rank for r in rows if r.culprit), rows[0].rank),
        )
        self.table_html = ranks_report_html(self.report)
        self.selector = widgets.ToggleButtons(
            options=[(f"rank {r.rank}{' *' if r.culprit else ''}", r.rank) for r in rows],
            value=first,
            description="rank",
        )
        self.body = widgets.VBox([])
        self.widget = widgets.VBox([self.selector, self.body])
        self.selector.observe(self._on_select, names="value")
        self._show(first)

    @property
    def rank(self) -> int:
        return int(self.selector.value)

    @property
    def debugger(self) -> RankView:
        return self._debuggers[self.rank]

    def select(self, rank: int) -> None:
        """Show ``rank``'s snapshot."""
        ranks = [r.rank for r in self.report.rows]
        if rank not in ranks:
            raise ValueError(f"no snapshot of rank {rank}; ranks: {ranks}.")
        self.selector.value = rank

    def _on_select(self, change: dict[str, Any]) -> None:
        self._show(int(change["new"]))

    def _show(self, rank: int) -> None:
        if rank not in self._debuggers:
            dbg = self._open(self.report.rank(rank).path)
            dbg.set_header_extra(self.table_html)  # the compare-ranks table in its header
            self._debuggers[rank] = dbg
        self.body.children = (self._debuggers[rank].widget,)

    def close(self) -> None:
        """Close every widget (the per-rank debuggers' too)."""
        for d in self._debuggers.values():
            d.close()
        for w in (self.selector, self.body, self.widget):
            w.close()

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def __repr__(self) -> str:
        return f"RanksDebugger({self.report.summary()}; showing rank {self.rank})"


__all__ = ["RanksDebugger", "ranks_report_html", "ranks_table_html"]
