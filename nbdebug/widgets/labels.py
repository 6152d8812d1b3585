"""The label-review widget: :class:`LabelCleaner`.

Wiring only: the queue, the decisions and the journal live in
:class:`nbdebug.LabelReview`; the numbers come from
:func:`nbdebug.find_label_issues`; the figures from :mod:`nbdebug.figures.labels` through
:class:`~nbdebug.widgets.plot.PlotView`.
"""

from __future__ import annotations

import html
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ipywidgets as widgets
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from numpy.typing import ArrayLike
from plotly.callbacks import Points

from ..analysis.labels import LabelReview
from ..core.options import options_from
from ..core.text import fmt_num
from ..figures import labels as figs
from ..figures.palette import GREEN, RED
from .label_samples import (
    KEYS,
    Render,
    SampleKind,
    Samples,
    check_samples,
    key_widget,
    sample_kind,
    table_html,
)
from .output import object_output, show_outputs
from .plot import PlotView, figure_output
from .tabs import FeatureTab, TabContext, TabHost, as_table


@dataclass(frozen=True)
class CleanerOptions:
    """The rarer keyword-only options of :class:`LabelCleaner` (given by name).

    Attributes
    ----------
    render : callable, optional
        ``render(sample, index)``; replaces the built-in rendering.
    image_shape : tuple of int, optional
        Reshape each flat sample to this image shape.
    force : bool
        Allow relabeling and excluding samples of a test split.
    """

    render: Render | None = None
    image_shape: Sequence[int] | None = None
    force: bool = False


#: the keyword arguments of :class:`LabelCleaner`'s signature (its options: CleanerOptions)
CLEANER_KEYWORDS = ("class_names", "journal", "is_test", "backend")


class LabelCleaner:
    """Review suspicious labels one by one, with every decision journaled.

    Parameters
    ----------
    data : array, tensor, DataFrame or list, length n
        The samples, shown as pictures (``(n, h, w)``, ``(n, c, h, w)``, ``(n, h, w, c)``,
        or ``(n, 64)``-like flat square images such as sklearn's digits), as a compact
        table (a DataFrame or a 2-D array of features), or as text (a list of strings).
    labels : array-like of int, shape (n,)
        The given labels.
    issues : pandas.DataFrame
        :func:`nbdebug.find_label_issues` for these labels; its flagged rows are the queue.
    class_names : sequence of str, optional
    journal : str or Path
        The JSONL journal: every decision is appended and fsync'ed at once (a new file is
        written with the first decision); reopening the same file with the same data
        resumes; a journal of other data is refused.
    is_test : bool
        A test split: relabeling and excluding are refused unless ``force=True``.
    backend : {"auto", "figurewidget", "output"}, optional
        How figures are drawn (see :mod:`nbdebug.widgets.plot`).
    render : callable, optional
        ``render(sample, index)`` returning an ipywidget, a plotly figure, an HTML string
        or anything IPython can display; replaces the built-in rendering.
    force : bool
        With ``is_test=True``: relabel and exclude all the same.
    image_shape : tuple of int, optional
        Reshape each flat sample to this image shape.

    ``render``, ``force`` and ``image_shape`` are keyword-only options
    (:class:`CleanerOptions`); another name raises ``TypeError``.

    Attributes
    ----------
    widget : ipywidgets.VBox
    review : LabelReview
        The state: queue, decisions, journal.
    """

    def __init__(
        self,
        data: Samples,
        labels: ArrayLike,
        issues: pd.DataFrame,
        *,
        class_names: Sequence[object] | None = None,
        journal: str | os.PathLike[str] = "labels.journal.jsonl",
        is_test: bool = False,
        backend: str | None = None,
        **options: Any,
    ):
        opts = options_from(CleanerOptions, options, where="LabelCleaner()", also=CLEANER_KEYWORDS)
        check_samples(data, opts.render)
        self.review = LabelReview(
            labels, issues, data=data, journal=journal, is_test=is_test, force=opts.force
        )
        if len(data) != len(self.review.labels):
            raise ValueError(
                f"data has {len(data)} samples but there are {len(self.review.labels)} labels: "
                "expected one sample per label."
            )
        self.data = data
        self.render = opts.render
        shape = opts.image_shape
        self.image_shape = None if shape is None else tuple(int(s) for s in shape)
        self.kind = sample_kind(data, self.image_shape, opts.render)
        self.names = figs.class_labels(self.review.n_classes, class_names)
        self._item: int | None = None
        self.status = widgets.HTML()
        self.info = widgets.HTML(layout=widgets.Layout(min_width="280px"))
        self.message = widgets.HTML()
        sample_box = self._build_sample_view(backend)
        actions = self._build_actions()
        bulk = self._build_bulk()
        filters = self._build_filters()
        self.heatmap = PlotView(
            figs.confident_joint_figure(issues, class_names=class_names), backend=backend
        )
        if self.heatmap.backend == "figurewidget":
            self.heatmap.figure.data[0].on_click(self._on_cell_click)
        self.widget = widgets.VBox(
            [
                self.status,
                widgets.HBox([sample_box, self.info]),
                actions,
                self.keys_box,
                bulk,
                filters,
                self.message,
                widgets.HTML(
                    "<small>Click a cell of the heatmap (or use the filter above) to review one "
                    "given/suggested pair.</small>"
                ),
                self.heatmap.widget,
            ]
        )
        if not self.review.can_relabel:
            self._disable_changes()
        self._show()

    # ---- building ------------------------------------------------------------------
    def _build_sample_view(self, backend: str | None) -> widgets.Widget:
        """The place the current sample is drawn: a picture, a custom rendering or HTML."""
        self.sample_out = widgets.Output(layout=widgets.Layout(min_width="280px"))
        self.sample_html = widgets.HTML()
        self.image: PlotView | None = None
        if self.kind == SampleKind.IMAGE:
            self.image = PlotView(figs.sample_image_figure(np.zeros((8, 8))), backend=backend)
            return self.image.widget
        return self.sample_out if self.kind == SampleKind.CUSTOM else self.sample_html

    def _build_actions(self) -> widgets.HBox:
        """The decision buttons (and the keyboard shortcuts' button, in ``keys_box``)."""
        btn = widgets.Layout(width="auto")

        def button(action: str, description: str, **style: str) -> widgets.Button:
            b = widgets.Button(description=description, layout=btn, **style)
            b.on_click(lambda _: self._act(action))
            return b

        self.keep_button = button("keep", "Keep (k)", button_style="success")
        self.relabel_button = button("relabel", "Relabel to suggestion (r)", button_style="warning")
        self.relabel_to = widgets.Dropdown(
            options=[(n, i) for i, n in enumerate(self.names)],
            value=0,
            layout=widgets.Layout(width="140px"),
        )
        self.relabel_to_button = button("relabel_to", "Relabel to")
        self.exclude_button = button("exclude", "Exclude (x)", button_style="danger")
        self.skip_button = button("skip", "Skip (s)")
        self.undo_button = button("undo", "Undo (u)", icon="undo")
        # the key strip is made when asked for (see _key_widget), in keys_box
        self.keys: widgets.DOMWidget | None = None
        self.keys_button = widgets.Button(
            description="Keyboard shortcuts", icon="keyboard-o", layout=btn
        )
        self.keys_button.on_click(lambda _: self.enable_keys())
        self.keys_box = widgets.HBox([self.keys_button])
        row = [
            self.keep_button,
            self.relabel_button,
            self.relabel_to,
            self.relabel_to_button,
            self.exclude_button,
            self.skip_button,
            self.undo_button,
        ]
        return widgets.HBox(row, layout=widgets.Layout(flex_flow="row wrap"))

    def _build_bulk(self) -> widgets.HBox:
        """Accept every suggestion above a probability."""
        self.threshold = widgets.BoundedFloatText(
            value=0.95,
            min=0.0,
            max=1.0,
            step=0.01,
            description="p(suggested) ≥",
            layout=widgets.Layout(width="200px"),
            style={"description_width": "initial"},
        )
        self.bulk_button = widgets.Button(
            button_style="warning", layout=widgets.Layout(width="auto")
        )
        self.threshold.observe(lambda _: self._refresh_bulk(), names="value")
        self.bulk_button.on_click(lambda _: self._act("bulk"))
        return widgets.HBox([widgets.HTML("<b>Bulk</b>&nbsp;"), self.threshold, self.bulk_button])

    def _build_filters(self) -> widgets.HBox:
        """Review one given/suggested pair."""
        options = [("any", -1)] + [(n, i) for i, n in enumerate(self.names)]
        self.filter_given = widgets.Dropdown(
            options=options, value=-1, description="given", layout=widgets.Layout(width="190px")
        )
        self.filter_suggested = widgets.Dropdown(
            options=options,
            value=-1,
            description="suggested",
            layout=widgets.Layout(width="210px"),
        )
        self.clear_filter = widgets.Button(
            description="All pairs", layout=widgets.Layout(width="auto")
        )
        self.filter_given.observe(self._on_filter, names="value")
        self.filter_suggested.observe(self._on_filter, names="value")
        self.clear_filter.on_click(lambda _: self.set_filter(None, None))
        return widgets.HBox(
            [
                widgets.HTML("<b>Filter</b>&nbsp;"),
                self.filter_given,
                self.filter_suggested,
                self.clear_filter,
            ]
        )

    def _disable_changes(self) -> None:
        """A test split without ``force=True``: relabeling and excluding are refused."""
        for b in (
            self.relabel_button,
            self.relabel_to_button,
            self.exclude_button,
            self.bulk_button,
        ):
            b.disabled = True
            b.tooltip = "is_test=True: pass force=True to relabel or exclude test samples"

    # ---- results as data -----------------------------------------------------------
    @property
    def current(self) -> int | None:
        """The sample position shown (None when the filtered queue is done)."""
        return self._item

    @property
    def decisions(self) -> pd.DataFrame:
        """One row per decided sample: item, old_label, new_label, action, score, method, time."""
        return self.review.decisions

    def cleaned_labels(self) -> np.ndarray:
        """A copy of the labels with every relabel applied."""
        return self.review.cleaned_labels()

    def mask(self) -> np.ndarray:
        """``True`` for the samples kept (not excluded)."""
        return self.review.mask()

    def export(self, path: str | os.PathLike[str]) -> Path:
        """Write every sample's given label, cleaned label, kept flag and decision to
        ``.csv`` or ``.parquet`` (needs pyarrow)."""
        return self.review.export(path)

    def set_filter(self, given: int | None = None, suggested: int | None = None) -> None:
        """Review only one given/suggested pair (None: any)."""
        self.review.set_filter(given, suggested)
        with self.widget.hold_sync():
            self._syncing = True
            try:
                self.filter_given.value = -1 if given is None else int(given)
                self.filter_suggested.value = -1 if suggested is None else int(suggested)
            finally:
                self._syncing = False
        self._show()

    # ---- events --------------------------------------------------------------------
    _syncing = False

    def _on_filter(self, _change: object) -> None:
        if self._syncing:
            return
        g, s = self.filter_given.value, self.filter_suggested.value
        self.set_filter(None if g < 0 else g, None if s < 0 else s)

    def _on_cell_click(self, trace: object, points: Points, state: object) -> None:
        if not points.point_inds:
            return
        self.set_filter(int(points.ys[0]), int(points.xs[0]))

    def enable_keys(self) -> None:
        """Show the strip that takes the keyboard shortcuts (k keep, r relabel to the
        suggestion, x exclude, s skip, u undo) in place of its button; once."""
        if self.keys is not None:
            return
        self.keys = key_widget()
        if self.keys is None:  # pragma: no cover - anywidget is a dependency
            self.message.value = "keyboard shortcuts need the anywidget package"
            return
        self.keys.on_msg(self._on_key)
        self.keys_box.children = (self.keys,)

    def _on_key(self, _widget: object, content: object, _buffers: object) -> None:
        action = KEYS.get(content.get("key", "") if isinstance(content, dict) else "")
        if action is not None:
            self._act(action)

    def _act(self, action: str) -> None:
        r = self.review
        try:
            if action == "undo":
                undone = r.undo()
                msg = (
                    f"undid {undone[0]['action']} of sample {undone[0]['item']}"
                    if len(undone) == 1
                    else f"undid a bulk relabel of {len(undone)} samples"
                    if undone
                    else "nothing to undo"
                )
            elif action == "bulk":
                t = float(self.threshold.value)
                msg = f"relabeled {r.accept_above(t)} samples to their suggestion (p ≥ {t:g})"
            else:
                item = self._item
                if item is None:
                    msg = "nothing left to review under this filter"
                elif action == "keep":
                    r.keep(item)
                    msg = f"kept the label of sample {item}"
                elif action == "relabel":
                    rec = r.relabel(item=item)
                    msg = (
                        f"sample {item} relabeled {self.names[rec['old_label']]} → "
                        f"{self.names[rec['new_label']]}"
                    )
                elif action == "relabel_to":
                    rec = r.relabel(int(self.relabel_to.value), item=item)
                    msg = (
                        f"sample {item} relabeled {self.names[rec['old_label']]} → "
                        f"{self.names[rec['new_label']]}"
                    )
                elif action == "exclude":
                    r.exclude(item)
                    msg = f"sample {item} excluded"
                else:
                    r.skip(item)
                    msg = f"sample {item} skipped"
        except ValueError as e:  # the guard and impossible actions: shown, not raised into the UI
            self.message.value = f'<span style="color:{RED}">{html.escape(str(e))}</span>'
            return
        self._show(msg)

    # ---- drawing -------------------------------------------------------------------
    def _sample(self, item: int) -> Any:
        if isinstance(self.data, pd.DataFrame):
            return self.data.iloc[item]
        return self.data[item]

    def _draw_sample(self, item: int | None) -> None:
        if item is None:
            if self.kind == SampleKind.CUSTOM:
                show_outputs(self.sample_out)
            elif self.image is None:
                self.sample_html.value = "<i>done</i>"
            return
        s = self._sample(item)
        if self.kind == SampleKind.IMAGE:
            assert self.image is not None
            img = figs.as_image(s, self.image_shape)
            self.image.replace(figs.sample_image_figure(img, title=f"sample {item}"))
        elif self.kind == SampleKind.CUSTOM:
            assert self.render is not None
            out = self.render(s, item)
            if isinstance(out, str):
                from IPython.display import HTML

                out = HTML(out)
            shown = figure_output(out) if isinstance(out, go.Figure) else object_output(out)
            show_outputs(self.sample_out, shown)
        elif self.kind == SampleKind.TABLE:
            self.sample_html.value = table_html(s)
        elif self.kind == SampleKind.TEXT:
            self.sample_html.value = (
                '<div style="white-space:pre-wrap;max-width:480px;max-height:240px;overflow:auto;'
                f'border:1px solid #ddd;padding:6px">{html.escape(str(s))}</div>'
            )
        else:
            self.sample_html.value = f"<pre>{html.escape(repr(s)[:2000])}</pre>"

    def _info_html(self, item: int | None) -> str:
        if item is None:
            return "<b>Nothing left to review under this filter.</b>"
        row = self.review.row(item)
        given, sug = int(row["given_label"]), int(row["suggested_label"])
        sug_txt = html.escape(self.names[sug]) if sug >= 0 else "<i>none agreed</i>"
        tops = []
        for r in (1, 2, 3):
            c, p = row.get(f"top{r}"), row.get(f"top{r}_prob")
            if c is not None and int(c) >= 0 and p is not None and not np.isnan(p):
                tops.append(
                    f"<tr><td>{html.escape(self.names[int(c)])}</td><td>{float(p):.3f}</td></tr>"
                )
        prev = self.review.decision(item)
        prev_txt = f"<br>decided: {html.escape(prev['action'])}" if prev else ""
        method = str(row["method"]) if "method" in row else ""
        method_txt = " · " + html.escape(method) if method else ""
        return (
            f'<div style="line-height:1.5">sample <b>{item}</b><br>'
            f'given <b style="color:{RED}">{html.escape(self.names[given])}</b> → suggested '
            f'<b style="color:{GREEN}">{sug_txt}</b><br>'
            f"score (label quality) {fmt_num(float(row['label_quality']), '.4g')}"
            f"{method_txt}"
            f"{prev_txt}<br>"
            f"<table "
            f'style="margin-top:4px"><tr><th>top-3</th><th>p</th></tr>{"".join(tops)}</table></div>'
        )

    def _refresh_bulk(self) -> None:
        n = self.review.count_above(float(self.threshold.value))
        self.bulk_button.description = f"Accept {n} suggestion{'s' if n != 1 else ''}"
        if self.review.can_relabel:
            self.bulk_button.disabled = n == 0

    def _show(self, msg: str = "") -> None:
        r = self.review
        self._item = r.current
        pr = r.progress()
        est = r.issues.attrs.get("label_noise")
        g, s = r.filter
        filt = (
            "all pairs"
            if g is None and s is None
            else (
                f"given {self.names[g] if g is not None else 'any'} → suggested "
                f"{self.names[s] if s is not None else 'any'}"
            )
        )
        with self.widget.hold_sync():
            self.status.value = (
                f"<b>{pr['decided']}</b> of {pr['suspects']} suspects decided "
                f"({pr['relabel']} relabeled, {pr['exclude']} excluded, {pr['keep']} "
                f"kept, {pr['skip']} skipped) · "
                f"{pr['pending']} pending in {html.escape(filt)}"
                + (f"<br><small>{html.escape(est.summary())}</small>" if est is not None else "")
                + (
                    f"<br><small style='color:{RED}'>test split: relabel/exclude disabled</small>"
                    if not r.can_relabel
                    else ""
                )
            )
            self.info.value = self._info_html(self._item)
            if self._item is not None:
                sug = int(r.row(self._item)["suggested_label"])
                self.relabel_button.disabled = sug < 0 or not r.can_relabel
                if sug >= 0:
                    self.relabel_to.value = sug
            self.message.value = html.escape(msg)
            self._refresh_bulk()
        self._draw_sample(self._item)

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        return self.widget._repr_mimebundle_(**kwargs)

    def __repr__(self) -> str:
        pr = self.review.progress()
        return (
            f"LabelCleaner({pr['decided']}/{pr['suspects']} suspects decided, "
            f"{pr['relabel']} relabeled, {pr['exclude']} excluded, current={self._item}, "
            f"journal={str(self.review.journal.path)!r})"
        )


def build_tab(dbg: TabHost, ctx: TabContext) -> None:
    """The Labels tab: the label cleaner over the debugger's samples."""
    if ctx.labels is None or ctx.pred_probs is None or ctx.inputs is None:
        raise TypeError(
            "the Labels tab needs both labels= and pred_probs= (and the samples as the batch)."
        )
    from ..analysis.labels import find_label_issues

    issues = find_label_issues(ctx.labels, pred_probs=ctx.pred_probs)
    table = as_table(ctx.inputs)
    dbg.add_tab(
        "Labels",
        LabelCleaner(table, ctx.labels, issues, journal=ctx.journal, backend=ctx.backend),
    )


FEATURE_TAB = FeatureTab(
    "Labels",
    applies=lambda ctx: ctx.labels is not None or ctx.pred_probs is not None,
    build=build_tab,
    order=40,
)
