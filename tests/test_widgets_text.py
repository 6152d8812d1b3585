"""What two tabs show in words: the Gradcheck tab's pair selector only where there is a pair
to pick, and the Fixes tab's costs to 2-3 significant digits."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from diagnose_scenarios import CASES, NormNet
from torch import nn

import nbdebug
from nbdebug.analysis.gradcheck import gradcheck
from nbdebug.figures.report import cost_text
from nbdebug.widgets.fixes import FixesPanel
from nbdebug.widgets.gradcheck import GradcheckPanel

f64 = torch.float64


def _shown(dropdown) -> bool:
    return dropdown.layout.display != "none"


def test_the_pair_selector_is_hidden_with_nothing_to_pick():
    empty = GradcheckPanel(backend="output")
    assert not _shown(empty.pair_select) and "no result yet" in empty.title.value

    torch.manual_seed(0)
    panel = GradcheckPanel(
        model=nn.Sequential(nn.Linear(3, 4), nn.Tanh()), inputs=torch.randn(6, 3), backend="output"
    )
    assert not _shown(panel.pair_select)  # before the sweep
    panel.sweep_button.click()
    # every module passes: no result on screen, so no selector either
    assert panel.result is None and not _shown(panel.pair_select)
    assert "no module with a wrong backward" in panel.verdict.value
    panel.select_module("0")  # the Linear: input, weight and bias to pick from
    assert _shown(panel.pair_select) and not panel.pair_select.disabled
    labels = [label for label, _ in panel.pair_select.options]
    assert [n for n in ("input[0]", "weight", "bias") for lab in labels if n in lab] == [
        "input[0]",
        "weight",
        "bias",
    ]
    panel.select_module("1")  # the Tanh: one pair, named but not a choice
    assert _shown(panel.pair_select) and panel.pair_select.disabled
    assert panel.pair_select.tooltip == "the only (output, input) pair of this check"
    ((label, _),) = panel.pair_select.options
    assert "input[0]" in label and label.endswith(": ok")


def test_a_single_pair_result_names_its_pair_without_a_choice():
    x = torch.randn(5, dtype=f64, requires_grad=True)
    panel = GradcheckPanel(gradcheck(torch.sin, x), backend="output")
    assert _shown(panel.pair_select) and panel.pair_select.disabled
    assert len(panel.pair_select.options) == 1


@pytest.mark.parametrize(
    ("cost", "text"),
    [
        (173.47, "173x"),
        (1234.5, "1234x"),
        (99.6, "100x"),
        (12.34, "12x"),
        (1.449, "1.4x"),
        (2.0, "2x"),
        (0.953, "0.95x"),
        (0.0312, "0.031x"),
        (None, "-"),
        (float("nan"), "-"),
    ],
)
def test_cost_text(cost, text):
    assert cost_text(cost) == text


def test_the_fixes_table_shows_costs_to_a_few_digits(tmp_path: Path):
    snap = nbdebug.load_snapshot(CASES[0].build(tmp_path)["source"], model=NormNet)
    d = nbdebug.diagnose(snap, loss_fn=torch.nn.functional.cross_entropy, progress=False)
    panel = FixesPanel(diagnosis=d)
    rows = re.findall(r"<tr[^>]*>(.*?)</tr>", panel.table.value, flags=re.S)[1:]
    costs = [re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.S)[7] for row in rows]
    assert costs == [cost_text(r.cost) for r in d.results]
    assert "1x" in costs  # the plain replay: its own cost
    for c in costs:  # at most 3 significant digits, no "173.47x"
        assert c == "-" or len(re.sub(r"^0\.0*|\.|x$", "", c)) <= 3, c
