"""figures.history.history_figure: panels, non-finite marks, skipped steps, failing step."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest

from nbdebug.figures.history import history_figure


def _history(n: int = 12, bad_at: int = 9) -> pd.DataFrame:
    rows = []
    for s in range(n):
        loss = 2.0 / (s + 1) if s < bad_at else (math.inf if s == bad_at else math.nan)
        rows.append(
            {
                "step": 100 + s,
                "loss": loss,
                "grad_norm": 10.0 ** (s / 3) if s != bad_at else math.nan,
                "param_norm": 5.0 + s,
                "lr": 0.1,
                "scale": None,
                "skipped": s >= bad_at,
            }
        )
    return pd.DataFrame(rows)


def _trace(fig: go.Figure, name: str):
    found = [t for t in fig.data if t.name == name]
    assert len(found) == 1, [t.name for t in fig.data]
    return found[0]


def test_panels_values_and_marks():
    h = _history()
    fig = history_figure(h, failing_step=109)
    names = [t.name for t in fig.data]
    # scale is all missing: no panel; the others each have one line trace
    assert "scale" not in names
    assert [a.text for a in fig.layout.annotations][:4] == [
        "loss",
        "gradient norm",
        "parameter norm",
        "learning rate",
    ]
    loss = _trace(fig, "loss")
    assert list(loss.x) == list(range(100, 112))
    y = np.asarray(loss.y, dtype=float)
    assert y[0] == pytest.approx(2.0) and np.isnan(y[9:]).all()
    # inf at 109 and nan at 110, 111 are marked at the top of the loss panel
    bad = _trace(fig, "loss non-finite")
    assert list(bad.x) == [109, 110, 111]
    assert list(bad.text) == ["inf", "nan", "nan"]
    assert list(bad.y) == pytest.approx([2.0, 2.0, 2.0])
    assert list(_trace(fig, "grad_norm non-finite").x) == [109]
    assert list(_trace(fig, "skipped").x) == [109, 110, 111]
    # the grad norm spans 1 .. 10^3.7: log axis; the loss panel stays linear
    assert fig.layout.yaxis2.type == "log"
    assert fig.layout.yaxis.type != "log"
    # the failing step: one vertical line per panel at x=109
    vlines = [s for s in fig.layout.shapes if s.type == "line" and s.x0 == s.x1]
    assert len(vlines) == 4 and {s.x0 for s in vlines} == {109}
    # its label sits inside the top panel, below the panel titles (above the panel, a
    # failing step mid-history wrote it over the "loss" title)
    (label,) = [a for a in fig.layout.annotations if a.text == "failing step 109"]
    assert (label.yref, label.y, label.yanchor, label.xanchor) == ("y domain", 1.0, "top", "left")
    titles = [a for a in fig.layout.annotations if a.text != "failing step 109"]
    assert all(a.yref == "paper" and a.yanchor == "bottom" for a in titles)


def test_scale_panel_and_no_marks_when_healthy():
    h = pd.DataFrame(
        {
            "step": [0, 1, 2],
            "loss": [1.0, 0.9, 0.8],
            "grad_norm": [1.0, 1.0, 1.0],
            "param_norm": [3.0, 3.0, 3.0],
            "lr": [None, None, None],
            "scale": [65536.0, 32768.0, 1024.0],
            "skipped": [False, True, False],
        }
    )
    fig = history_figure(h)
    names = [t.name for t in fig.data]
    assert "scale" in names and "lr" not in names
    assert not any(n.endswith("non-finite") for n in names)
    assert list(_trace(fig, "skipped").x) == [1]
    assert not fig.layout.shapes


def test_empty_history_and_input_untouched():
    h = pd.DataFrame(columns=["step", "loss", "grad_norm", "param_norm", "lr", "scale", "skipped"])
    fig = history_figure(h)
    assert len(_trace(fig, "loss").x) == 0
    h2 = _history()
    before = h2.copy(deep=True)
    history_figure(h2, failing_step=109)
    pd.testing.assert_frame_equal(h2, before)


def test_bad_input():
    with pytest.raises(TypeError, match="pandas DataFrame"):
        history_figure([{"step": 1}])
    with pytest.raises(ValueError, match="'step' column"):
        history_figure(pd.DataFrame({"loss": [1.0]}))
    with pytest.raises(TypeError, match="failing_step"):
        history_figure(_history(), failing_step="9")  # type: ignore[arg-type]


def test_diverging_loss_gets_a_log_axis():
    h = pd.DataFrame(
        {"step": range(6), "loss": [1.0, 10.0, 1e3, 1e6, 1e12, math.inf], "grad_norm": [1.0] * 6}
    )
    fig = history_figure(h, failing_step=5)
    assert fig.layout.yaxis.type == "log"
    assert list(_trace(fig, "loss non-finite").x) == [5]
    assert list(_trace(fig, "loss non-finite").y) == [1e12]


def test_unmeasured_param_norm_is_a_gap_not_a_nan():
    h = pd.DataFrame({"step": range(4), "loss": [1.0] * 4, "param_norm": [3.0, None, None, 3.5]})
    fig = history_figure(h)
    names = [t.name for t in fig.data]
    assert "param_norm" in names and "param_norm non-finite" not in names
    assert (
        _trace(fig, "param_norm").connectgaps is True and _trace(fig, "loss").connectgaps is False
    )
