"""The Gradcheck panel and its figure, driven from Python: pair selector, heatmaps, verdict,
the "check all modules" button with its progress bar and table."""

from __future__ import annotations

import ipywidgets as widgets
import numpy as np
import pytest
import torch
from torch import nn

from nbdebug.analysis.gradcheck import gradcheck
from nbdebug.figures.gradcheck import PANELS, WORST_TRACE, gradcheck_figure, window
from nbdebug.widgets.gradcheck import GradcheckPanel

f64 = torch.float64


class MatMulTransposed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g @ b, a.t() @ g  # should be g @ b.t()


class WrongSignLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return -(g @ w), g.t() @ x  # the input gradient has the wrong sign


class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 6) * 0.3)

    def forward(self, x):
        return WrongSignLinear.apply(x, self.weight)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(3, 6), nn.Tanh(), Broken(), nn.ReLU(), nn.Linear(4, 2), nn.Identity()
    )


@pytest.fixture
def result():
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2, 3, generator=g, dtype=f64).requires_grad_()
    b = torch.randn(3, 3, generator=g, dtype=f64).requires_grad_()
    return gradcheck(MatMulTransposed.apply, a, b)


def _z(fig, i):
    return np.asarray(fig.data[i].z, dtype=float)


def _assert_shows(panel: GradcheckPanel, pair) -> None:
    fig = panel.view.figure
    assert [t.name for t in fig.data[:3]] == list(PANELS)
    np.testing.assert_allclose(_z(fig, 0), pair.analytic)
    np.testing.assert_allclose(_z(fig, 1), pair.numerical)
    np.testing.assert_allclose(_z(fig, 2), np.abs(pair.analytic - pair.numerical))
    for t in fig.data[3:]:
        assert t.name == WORST_TRACE
        assert (t.x[0], t.y[0]) == (pair.worst[1], pair.worst[0])
    assert pair.label in fig.layout.title.text


@pytest.mark.parametrize("backend", ["figurewidget", "output"])
def test_panel_shows_the_pairs_and_follows_the_selector(result, backend):
    panel = GradcheckPanel(result, backend=backend)
    assert panel.view.backend == backend
    assert [v for _, v in panel.pair_select.options] == [0, 1]
    assert panel.pair_select.value == 0  # the wrong pair first
    assert panel.pair.input == "input[0]"
    _assert_shows(panel, result.pairs[0])
    assert "backward is wrong" in panel.verdict.value and "input[0]" in panel.verdict.value
    assert panel.sweep_button.disabled

    panel.select_pair(1)
    assert panel.pair.input == "input[1]"
    _assert_shows(panel, result.pairs[1])
    assert "ok" in panel.verdict.value and "backward is wrong" not in panel.verdict.value
    assert "GradcheckPanel(pairs=2" in repr(panel)


def test_shared_colour_scale_and_window():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, generator=g, dtype=f64).requires_grad_()
    res = gradcheck(torch.sin, x, max_elements=40)
    pair = res.pairs[0]
    fig = gradcheck_figure(pair, max_cells=8)
    r0, r1, c0, c1 = window(pair, 8)
    assert (r1 - r0, c1 - c0) == (8, 8)
    assert r0 <= pair.worst[0] < r1 and c0 <= pair.worst[1] < c1
    assert _z(fig, 0).shape == (8, 8)
    assert all(t.coloraxis == "coloraxis" for t in fig.data[:3])
    m = fig.layout.coloraxis.cmax
    assert fig.layout.coloraxis.cmin == -m
    top = max(np.nanmax(np.abs(_z(fig, i))) for i in range(3))
    assert m == pytest.approx(top)
    assert "rows" in fig.layout.title.text and "of 40" in fig.layout.title.text
    empty = gradcheck_figure(None)
    assert len(empty.data) == 0 and "no gradcheck result" in empty.layout.annotations[0].text


@pytest.mark.parametrize("backend", ["figurewidget", "output"])
def test_check_all_modules_button_fills_the_table(backend):
    model = _model()
    x = torch.randn(8, 3)
    panel = GradcheckPanel(model=model, inputs=x, backend=backend)
    assert not panel.sweep_button.disabled
    assert panel.table.options == ()
    panel.sweep_button.click()
    df = panel.sweep
    assert df is not None and len(df) == 6
    assert panel.progress.value == panel.progress.max == 6
    assert [v for _, v in panel.table.options] == list(df["module"])
    assert "1 with a wrong backward" in panel.status.value
    # the broken module is selected and its heatmaps shown
    assert panel.table.value == "2"
    assert panel.result is df.attrs["results"]["2"]
    assert panel.pair.input == "input[0]" and panel.pair.verdict == "backward is wrong"
    _assert_shows(panel, panel.pair)
    assert "module 2" in panel.title.value

    # selecting another row shows that module
    panel.select_module("4")
    assert panel.result is df.attrs["results"]["4"]
    assert {p.input for p in panel.result.pairs} == {"input[0]", "weight", "bias"}
    _assert_shows(panel, panel.pair)
    assert panel.pair.verdict == "ok"
    panel.select_pair([p.input for p in panel.result.pairs].index("bias"))
    _assert_shows(panel, panel.result.pair(input="bias"))
    assert not panel.sweep_button.disabled


def test_skipped_row_and_sweep_errors():
    class Boom(nn.Module):
        def forward(self, x):
            raise RuntimeError("boom")

    panel = GradcheckPanel(model=nn.Sequential(nn.Linear(3, 3), Boom()), inputs=torch.randn(4, 3))
    assert panel.run_sweep() is None
    assert "raised RuntimeError" in panel.status.value and not panel.sweep_button.disabled

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(3, 3)
            self.unused = nn.Linear(3, 3)

        def forward(self, x):
            return self.a(x)

    panel = GradcheckPanel(model=Net(), inputs=torch.randn(4, 3))
    df = panel.run_sweep()
    assert list(df["module"]) == ["a", "unused"]
    panel.select_module("unused")
    assert panel.result is None and panel.pair is None
    assert "skipped" in panel.verdict.value and "not called" in panel.verdict.value
    assert len(panel.view.figure.data) == 0


def test_bad_construction():
    with pytest.raises(TypeError, match="GradcheckResult"):
        GradcheckPanel("not a result")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="inputs"):
        GradcheckPanel(model=nn.Linear(2, 2))
    with pytest.raises(ValueError, match="model"):
        GradcheckPanel(inputs=torch.randn(2, 2))
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        GradcheckPanel(model="m", inputs=torch.randn(2, 2))


def test_show_returns_the_panel_widget(result):
    w = result.show(backend="output")
    assert isinstance(w, widgets.VBox)
    assert any(isinstance(c, widgets.Dropdown) and len(c.options) == 2 for c in w.children)
    empty = GradcheckPanel()
    assert empty.result is None and "no result yet" in empty.title.value
    assert len(empty.view.figure.data) == 0


def test_displaying_the_result_shows_the_panel_in_a_kernel(result, monkeypatch):
    import nbdebug.analysis.gradcheck.result as gc

    plain = result._repr_mimebundle_()
    assert set(plain) == {"text/plain", "text/html"}  # no kernel: text and a table
    assert "backward is wrong" in plain["text/html"]
    monkeypatch.setattr(gc, "_in_kernel", lambda: True)
    bundle = result._repr_mimebundle_()
    view = bundle["application/vnd.jupyter.widget-view+json"]
    assert view["model_id"] and bundle["text/plain"] == repr(result)
    from ipywidgets.widgets.widget import _instances

    assert isinstance(_instances[view["model_id"]], widgets.VBox)


def test_a_wrong_backward_found_by_the_tab_takes_the_green_healthy_off_the_header():
    import torch.nn.functional as F

    import nbdebug

    x, y = torch.randn(8, 3), torch.randint(0, 2, (8,))
    dbg = nbdebug.debug(_model(), x, y, F.cross_entropy)
    assert "healthy" in dbg.header.value  # a finite trace, before any sweep
    dbg.panel("Gradcheck").sweep_button.click()
    assert "1 with a wrong backward" in dbg.panel("Gradcheck").status.value
    assert "healthy" not in dbg.header.value and "no NaN/Inf" in dbg.header.value
    dbg.close()
