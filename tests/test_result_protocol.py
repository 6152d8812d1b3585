"""One result protocol (DESIGN.md): every result type has ``summary() -> str`` (one
sentence), ``ok: bool``, ``to_frame() -> DataFrame``, ``show()`` (its panel widget) and a
readable ``__repr__``."""

from __future__ import annotations

import inspect

import ipywidgets as widgets
import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

import nbdebug

RESULTS = ["Trace", "Findings", "GradcheckResult", "DriftReport", "LabelIssues", "Diagnosis"]
RESULTS += ["RanksReport"]


@pytest.mark.parametrize("name", RESULTS)
def test_every_result_type_has_the_protocol(name: str) -> None:
    cls = getattr(nbdebug, name)
    for member in ("summary", "to_frame", "show"):
        assert callable(getattr(cls, member, None)), f"{name}.{member} is not a method"
    assert "ok" in dir(cls) or "ok" in getattr(cls, "__dataclass_fields__", {}), name
    assert "__repr__" in {k for c in cls.__mro__[:-1] for k in vars(c)}, name
    assert not inspect.signature(cls.summary).parameters.keys() - {"self"}, name


def _one_sentence(text: object) -> None:
    assert isinstance(text, str) and text.strip(), text
    assert "\n" not in text.strip(), text


def _cheap_results() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    tr = nbdebug.trace(model, x, target=y, loss_fn=F.cross_entropy)
    found = nbdebug.check(tr)
    grad = nbdebug.gradcheck(torch.sin, torch.randn(3, dtype=torch.float64, requires_grad=True))
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(3), size=30)
    labels = probs.argmax(1)
    labels[:3] = (labels[:3] + 1) % 3
    issues = nbdebug.find_label_issues(labels, pred_probs=probs)
    return {"Trace": tr, "Findings": found, "GradcheckResult": grad, "LabelIssues": issues}


def test_cheap_results_answer_the_protocol_and_show_a_widget() -> None:
    for name, result in _cheap_results().items():
        assert isinstance(result, getattr(nbdebug, name)), name
        _one_sentence(result.summary())
        assert isinstance(result.ok, bool), name
        assert isinstance(result.to_frame(), pd.DataFrame), name
        assert type(result.to_frame()) is pd.DataFrame, f"{name}.to_frame() is a plain frame"
        text = repr(result)
        assert text and len(text) < 2000 and "tensor(" not in text, (name, text[:200])
        panel = result.show()
        shown = getattr(panel, "widget", panel)
        assert isinstance(shown, widgets.DOMWidget), (name, type(panel))
