"""The Gradcheck tab: which (output, input) pair and which elements of a backward are wrong.

Layout, top to bottom: a title, the pair selector, the verdict in words, three heatmaps
(analytic, numerical, ``|difference|``; see :mod:`nbdebug.figures.gradcheck`) and, when the
panel was built with a model and a batch, a "check all modules" button with a progress
bar and a table of modules: selecting a row shows that module's pairs and heatmaps.

>>> panel = GradcheckPanel(nbdebug.gradcheck(MyFn.apply, x, w))      # one result
>>> panel = GradcheckPanel(model=model, inputs=x)                    # module sweep
>>> panel.widget                                                      # display it
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import ipywidgets as widgets
import plotly.graph_objects as go

from ..analysis.gradcheck.result import GradcheckResult, PairCheck
from ..analysis.gradcheck.sweep import gradcheck_modules
from ..analysis.gradcheck.verdicts import OK, SKIPPED
from ..core.batch import check_inputs, check_model
from ..figures.gradcheck import VERDICT_COLOR, gradcheck_figure
from ..figures.palette import RED
from .plot import PlotView
from .style import STYLE
from .tabs import FeatureTab, TabContext, TabHost

if TYPE_CHECKING:
    import pandas as pd
    import torch

_NBSP = "\u00a0"
_MARK = {True: "✓", False: "✗", None: "–"}


class GradcheckPanel:
    """Gradcheck panel; see the module docstring.

    Parameters
    ----------
    result : GradcheckResult, optional
        Shown at once.
    model : torch.nn.Module, optional
    inputs : tensor, tuple/list or dict, optional
        With a model: enables the "check all modules" button (:func:`gradcheck_modules`).
    rows : int
        Batch rows used by the module sweep.
    backend : str, optional
        Plot back end (see :mod:`nbdebug.widgets.plot`).
    sweep_options : dict, optional
        Extra keyword arguments for :func:`gradcheck_modules` (``max_elements``, ``fast``...).
    """

    def __init__(
        self,
        result: GradcheckResult | None = None,
        *,
        model: torch.nn.Module | None = None,
        inputs: Any = None,
        rows: int = 2,
        backend: str | None = None,
        sweep_options: dict[str, Any] | None = None,
    ) -> None:
        _check_sources(result, model, inputs)
        self.model = model
        self.inputs = inputs
        self.rows = rows
        self.sweep_options = dict(sweep_options or {})
        self.result: GradcheckResult | None = None
        self.sweep: pd.DataFrame | None = None  # the last sweep's table
        self.results: dict[str, GradcheckResult] = {}
        # called with whether the last sweep found a wrong backward (the debugger's header)
        self.on_sweep: Callable[[bool], None] | None = None
        self._build_result_view(backend)
        sweep_box = self._build_sweep_box()
        # the sweep first: its button is not pushed below an empty result box
        self.widget = widgets.VBox(
            [
                widgets.HTML(STYLE),
                sweep_box,
                self.title,
                self.pair_select,
                self.verdict,
                self.plot_box,
            ]
        )
        if result is not None:
            self.show_result(result)
        else:
            self.title.value = "<b>Gradcheck</b>" + (
                ": press <i>check all modules</i>" if model is not None else ": no result yet"
            )

    # ------------------------------------------------------------------ building

    def _build_result_view(self, backend: str | None) -> None:
        """The title, the pair selector, the verdict and the heatmaps of one result."""
        self.title = widgets.HTML()
        self.pair_select = widgets.Dropdown(
            options=[], description="pair", layout=widgets.Layout(width="100%", max_width="900px")
        )
        self.verdict = widgets.HTML()
        self.verdict.add_class("nbdebug-gc-verdict")
        self.view = PlotView(gradcheck_figure(None), backend=backend)
        # hidden while there is nothing to draw (see _show_figure)
        self.plot_box = widgets.VBox([self.view.widget], layout=widgets.Layout(display="none"))
        self.pair_select.observe(self._on_pair, names="value")
        self.pair_select.observe(self._on_pairs, names="options")
        self._on_pairs()

    def _build_sweep_box(self) -> widgets.VBox:
        """The "check all modules" button, its progress and the table of modules (hidden
        without a model)."""
        has_model = self.model is not None
        self.sweep_button = widgets.Button(
            description="check all modules",
            icon="play",
            disabled=not has_model,
            tooltip="gradient-check every leaf module, with the model's weights as they are "
            "now (not as traced), on the activations of the first batch rows"
            if has_model
            else "build the panel with model=... and inputs=... to check every module",
            layout=widgets.Layout(width="auto"),
        )
        self.progress = widgets.IntProgress(
            value=0, min=0, max=1, layout=widgets.Layout(width="240px")
        )
        self.status = widgets.HTML()
        self.table_header = widgets.HTML(_row_text("", "module", "verdict", "max error", "seconds"))
        self.table_header.add_class("nbdebug-gc-head")
        self.table = widgets.Select(
            options=[], rows=8, layout=widgets.Layout(width="100%", max_width="900px")
        )
        self.table.add_class("nbdebug-gc-table")
        self.table.observe(self._on_row, names="value")
        self.sweep_button.on_click(lambda _: self.run_sweep())
        self.sweep_note = widgets.HTML(
            "<small>checks the model as it is now (its current weights, on the first "
            f"{int(self.rows)} batch rows), not as it was when traced</small>"
        )
        box = widgets.VBox(
            [
                widgets.HBox([self.sweep_button, self.progress, self.status]),
                self.sweep_note,
                self.table_header,
                self.table,
            ]
        )
        box.layout.display = None if has_model else "none"
        return box

    # ------------------------------------------------------------------ showing a result

    def show_result(self, result: GradcheckResult, *, title: str | None = None) -> None:
        """Show ``result``: its pairs in the selector, the worst pair's heatmaps."""
        self.result = result
        worst = result.worst
        options = [
            (f"{_MARK[p.close] if p.ok else '✗'} {p.label}: {p.verdict}", i)
            for i, p in enumerate(result.pairs)
        ]
        start = result.pairs.index(worst) if worst is not None else None
        with self.widget.hold_sync(), self.pair_select.hold_sync():
            self.title.value = (
                f"<b>{html.escape(title or 'gradcheck of ' + result.fn_name)}</b> "
                + html.escape(
                    f"({result.dtype}, eps={result.eps:g}, atol={result.atol:g}, "
                    f"rtol={result.rtol:g}, "
                    f"{result.seconds:.2f}s)"
                )
            )
            self.pair_select.unobserve(self._on_pair, names="value")
            self.pair_select.options = options
            self.pair_select.value = start
            self.pair_select.observe(self._on_pair, names="value")
        self._draw()

    def select_pair(self, index: int) -> None:
        """Show pair ``index`` of the current result."""
        self.pair_select.value = index

    @property
    def pair(self) -> PairCheck | None:
        """The pair on screen (a :class:`~nbdebug.analysis.gradcheck.PairCheck`) or None."""
        if self.result is None or self.pair_select.value is None:
            return None
        return self.result.pairs[self.pair_select.value]

    def _on_pair(self, change: dict[str, Any]) -> None:
        self._draw()

    def _on_pairs(self, change: object = None) -> None:
        # no pair to pick: no empty selector; one: shown (it names the pair), not a choice
        n = len(self.pair_select.options)
        with self.pair_select.hold_sync():
            self.pair_select.layout.display = "none" if n == 0 else None
            self.pair_select.disabled = n == 1
            self.pair_select.tooltip = (
                "the only (output, input) pair of this check" if n == 1 else None
            )

    def _draw(self) -> None:
        pair = self.pair
        self._show_figure(gradcheck_figure(pair))
        if self.result is None:
            self.verdict.value = ""
            return
        if pair is None:
            self.verdict.value = (
                _badge(self.result.verdict) + " " + html.escape(self.result.message)
            )
            return
        lines = [f"{_badge(pair.verdict)} {html.escape(pair.message)}"]
        lines += [f"<li>{html.escape(n)}</li>" for n in self.result.notes]
        if self.result.second_order_error:
            lines.append(f"<li>{html.escape(self.result.second_order_error)}</li>")
        self.verdict.value = lines[0] + (f"<ul>{''.join(lines[1:])}</ul>" if len(lines) > 1 else "")

    def _show_figure(self, fig: go.Figure) -> None:
        # nothing to draw (no result, or no pair with a heatmap): no large empty box
        empty = len(fig.data) == 0
        shown_before = self.plot_box.layout.display != "none"
        self.plot_box.layout.display = "none" if empty else None
        self._update_figure(fig)
        if not empty and not shown_before:
            self.view.fit()  # drawn while hidden: sized to its place now

    def _update_figure(self, fig: go.Figure) -> None:
        current = self.view.figure
        same = len(current.data) == len(fig.data) and all(
            a.type == b.type and a.name == b.name for a, b in zip(current.data, fig.data)
        )
        if not same:
            self.view.replace(fig)
            return
        with self.view.batch_update() as f:
            for old, new in zip(f.data, fig.data):
                old.update({k: v for k, v in new.to_plotly_json().items() if k != "type"})
            f.layout.update(fig.layout.to_plotly_json())

    # ------------------------------------------------------------------ module sweep

    def run_sweep(self) -> pd.DataFrame | None:
        """Check every module (the "check all modules" button); fills the table and returns
        the DataFrame of :func:`gradcheck_modules`."""
        if self.model is None:
            raise ValueError("no model to sweep: build the panel with model=... and inputs=....")
        self.sweep_button.disabled = True
        self.progress.value = 0
        self.status.value = "checking modules..."

        def progress(done: int, total: int, name: str) -> None:
            with self.progress.hold_sync():
                self.progress.max = max(total, 1)
                self.progress.value = done
            self.status.value = html.escape(f"{done}/{total} {name}")

        try:
            df = gradcheck_modules(
                self.model, self.inputs, rows=self.rows, progress=progress, **self.sweep_options
            )
        except (TypeError, ValueError) as e:
            self.status.value = f"<span style='color:{RED}'>{html.escape(str(e))}</span>"
            return None
        finally:
            self.sweep_button.disabled = False
        self.sweep = df
        self.results = dict(df.attrs.get("results", {}))
        options = []
        for rec in df.to_dict("records"):
            err = rec["max_error"]
            options.append(
                (
                    _row_text(
                        _MARK[rec["passed"]],
                        rec["module"] or "(model)",
                        rec["verdict"],
                        ""
                        if err is None or (isinstance(err, float) and math.isnan(err))
                        else f"{err:.2e}",
                        f"{rec['seconds']:.2f}",
                    ),
                    rec["module"],
                )
            )
        n_bad = int((df["passed"] == False).sum())  # noqa: E712  (object column: True/False/None)
        n_skip = int(df["passed"].isna().sum())
        with self.table.hold_sync():
            self.table.unobserve(self._on_row, names="value")
            self.table.options = options
            self.table.value = None
            self.table.observe(self._on_row, names="value")
        self.status.value = html.escape(
            f"{len(df)} modules: {n_bad} with a wrong backward, {n_skip} skipped"
        )
        if self.on_sweep is not None:
            self.on_sweep(n_bad > 0)
        failing = df[df["passed"] == False]  # noqa: E712
        if len(failing):
            self.select_module(failing["module"].iloc[0])
        else:
            # nothing wrong: the heatmaps of an earlier sweep's failure must not stay up
            # above a table that says all pass
            with self.widget.hold_sync():
                self.result = None
                self.pair_select.options = []
                self.title.value = "<b>module sweep</b>: select a row for its heatmaps"
                self.verdict.value = (
                    _badge(OK if not n_skip else SKIPPED)
                    + " "
                    + html.escape(f"no module with a wrong backward ({n_skip} skipped)")
                )
            self._show_figure(gradcheck_figure(None))
        return df

    def select_module(self, name: str) -> None:
        """Select the table row of module ``name`` (shows its heatmaps)."""
        self.table.value = name

    def _on_row(self, change: dict[str, Any]) -> None:
        name = change["new"]
        if name is None or self.sweep is None:
            return
        result = self.results.get(name)
        if result is not None:
            self.show_result(result, title=f"module {name or '(model)'}")
            return
        rec = self.sweep[self.sweep["module"] == name].iloc[0]
        with self.widget.hold_sync():
            self.result = None
            self.pair_select.options = []
            self.title.value = f"<b>module {html.escape(name or '(model)')}</b>"
            self.verdict.value = _badge(SKIPPED) + " " + html.escape(str(rec["reason"]))
        self._show_figure(gradcheck_figure(None))

    # ------------------------------------------------------------------ display

    def __repr__(self) -> str:
        pairs = len(self.result.pairs) if self.result is not None else 0
        modules = len(self.sweep) if self.sweep is not None else 0
        return f"GradcheckPanel(pairs={pairs}, modules={modules}, plot={self.view.backend!r})"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)


def _check_sources(
    result: GradcheckResult | None, model: torch.nn.Module | None, inputs: object
) -> None:
    """Refuse a result that is not one, and a model without its batch (or the reverse)."""
    if result is not None and not isinstance(result, GradcheckResult):
        raise TypeError(
            "result must be a GradcheckResult (from nbdebug.gradcheck); got "
            f"{type(result).__qualname__}."
        )
    if model is not None:
        check_model(model)
        if inputs is None:
            raise ValueError(
                "the module sweep needs the batch too: pass inputs=... along with model=...."
            )
        check_inputs(inputs)
    elif inputs is not None:
        raise ValueError(
            "inputs were given without a model: pass model=... as well for the module sweep."
        )


def _badge(verdict: str) -> str:
    color = VERDICT_COLOR.get(verdict, VERDICT_COLOR[SKIPPED])
    return f"<span class='nbdebug-badge' style='background:{color}'>{html.escape(verdict)}</span>"


def _row_text(mark: str, module: str, verdict: str, err: str, seconds: str) -> str:
    text = f"{mark:<2}{module[:40]:<41}{verdict:<26}{err:>10} {seconds:>8}"
    return text.replace(" ", _NBSP)


def build_tab(dbg: TabHost, ctx: TabContext) -> None:
    """The Gradcheck tab: the module sweep of the debugger's model and batch, on request."""
    panel = GradcheckPanel(model=ctx.model, inputs=ctx.inputs, backend=ctx.backend)
    # a wrong backward found: the header's badge is then not a green "healthy"
    panel.on_sweep = lambda wrong: dbg.set_warned("Gradcheck", wrong)
    dbg.add_tab("Gradcheck", panel)


FEATURE_TAB = FeatureTab(
    "Gradcheck",
    applies=lambda ctx: ctx.model is not None and ctx.inputs is not None,
    build=build_tab,
    order=20,
)
