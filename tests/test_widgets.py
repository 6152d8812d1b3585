"""The debugger widget driven from Python: buttons clicked, filters and slider moved,
and what the cursor, the detail pane and the figures show checked against the trace."""

from __future__ import annotations

import math

import ipywidgets as ipw
import pytest
import torch
import torch.nn.functional as F
from ipywidgets.widgets import widget as ipw_widget
from state import assert_unchanged, fingerprint
from torch import nn

import nbdebug
from nbdebug.figures.histogram import histogram_figure
from nbdebug.figures.layers import BAND_LABEL, EXPLODING, VANISHING, ratio_figure
from nbdebug.figures.norms import (
    CURRENT_TRACE,
    NONFINITE_TRACE,
    TARGET_TRACE,
    norm_figure,
    norm_points,
)
from nbdebug.widgets.app import Debugger, debug
from nbdebug.widgets.cursor import Cursor
from nbdebug.widgets.plot import DrawnFigureWidget, PlotView, fit_figures


class LogNet(nn.Module):
    """log() of a pre-activation that can be negative: NaN produced in the model's own code."""

    def __init__(self, bad: bool = True):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)
        self.bad = bad

    def forward(self, x):
        h = self.enc(x)
        if self.bad:
            h = torch.log(h)
        return self.head(h)


class Shared(nn.Module):
    """One module called twice."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x))).sum()


class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(5, 2)

    def forward(self, x):
        return self.b(self.a(x))


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(1)
    return torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)


@pytest.fixture
def bad_dbg(batch):
    x, y = batch
    return debug(LogNet(), x, y, F.cross_entropy)


def marker(dbg: Debugger) -> tuple[list, list]:
    cur = dbg.step.norms.figure.data[-1]
    assert cur.name == CURRENT_TRACE
    return list(cur.x), list(cur.y)


def test_debugger_shows_the_trace_and_starts_at_the_first_event(bad_dbg):
    tr = bad_dbg.trace
    assert isinstance(bad_dbg, Debugger) and isinstance(tr, nbdebug.Trace)
    assert tr.origin is not None and tr.origin.op == "torch.log"
    # header: model, parameter count, batch, loss, and the badge text exactly like summary()
    head = bad_dbg.header.value
    assert "LogNet" in head and f"{tr.n_params:,} parameters" in head and "Tensor(6, 8)" in head
    assert tr.summary().replace("<", "&lt;").replace(">", "&gt;") in head
    assert "nbdebug-badge-bad" in head
    assert list(bad_dbg.tabs.titles) == ["Step", "Layers", "Checks", "Fixes", "Gradcheck"]
    assert bad_dbg.current_event is tr.events[0]
    assert bad_dbg.cursor.index == 0
    pts = norm_points(tr)
    assert marker(bad_dbg) == ([pts.x[0]], [pts.y[0]])
    assert bad_dbg.step.buttons["prev"].disabled and bad_dbg.step.buttons["first"].disabled
    assert not bad_dbg.step.buttons["next"].disabled
    assert "LogNet" in repr(bad_dbg) and "#0" in repr(bad_dbg)


def test_buttons_move_the_cursor_the_detail_and_the_marker(bad_dbg):
    tr, step = bad_dbg.trace, bad_dbg.step
    pts = norm_points(tr)
    fig_before = step.norms.figure
    data_before = [list(d.y) for d in fig_before.data[:-1]]

    step.buttons["next"].click()
    assert bad_dbg.cursor.index == 1
    assert marker(bad_dbg) == ([pts.x[1]], [pts.y[1]])
    ev = tr.events[1]
    assert ev.module in step.detail.value and f"{ev.stats.norm:.4g}" in step.detail.value
    assert step.slider.value == 1 and step.events.value == 1

    step.buttons["origin"].click()
    o = tr.origin
    assert bad_dbg.current_event is o
    assert marker(bad_dbg) == ([pts.x[o.index]], [pts.y[o.index]])
    d = step.detail.value
    assert "torch.log" in d and o.source.split(":")[0] in d and "origin" in d
    assert "non-finite rows: " + ", ".join(map(str, o.samples)) in d
    # the histogram follows the event
    assert list(step.histogram.figure.data[0].y) == [int(c) for c in o.hist.counts]
    assert f"#{o.index}" in step.histogram.figure.layout.title.text

    step.buttons["nonfinite"].click()
    after = next(e for e in tr.events if e.index > o.index and not e.finite)
    assert bad_dbg.cursor.index == after.index

    step.buttons["last"].click()
    assert bad_dbg.cursor.index == len(tr.events) - 1
    assert step.buttons["next"].disabled and not step.buttons["prev"].disabled
    step.buttons["prev"].click()
    assert bad_dbg.cursor.index == len(tr.events) - 2
    step.buttons["first"].click()
    assert bad_dbg.cursor.index == 0
    # the figure was moved, not redrawn: same object, other traces untouched
    assert step.norms.figure is fig_before
    assert [list(d.y) for d in step.norms.figure.data[:-1]] == data_before


def test_slider_list_and_filters(bad_dbg):
    tr, step = bad_dbg.trace, bad_dbg.step
    step.slider.value = 4
    assert bad_dbg.cursor.index == 4 and step.events.value == 4
    step.events.value = 7
    assert bad_dbg.cursor.index == 7 and step.slider.value == 7

    step.phase.value = "backward"
    back = [e.index for e in tr.events if e.phase == "backward"]
    assert [v for _, v in step.events.options] == back
    assert step.slider.max == len(back) - 1
    assert bad_dbg.current_event.phase == "backward"  # moved to the first backward event after #7
    step.slider.value = 2
    assert bad_dbg.cursor.index == back[2]
    step.buttons["first"].click()
    assert bad_dbg.cursor.index == back[0]

    step.phase.value = "all"
    step.module_filter.value = "enc.2"
    shown = [v for _, v in step.events.options]
    assert shown == [e.index for e in tr.events if "enc.2" in e.module]
    assert all(tr.events[i].module == "enc.2" for i in shown)

    # jumping to the origin (hidden by the filter) clears the filters
    step.buttons["origin"].click()
    assert bad_dbg.current_event is tr.origin
    assert step.phase.value == "all" and step.module_filter.value == ""
    assert len(step.events.options) == len(tr.events)

    step.module_filter.value = "no-such-module"
    assert step.events.options == () and step.slider.disabled


def test_event_list_marks_tree_origin_and_nonfinite(bad_dbg):
    tr, step = bad_dbg.trace, bad_dbg.step
    labels = dict((v, k) for k, v in step.events.options)
    o = tr.origin
    assert " * " in labels[o.index]
    for e in tr.events:
        if e.index != o.index:
            assert (" ! " in labels[e.index]) == (not e.finite)
    # module tree: enc.0 (depth 2) is indented deeper than enc (depth 1)
    enc0 = next(e for e in tr.events if e.module == "enc.0" and e.phase == "forward")
    enc = next(e for e in tr.events if e.module == "enc" and e.phase == "forward")
    assert enc0.depth > enc.depth
    lead = lambda s: len(s.split(" fwd ", 1)[1]) - len(s.split(" fwd ", 1)[1].lstrip("\u00a0"))  # noqa: E731
    assert lead(labels[enc0.index]) > lead(labels[enc.index])


def test_norm_figure():
    m = Shared()
    tr = nbdebug.trace(m, torch.randn(3, 4))
    fig = norm_figure(tr, current=2)
    names = [d.name for d in fig.data]
    assert names[-1] == CURRENT_TRACE and NONFINITE_TRACE in names
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.exponentformat == "e"
    pts = norm_points(tr)
    assert list(fig.data[-1].x) == [pts.x[2]]
    # the module called twice has two categories
    assert {"lin #1", "lin #2"} <= set(pts.categories)
    fw = [pts.x[e.index] for e in tr.events if e.phase == "forward" and e.module == "lin"]
    assert fw == ["lin #1", "lin #2"]
    assert norm_figure(tr).data[-1].x in (None, ())
    with pytest.raises(TypeError, match="Trace"):
        norm_figure("trace")
    with pytest.raises(ValueError, match="current"):
        norm_figure(tr, current=999)


def test_the_target_is_drawn_apart_from_the_forward_line():
    """The target meets the output at the loss: on the "input" category it is a marker of its
    own, not a point the forward line climbs through on the way to the first module."""
    m = Shared()
    x = torch.randn(3, 4)
    with torch.no_grad():
        target = torch.randn_like(m(x))
    with_target = nbdebug.trace(m, x, target, torch.nn.MSELoss())
    fig = norm_figure(with_target)
    by_name = {d.name: d for d in fig.data}
    targets = [e.index for e in with_target.events if e.kind == "target"]
    assert targets and list(by_name[TARGET_TRACE].customdata) == targets
    assert by_name[TARGET_TRACE].mode == "markers"
    assert not set(targets) & set(by_name["forward"].customdata)
    assert list(by_name[TARGET_TRACE].x) == ["input"] * len(targets)
    # without a target there is no empty legend entry for one
    assert TARGET_TRACE not in [
        d.name for d in norm_figure(nbdebug.trace(m, torch.randn(3, 4))).data
    ]


def test_nonfinite_points_are_marked(bad_dbg):
    tr = bad_dbg.trace
    fig = norm_figure(tr)
    bad = next(d for d in fig.data if d.name == NONFINITE_TRACE)
    assert list(bad.customdata) == [e.index for e in tr.events if not e.finite]
    assert all(y > 0 for d in fig.data for y in (d.y or ()))  # every point fits a log axis


def test_histogram_and_ratio_figures(bad_dbg):
    tr = bad_dbg.trace
    ev = tr.events[1]
    h = histogram_figure(ev)
    assert list(h.data[0].y) == [int(c) for c in ev.hist.counts]
    assert len(h.data[0].x) == len(ev.hist.edges) - 1
    ok = nbdebug.trace(
        LogNet(bad=False), torch.randn(6, 8), torch.randint(0, 3, (6,)), F.cross_entropy
    )
    f = ratio_figure(ok)
    assert list(f.data[0].x) == [p.name for p in ok.params]
    assert list(f.data[0].y) == pytest.approx([p.ratio for p in ok.params])
    assert f.layout.yaxis.type == "log" and f.layout.yaxis.exponentformat == "e"  # not "10μ"
    bands = sorted((s.y0, s.y1) for s in f.layout.shapes)
    assert bands[0][1] == VANISHING and bands[1][0] == EXPLODING


def test_band_labels_sit_beside_their_bands_where_no_bar_reaches(bad_dbg):
    """A full-height bar (a NaN gradient) covers the plot area's top: the labels are in
    the right margin, each at its band's height (log10 coordinates on a log axis)."""
    f = ratio_figure(bad_dbg.trace)
    assert max(f.data[0].y) == 10 ** f.layout.yaxis.range[1]  # a full-height bar
    labels = [a for a in f.layout.annotations if a.name == BAND_LABEL]
    assert [a.text.split("<br>")[0] for a in labels] == ["vanishing", "exploding"]
    for a in labels:
        assert a.xref == "paper" and a.x >= 1 and a.xanchor == "left"
        assert f.layout.margin.r >= 80  # room for the label
    (vlo, vhi), (elo, ehi) = sorted((s.y0, s.y1) for s in f.layout.shapes)
    vanishing, exploding = labels
    assert math.log10(vlo) < vanishing.y < math.log10(vhi)
    assert math.log10(elo) < exploding.y < math.log10(ehi)


def test_layers_tab_sorts_the_parameter_table(bad_dbg):
    lay = bad_dbg.layers
    assert bad_dbg.tabs.children[1] is lay.widget
    names = list(bad_dbg.trace.params_frame().index)
    assert list(lay.sorted_frame().index) == sorted(names)
    ok = debug(LogNet(bad=False), torch.randn(6, 8), torch.randint(0, 3, (6,)), F.cross_entropy)
    lay = ok.layers
    lay.sort_by.value = "grad_norm"
    lay.descending.value = True
    by_grad = sorted(ok.trace.params, key=lambda p: -p.grad_norm)
    assert list(lay.sorted_frame().index) == [p.name for p in by_grad]
    html = lay.table.value
    pos = [html.index(f">{p.name}<") for p in by_grad]
    assert pos == sorted(pos)
    # rows holding NaN gradients are marked in the broken model's table
    assert "nbdebug-bad" in bad_dbg.layers.table.value
    assert "nbdebug-bad" not in lay.table.value.split("</style>", 1)[1]


def test_layers_table_marks_the_ratios_checks_flag_not_a_bias_or_layernorm_weight():
    """One vanishing/exploding rule (``param_verdict``) for the Layers table and Checks:
    a bias and a LayerNorm weight with a ratio far outside the band are not judged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with torch.no_grad():
        model[0].bias.fill_(0.5)
    w = torch.randn(8, 4)

    def loss_fn(out):
        return (out * w).sum() * 1e4

    dbg = debug(model, torch.randn(8, 4), loss_fn=loss_fn)
    ratios = {p.name: p.ratio for p in dbg.trace.params}
    # the step is one whose 1-D parameters have ratios the band would call exploding
    assert ratios["0.bias"] > EXPLODING and ratios["1.weight"] > EXPLODING
    flagged = {
        f.param
        for f in nbdebug.check(dbg.trace, loss_fn=loss_fn)
        if f.code in ("vanishing_gradient", "exploding_gradient")
    }
    rows = dbg.layers.table.value.split("<tr class=")[1:]
    names = list(dbg.layers.sorted_frame().index)
    marked = {n for n, row in zip(names, rows) if row.startswith("'nbdebug-warn")}
    assert flagged == {"0.weight"}
    assert marked == flagged


def test_healthy_model_and_rerun_after_a_fix(batch):
    x, y = batch
    m = LogNet()
    dbg = debug(m, x, y, F.cross_entropy)
    assert not dbg.trace.healthy and not dbg.step.buttons["origin"].disabled
    seen = []
    dbg.on_retrace(lambda d: seen.append(d.trace))
    m.bad = False  # the user fixes the model in another cell
    dbg.step.buttons["next"].click()
    old_step = dbg.step.widget
    dbg.rerun_button.click()
    assert dbg.trace.healthy and seen == [dbg.trace]
    assert dbg.trace.summary() == "healthy" and "nbdebug-badge-ok" in dbg.header.value
    assert dbg.step.buttons["origin"].disabled
    assert dbg.cursor.index == 0 and dbg.tabs.children[0] is dbg.step.widget
    assert old_step.comm is None  # the old panel was closed


def test_a_model_that_raises_shows_the_error_and_the_partial_trace():
    dbg = debug(Raises(), torch.randn(3, 4))
    with pytest.raises(nbdebug.TraceError) as info:
        nbdebug.trace(Raises(), torch.randn(3, 4))
    assert dbg.error == str(info.value)
    assert "Executed modules up to: a" in dbg.error
    assert dbg.error in dbg.header.value and "nbdebug-badge-bad" in dbg.header.value
    # the partial trace holds the events up to the failing module
    mods = [e.module for e in dbg.trace.events]
    assert "a" in mods and "b" not in [e.module for e in dbg.trace.events if e.phase == "forward"]
    dbg.step.buttons["last"].click()
    assert dbg.current_event is dbg.trace.events[-1]


def test_add_tab_survives_rerun_and_bad_input(bad_dbg):
    import ipywidgets as w

    extra = w.HTML("checks")
    bad_dbg.add_tab("Checks", extra)
    assert list(bad_dbg.tabs.titles)[-1] == "Checks" and bad_dbg.tabs.children[-1] is extra
    bad_dbg.rerun()
    assert list(bad_dbg.tabs.titles) == ["Step", "Layers", "Checks", "Fixes", "Gradcheck", "Checks"]
    with pytest.raises(TypeError, match="ipywidget"):
        bad_dbg.add_tab("x", 3)
    with pytest.raises(TypeError, match="title"):
        bad_dbg.add_tab("", extra)
    with pytest.raises(TypeError, match="Module"):
        debug(42)
    with pytest.raises(TypeError, match="batch"):
        debug(LogNet())
    with pytest.raises(TypeError, match="Trace"):
        Debugger("not a trace")
    with pytest.raises(ValueError, match="re-run"):
        debug(bad_dbg.trace).rerun()


def test_debugging_changes_nothing_on_the_model(batch):
    x, y = batch
    m = LogNet()
    m.eval()
    m.enc[0].weight.requires_grad_(False)
    m.head.weight.grad = torch.ones_like(m.head.weight)
    handle = m.head.register_forward_hook(lambda *a: None)
    before = fingerprint(m)
    grad = m.head.weight.grad
    x0, y0 = x.clone(), y.clone()

    dbg = debug(m, x, y, F.cross_entropy)
    for key in ("next", "origin", "nonfinite", "last"):
        dbg.step.buttons[key].click()
    dbg.rerun()

    assert_unchanged(before, m)  # parameters, buffers, .grad, flags, hooks, RNG
    assert m.head.weight.grad is grad and torch.equal(grad, torch.ones_like(grad))
    assert m.enc[2].weight.grad is None
    assert not m.enc[0].weight.requires_grad and m.head.weight.requires_grad
    assert not any(mod.training for mod in m.modules())
    assert list(m.head._forward_hooks) == [handle.id]
    assert all(
        not mod._forward_hooks and not mod._backward_hooks and not mod._forward_pre_hooks
        for mod in m.modules()
        if mod is not m.head
    )
    assert torch.equal(x, x0) and torch.equal(y, y0)
    handle.remove()


def test_close_releases_every_widget(batch):
    x, y = batch
    n0 = len(ipw_widget._instances)
    dbg = debug(LogNet(), x, y, F.cross_entropy)
    assert len(ipw_widget._instances) > n0
    dbg.close()
    assert len(ipw_widget._instances) == n0


def test_output_backend_moves_the_marker_too(batch):
    x, y = batch
    dbg = debug(LogNet(), x, y, F.cross_entropy, backend="output")
    assert dbg.step.norms.backend == "output"
    dbg.step.buttons["origin"].click()
    pts = norm_points(dbg.trace)
    assert marker(dbg) == ([pts.x[dbg.trace.origin.index]], [pts.y[dbg.trace.origin.index]])


def test_cursor_alone(bad_dbg):
    tr = bad_dbg.trace
    c = Cursor(tr, phase="forward")
    assert all(tr.events[i].phase in ("input", "forward", "loss") for i in c.visible)
    assert c.first() is False and c.index == 0  # already there
    assert c.last() and tr.events[c.index].phase == "loss"
    assert c.next() is False
    assert c.to_origin() and c.event is tr.origin
    with pytest.raises(ValueError, match="phase filter"):
        c.set_filter(phase="sideways")
    with pytest.raises(ValueError, match="event index"):
        c.goto(len(tr.events))
    healthy = nbdebug.trace(
        LogNet(bad=False), torch.randn(2, 8), torch.randint(0, 3, (2,)), F.cross_entropy
    )
    hc = Cursor(healthy)
    assert hc.to_origin() is False and hc.next_nonfinite() is False and hc.index == 0
    assert math.isfinite(healthy.loss)


def test_snapshot_gets_a_history_tab(tmp_path):
    m = LogNet()
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    history = [
        {"step": s, "loss": 2.0 - 0.1 * s, "grad_norm": 1.0, "param_norm": 4.0, "lr": 0.01}
        for s in range(9)
    ]
    path = nbdebug.save_snapshot(
        tmp_path, m, x, y, step=9, reason="loss is nan", history=history, loss_fn=F.cross_entropy
    )
    dbg = debug(path, model=LogNet)
    assert list(dbg.tabs.titles) == ["Step", "Layers", "History", "Checks", "Fixes", "Gradcheck"]
    hist = dbg.history
    assert hist is not None and hist.failing_step == 9
    assert list(hist.history["step"]) == list(range(9))
    # the loss trace of the history figure carries the recorded values
    loss_trace = next(t for t in hist.plot.figure.data if t.name == "loss")
    assert list(loss_trace.y) == pytest.approx([h["loss"] for h in history])
    assert "failing step 9" in hist.summary.value and "loss is nan" in hist.summary.value
    replay = nbdebug.load_snapshot(path, model=LogNet).trace()
    assert dbg.trace.summary() == replay.summary()
    assert "step 9" in dbg.header.value
    # the same from a loaded Snapshot; no history -> no History tab
    bare = nbdebug.save_snapshot(tmp_path / "b.nbsnap", m, x, y, step=1, loss_fn=F.cross_entropy)
    assert list(debug(nbdebug.load_snapshot(bare, model=LogNet)).tabs.titles) == [
        "Step",
        "Layers",
        "Checks",
        "Fixes",
        "Gradcheck",
    ]
    with pytest.raises(nbdebug.SnapshotError):
        debug(tmp_path / "missing.nbsnap", model=LogNet)
    with pytest.raises(TypeError, match="model="):
        debug(nbdebug.trace(m, x, y, F.cross_entropy), model=LogNet)


def test_an_empty_trace_still_opens():
    empty = nbdebug.Trace(
        events=[],
        origin=None,
        first_nonfinite=None,
        loss=None,
        params=[],
        model_name="Broken",
        error="ValueError in <model> before any module ran",
    )
    dbg = debug(empty)
    assert dbg.current_event is None and "no events" in dbg.step.detail.value
    for b in dbg.step.buttons.values():
        b.click()
    assert dbg.cursor.index is None and dbg.step.events.options == ()
    assert "error: ValueError" in dbg.header.value and "no parameters" in dbg.layers.table.value


def _opened_states(monkeypatch) -> list[dict]:
    """The state each widget's comm opens with, from now on."""
    import comm

    states: list[dict] = []
    create = comm.create_comm

    def recording(**kwargs):
        states.append(kwargs["data"]["state"])
        return create(**kwargs)

    monkeypatch.setattr(comm, "create_comm", recording)
    return states


def test_a_figure_widget_opens_with_its_data(monkeypatch):
    """plotly's FigureWidget sends its traces after the comm opened (a view drawn before
    that message stays empty); the PlotView's figure opens with them."""
    import plotly.graph_objects as go

    states = _opened_states(monkeypatch)
    fig = go.Figure(go.Scatter(y=[1, 3, 2], name="a"), layout={"title": {"text": "t"}})
    go.FigureWidget(fig)
    view = PlotView(fig, backend="figurewidget")
    assert isinstance(view.figure, DrawnFigureWidget) and view.figure.comm is not None
    plain, drawn = states
    assert plain["_widget_data"] == []  # plotly's own: the cause (plotly.py 6, 7)
    assert [t["name"] for t in drawn["_widget_data"]] == ["a"]
    assert drawn["_widget_layout"]["title"]["text"] == "t"
    view.figure.data[0].y = [4, 5, 6]  # still a live widget
    assert list(view.figure.data[0].y) == [4, 5, 6]


def _relayouts(figure) -> list[dict]:
    sent: list[dict] = []
    figure.observe(
        lambda c: sent.append(c["new"]["relayout_data"]) if c["new"] else None,
        names="_py2js_relayout",
    )
    return sent


def test_a_figure_widget_is_fitted_to_its_place_once_drawn():
    """plotly's anywidget draws at 700 px unless autosize is switched on while the element is
    in the page: the first layout report of a view (it drew) switches it off and on."""
    import plotly.graph_objects as go

    view = PlotView(go.Figure(go.Bar(y=[1, 2])), backend="figurewidget")
    sent = _relayouts(view.figure)
    drawn = {"layout_delta": {"width": 700, "height": 360}, "layout_edit_id": 0}
    view.figure._js2py_layoutDelta = drawn  # what the front end sends once it drew
    assert sent == [{"autosize": False}, {"autosize": True}]
    view.figure._js2py_layoutDelta = None
    view.figure._js2py_layoutDelta = dict(drawn, layout_edit_id=2)  # later reports: no more
    assert len(sent) == 2
    assert view.figure.layout.autosize is True
    out = PlotView(go.Figure(go.Bar(y=[1, 2])), backend="output")
    out.fit()  # the output back end follows its container by itself: nothing to do
    assert isinstance(out.widget, ipw.Output)


def test_showing_a_tab_fits_its_figures(batch):
    """A figure drawn in a hidden tab keeps plotly's default width: selecting the tab (a
    click in the front end, or select_tab) fits the figures of that tab, and only those."""
    x, y = batch
    dbg = debug(LogNet(), x, y, F.cross_entropy, backend="figurewidget")
    layers, norms = _relayouts(dbg.layers.plot.figure), _relayouts(dbg.step.norms.figure)
    dbg.select_tab("Layers")
    assert layers == [{"autosize": False}, {"autosize": True}] and norms == []
    assert fit_figures(dbg.tabs.children[0]) == 2  # the norm plot and the histogram
    assert fit_figures(ipw.VBox([ipw.HTML("no figure")])) == 0


def test_confident_joint_counts_are_white_on_dark_cells():
    """A count written in the default dark text on the darkest red cell cannot be read."""
    import numpy as np

    from nbdebug.figures.labels import confident_joint_figure
    from nbdebug.figures.palette import DARK_TEXT

    rng = np.random.default_rng(0)
    labels = np.repeat([0, 1, 2], 40)
    probs = np.full((120, 3), 0.05)
    probs[np.arange(120), labels] = 0.9
    flip = rng.choice(120, 30, replace=False)
    probs[flip] = np.roll(probs[flip], 1, axis=1)
    fig = confident_joint_figure(nbdebug.find_label_issues(labels, pred_probs=probs))
    heat = fig.data[0]
    counts = next(t for t in fig.data if t.name == "counts")
    off = np.array(heat.z, dtype=float)
    colors = np.array(counts.textfont.color).reshape(off.shape)
    darkest = np.unravel_index(np.nanargmax(off), off.shape)
    lightest = np.unravel_index(np.nanargmin(off), off.shape)
    assert np.nanmax(off) > np.nanmin(off)
    assert colors[darkest] == "white" and colors[lightest] == DARK_TEXT
    assert all(colors[i, i] == DARK_TEXT for i in range(3))  # the grey diagonal


def test_detail_of_an_all_nan_event_shows_no_moments_and_its_zero_share():
    """An all-NaN tensor has no finite element: its moments read NaN, but its share of exact
    zeros is 0 (NaN is not zero), the value Event.stats and to_frame() give."""
    from nbdebug.widgets.step import detail_html

    class AllNaN(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x) * float("nan")

    tr = nbdebug.trace(AllNaN(), torch.randn(2, 3), loss_fn=lambda o: o.sum())
    ev = next(e for e in tr.events if e.phase == "forward" and e.module == "")
    assert ev.stats.n_nan == ev.stats.numel == 6 and ev.stats.zero_frac == 0.0
    assert tr.to_frame().loc[ev.index, "zero_frac"] == 0.0
    html = detail_html(ev, tr)
    assert "<th style='text-align:left'>mean</th><td class=''>NaN</td>" in html
    assert "<th style='text-align:left'>zero_frac</th><td class=''>0</td>" in html


def test_figures_show_a_nan_norm_as_nan_not_zero():
    """An all-NaN gradient and an all-NaN batch: their norm is NaN in the hover texts, as
    in params_frame() and the Step detail (Event.stats.norm, over the finite elements, is
    0 there); a partly NaN tensor also shows its finite elements' norm."""
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    x = torch.full((8, 4), float("nan"))
    tr = nbdebug.trace(m, x, loss_fn=lambda o: o.sum())
    assert math.isnan(tr.params_frame().loc["1.weight", "grad_norm"])
    bar = ratio_figure(tr).data[0]
    assert "grad norm NaN" in bar.text[list(bar.x).index("1.weight")]
    texts = [t for d in norm_figure(tr).data for t in (d.text or ())]
    assert any(t.startswith("#0 input <model> x<br>norm NaN<br>") for t in texts), texts[:3]
    assert not any("<br>norm 0<br>" in t for t in texts)
    x2 = torch.ones(8, 4)
    x2[3, 1] = float("nan")
    tr2 = nbdebug.trace(m, x2, loss_fn=lambda o: o.sum())
    first = next(t for d in norm_figure(tr2).data for t in (d.text or ()) if t.startswith("#0 "))
    assert "norm NaN (finite elements 5.568)" in first  # sqrt(31)


def test_histogram_title_counts_nan_in_the_whole_tensor():
    """The bins come from a strided sample, but the title's NaN/Inf count is the tensor's
    (exact): one NaN the sample missed is still counted."""
    from nbdebug.figures.histogram import histogram_title

    m = nn.Sequential(nn.Linear(4000, 8))
    x = torch.randn(8, 4000)
    x[3, 1] = float("nan")
    tr = nbdebug.trace(m, x, loss_fn=lambda o: o.sum())
    ev = tr.events[0]
    assert ev.hist.sampled and ev.hist.n_nonfinite == 0 and ev.stats.n_nan == 1
    assert histogram_title(ev).endswith("; 1 NaN/Inf in all")
    assert f"a sample of {ev.hist.total} of 32000 values" in histogram_title(ev)
    assert ev.hist.total <= 1024


def test_a_trace_shows_itself_as_the_debugger(batch):
    """The result protocol: ``Trace.show()`` is the debugger's widget (registered by the
    app, the one widget module that composes the debugger), ``ok`` and ``summary()``
    its verdict and one line, ``to_frame()`` its events."""
    x, y = batch
    tr = nbdebug.trace(LogNet(), x, y, F.cross_entropy)
    panel = tr.show(backend="output")
    assert isinstance(panel, ipw.VBox) and "nbdebug-debugger" in panel._dom_classes
    assert tr.ok is False and tr.summary().startswith("NaN produced in")
    assert len(tr.to_frame()) == len(tr.events)
    healthy = nbdebug.trace(LogNet(bad=False), x, y, F.cross_entropy)
    assert healthy.ok is True and healthy.summary() == "healthy"
    header = healthy.show().children[1].children[0].value
    assert debug(healthy).header.value == header
