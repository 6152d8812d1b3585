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
    return model, torch.tensor(x[:80], dtype=torch.float32), torch.tensor(data.target[:80]), x[200:280]


def test_gradcheck_tab_sweeps_the_debugged_model() -> None:
    model, x, y, _ = _tabular()
    dbg = nbdebug.debug(model, x, y, F.cross_entropy)
    titles = list(dbg.tabs.titles)
    assert "Gradcheck" in titles
    panel_widget = dbg.tabs.children[titles.index("Gradcheck")]
    buttons = [w for w in _walk(panel_widget) if getattr(w, "description", "") == "check all modules"]
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


def test_labels_tab_with_labels_and_probabilities(tmp_path) -> None:
    model, x, y, _ = _tabular()
    with torch.no_grad():
        probs = torch.softmax(model(x), 1).numpy()
    journal = tmp_path / "j.jsonl"
    dbg = nbdebug.debug(model, x, y, F.cross_entropy, labels=y.numpy(), pred_probs=probs, journal=journal)
    assert "Labels" in list(dbg.tabs.titles)
    with pytest.raises(TypeError, match="labels= and pred_probs="):
        nbdebug.debug(model, x, y, F.cross_entropy, labels=y.numpy())


def _walk(w):
    stack = [w]
    while stack:
        cur = stack.pop()
        yield cur
        stack.extend(getattr(cur, "children", ()) or ())
