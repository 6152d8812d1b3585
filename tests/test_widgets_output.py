"""The Output plot back end (the default) fills its ``ipywidgets.Output`` by setting its
``outputs``, never by capturing display messages: under nbclient each captured message made
the client write the widget's outputs back to the kernel on the shell channel while it waited
there for the cell's reply, and the lesson notebooks stalled for the whole cell timeout
(jupyter/nbclient#312); in a terminal shell the captures printed clear-line codes."""

from __future__ import annotations

import json

import ipywidgets as ipw
import numpy as np
import plotly.graph_objects as go
import plotly.io as pio
import pytest
import torch
import torch.nn.functional as F
from test_label_cleaner import make_case
from test_widgets import LogNet

from nbdebug.widgets import plot
from nbdebug.widgets.app import debug
from nbdebug.widgets.labels import LabelCleaner
from nbdebug.widgets.output import object_output, show_outputs
from nbdebug.widgets.plot import PlotView, figure_output, get_backend, set_backend

PLOTLY_JSON = "application/vnd.plotly.v1+json"


@pytest.fixture
def no_capture(monkeypatch):
    """Any capture into an Output widget (``with out:``, ``out.clear_output``) fails."""

    def refuse(*args, **kwargs):
        raise AssertionError("an Output widget captured display messages")

    monkeypatch.setattr(ipw.Output, "__enter__", refuse)
    monkeypatch.setattr(ipw.Output, "clear_output", refuse)
    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")


def _plotted(out: ipw.Output) -> dict:
    (shown,) = out.outputs
    assert shown["output_type"] == "display_data"
    return shown["data"][PLOTLY_JSON]


def test_a_view_sets_its_outputs_and_an_unchanged_figure_sends_nothing(no_capture, capsys):
    view = PlotView(go.Figure(go.Scatter(y=[1, 3, 2], name="a")), backend="output")
    assert isinstance(view.widget, ipw.Output)
    assert _plotted(view.widget)["data"][0]["y"] == [1, 3, 2]
    sent: list[tuple] = []
    view.widget.observe(lambda c: sent.append(c["new"]), names="outputs")
    with view.batch_update() as f:
        f.data[0].y = [4, 5, 6]
    assert len(sent) == 1 and _plotted(view.widget)["data"][0]["y"] == [4, 5, 6]
    with view.batch_update():
        pass
    view.replace(go.Figure(view.figure))
    assert len(sent) == 1  # the same figure again: no state update at all
    view.replace(go.Figure(go.Bar(y=[7]), layout={"title": {"text": "new"}}))
    assert len(sent) == 2
    assert _plotted(view.widget)["layout"]["title"]["text"] == "new"
    json.dumps(view.widget.outputs)  # the state is plain JSON (numpy arrays encoded)
    assert capsys.readouterr().out == ""  # a terminal shell prints no clear-line codes


def test_numpy_data_is_json_ready(no_capture):
    view = PlotView(go.Figure(go.Scatter(y=np.arange(3.0))), backend="output")
    json.dumps(view.widget.outputs)


def test_figure_output_per_renderer(monkeypatch, capsys):
    """The mime types of plotly's default renderers, never plotly.js itself (5 MB)."""
    fig = go.Figure(go.Scatter(y=[1, 2]))
    for default in ("plotly_mimetype", "plotly_mimetype+notebook", "vscode", "browser", None):
        monkeypatch.setattr(pio.renderers, "default", default)
        assert set(figure_output(fig)["data"]) == {PLOTLY_JSON}, default
    monkeypatch.setattr(pio.renderers, "default", "colab")
    html = figure_output(fig)["data"]["text/html"]
    assert "cdn.plot.ly" in html and len(html) < 100_000
    assert capsys.readouterr().out == ""  # the notebook renderer's plotly.js is not printed


def test_a_debugger_draws_every_figure_without_capture(no_capture):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)
    dbg = debug(LogNet(), x, y, F.cross_entropy, backend="output")
    step = dbg.step
    norms = step.norms.widget
    before = _plotted(norms)
    step.buttons["origin"].click()
    after = _plotted(norms)
    assert after != before  # the current-event ring moved
    assert all(_plotted(v.widget)["data"] for v in (step.norms, dbg.layers.plot))


def test_the_default_back_end_is_output_everywhere(monkeypatch):
    monkeypatch.setattr(plot, "_backend", None)
    monkeypatch.delenv("NBDEBUG_PLOT_BACKEND", raising=False)
    assert get_backend() == "output"
    monkeypatch.setenv("NBDEBUG_PLOT_BACKEND", "figurewidget")
    assert get_backend() == "figurewidget"
    set_backend("auto")
    assert get_backend() == "output"
    with pytest.raises(ValueError, match="plot backend must be one of"):
        set_backend("matplotlib")


def test_show_outputs_and_object_output():
    out = ipw.Output()
    show_outputs(out, object_output("<b>x</b>"), object_output(3))
    assert [o["data"]["text/plain"] for o in out.outputs] == ["'<b>x</b>'", "3"]
    show_outputs(out)
    assert out.outputs == ()


def test_a_custom_sample_view_is_set_not_captured(no_capture, tmp_path):
    _, noisy, issues = make_case(120)
    texts = [f"review {i}" for i in range(120)]
    label = ipw.Label("a widget")
    html = LabelCleaner(
        texts, noisy, issues, render=lambda s, i: f"<b>{s}</b>", journal=tmp_path / "a.jsonl"
    )
    (shown,) = html.sample_out.outputs
    assert shown["data"]["text/html"] == f"<b>review {html.current}</b>"
    wid = LabelCleaner(
        texts, noisy, issues, render=lambda s, i: label, journal=tmp_path / "b.jsonl"
    )
    (shown,) = wid.sample_out.outputs
    assert shown["data"]["application/vnd.jupyter.widget-view+json"]["model_id"] == label.model_id
    fig = LabelCleaner(
        texts,
        noisy,
        issues,
        render=lambda s, i: go.Figure(go.Bar(y=[i])),
        journal=tmp_path / "c.jsonl",
    )
    assert _plotted(fig.sample_out)["data"][0]["y"] == [fig.current]


def test_figure_output_is_what_plotly_sends(monkeypatch):
    """The JSON mime type is built in fewer passes than plotly's renderer: the same data."""
    import datetime

    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")
    fig = go.Figure(
        [
            go.Scatter(x=np.arange(4), y=np.array([1.0, np.nan, np.inf, -2.5]), name="</script>"),
            go.Bar(x=[datetime.date(2026, 1, d) for d in (1, 2)], y=(float("nan"), np.float32(3))),
        ],
        layout={"title": {"text": "<b>t</b>"}},
    )
    ours = figure_output(fig)["data"][PLOTLY_JSON]
    assert ours == pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())[PLOTLY_JSON]
    assert ours["data"][1]["y"][0] is None  # NaN as null, as plotly writes it
    json.dumps(ours, allow_nan=False)
