"""The feature tabs composed into the debugger by nbdebug.debug()."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.datasets import load_breast_cancer
from torch import nn

import nbdebug


def _tabular() -> tuple[nn.Module, torch.Tensor, torch.Tensor, np.ndarray]:
    data = load_breast_cancer()
    x = (data.data - data.data.mean(0)) / data.data.std(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(30, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    return (
        model,
        torch.tensor(x[:80], dtype=torch.float32),
        torch.tensor(data.target[:80]),
        x[200:280],
    )


def test_gradcheck_tab_sweeps_the_debugged_model() -> None:
    model, x, y, _ = _tabular()
    dbg = nbdebug.debug(model, x, y, F.cross_entropy)
    titles = list(dbg.tabs.titles)
    assert "Gradcheck" in titles
    panel_widget = dbg.tabs.children[titles.index("Gradcheck")]
    buttons = [
        w for w in _walk(panel_widget) if getattr(w, "description", "") == "check all modules"
    ]
    assert buttons, "the Gradcheck tab has a sweep button"
    buttons[0].click()
    import ipywidgets as widgets

    tables = [w for w in _walk(panel_widget) if isinstance(w, widgets.Select) and w.options]
    assert tables, "the sweep filled its table"
    # every leaf module of the debugged model was checked and passed
    assert [value for _, value in tables[0].options] == ["0", "1", "2"]
    assert all(label.startswith("✓") for label, _ in tables[0].options)


def test_drift_tab_with_a_reference_batch() -> None:
    model, x, y, ref = _tabular()
    dbg = nbdebug.debug(model, x, y, F.cross_entropy, reference=ref[:60])
    assert "Drift" in list(dbg.tabs.titles)


def test_a_drift_alarm_is_not_shown_beside_a_green_healthy_badge() -> None:
    """The trace has no NaN/Inf, the Drift tab raises its red DRIFT badge: the header reads
    a grey "no NaN/Inf", not a green "healthy"; without an alarm it stays green."""
    model, x, y, _ = _tabular()
    shifted = nbdebug.debug(model, x[40:] + 1.5, y[40:], F.cross_entropy, reference=x[:40])
    drift_panel = shifted.panel("Drift")
    assert shifted.trace.healthy and drift_panel.report.alarm
    assert "DRIFT" in drift_panel.summary.value
    assert "nbdebug-badge-ok" not in shifted.header.value
    assert "nbdebug-badge-plain" in shifted.header.value and "no NaN/Inf" in shifted.header.value
    assert repr(shifted).endswith("; no NaN/Inf)")  # the repr says what the header says
    shifted.rerun()  # kept across re-runs
    assert "nbdebug-badge-ok" not in shifted.header.value
    same = nbdebug.debug(model, x[40:], y[40:], F.cross_entropy, reference=x[40:])
    assert not same.panel("Drift").report.alarm  # the batch against itself
    assert "nbdebug-badge-ok" in same.header.value and ">healthy<" in same.header.value
    assert repr(same).endswith("; healthy)")


def test_labels_tab_with_labels_and_probabilities(tmp_path) -> None:
    model, x, y, _ = _tabular()
    with torch.no_grad():
        probs = torch.softmax(model(x), 1).numpy()
    journal = tmp_path / "j.jsonl"
    dbg = nbdebug.debug(
        model, x, y, F.cross_entropy, labels=y.numpy(), pred_probs=probs, journal=journal
    )
    assert "Labels" in list(dbg.tabs.titles)
    with pytest.raises(TypeError, match="labels= and pred_probs="):
        nbdebug.debug(model, x, y, F.cross_entropy, labels=y.numpy())


def test_an_unknown_keyword_names_itself_and_the_allowed_ones() -> None:
    model, x, y, _ = _tabular()
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'refrence'.*reference"):
        nbdebug.debug(model, x, y, F.cross_entropy, refrence=x)
    with pytest.raises(TypeError, match=r"'shape'.*image_shape"):
        nbdebug.LabelCleaner(x, y, None, shape=(5, 6))


def _walk(w):
    stack = [w]
    while stack:
        cur = stack.pop()
        yield cur
        stack.extend(getattr(cur, "children", ()) or ())


def test_checks_tab_counts_in_header_and_click_moves_the_cursor() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from models import by_name

    s = by_name("log_zero_in_loss")
    dbg = nbdebug.debug(s.model, s.inputs, s.target, s.loss_fn)
    titles = list(dbg.tabs.titles)
    assert titles[:3] == ["Step", "Layers", "Checks"]
    findings = nbdebug.check(dbg.trace)
    n_err = sum(f.severity == "error" for f in findings)
    assert n_err >= 1 and f"{n_err} error" in dbg.header.value
    panel_widget = dbg.tabs.children[titles.index("Checks")]
    from nbdebug.widgets.checks import ChecksPanel

    panel = dbg.panel("Checks")
    assert isinstance(panel, ChecksPanel) and panel.widget is panel_widget
    with_event = next(i for i, f in enumerate(panel.findings) if f.event is not None)
    dbg.step.goto(0)
    dbg.select_tab("Checks")
    panel.select(with_event)
    assert (
        dbg.current_event is not None
        and dbg.current_event.index == panel.findings[with_event].event
    )
    # the click keeps the Checks tab (and its advice) in front; its button shows the event
    assert dbg.tabs.selected_index == titles.index("Checks")
    assert panel.goto_button.layout.display != "none"
    panel.goto_button.click()
    assert dbg.tabs.selected_index == 0


def test_the_debugger_and_its_buttons_leave_the_model_as_it_was() -> None:
    from models import bn_dropout_model
    from state import assert_unchanged, fingerprint

    model = bn_dropout_model()
    x, y = torch.randn(5, 3, 6, 6), torch.tensor([0, 1, 2, 0, 1])
    before = fingerprint(model)
    dbg = nbdebug.debug(model, x, y, F.cross_entropy)
    for key in ("next", "last", "origin", "first"):
        dbg.step.buttons[key].click()
    dbg.rerun_button.click()
    dbg.panel("Gradcheck").run_sweep()
    assert_unchanged(before, model)


def test_the_gradcheck_plot_is_hidden_while_it_has_nothing_to_draw() -> None:
    """No result, or every module passing, leaves no large empty box under the table; a
    result with a pair shows its heatmaps."""
    model, x, y, _ = _tabular()
    dbg = nbdebug.debug(model, x, y, F.cross_entropy)
    panel = dbg.panel("Gradcheck")
    assert panel.plot_box.layout.display == "none"
    panel.run_sweep()
    assert panel.pair is None and panel.plot_box.layout.display == "none"
    t = torch.randn(3, dtype=torch.float64, requires_grad=True)
    result = nbdebug.gradcheck(lambda t: (t * t).sum(), t)
    panel.show_result(result)
    assert panel.pair is not None and len(panel.view.figure.data) > 0
    assert panel.plot_box.layout.display != "none"
