"""The Fixes tab (nbdebug/widgets/fixes.py), driven in Python: the diagnose button, the
ranked table, a try button per fix, the snippet to copy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from diagnose_scenarios import CASES, NormNet, constant_row
from state import assert_unchanged, fingerprint

import nbdebug
from nbdebug.widgets.fixes import FixesPanel


def _snapshot(tmp_path: Path) -> Path:
    return CASES[0].build(tmp_path)["source"]


def test_fixes_panel_diagnoses_on_request_and_tries_a_fix(tmp_path: Path) -> None:
    path = _snapshot(tmp_path)
    snap = nbdebug.load_snapshot(path, model=NormNet)
    calls: list[Any] = []
    tried: list[tuple[Any, Any]] = []

    def run() -> Any:
        calls.append(1)
        return nbdebug.diagnose(snap, loss_fn=torch.nn.functional.cross_entropy, progress=False)

    panel = FixesPanel(run, on_try=lambda tr, row: tried.append((tr, row)))
    assert panel.diagnosis is None and not calls and panel.table.value == ""
    assert repr(panel) == "FixesPanel(not diagnosed yet)"
    panel.button.click()
    assert calls == [1] and panel.diagnosis is not None
    d = panel.diagnosis
    assert "Cause:" in panel.cause.value and "Normalize" in panel.cause.value
    assert panel.table.value.startswith('<table class="fixes">')
    assert panel.table.value.count("<tr") == len(d.results) + 1
    assert len(panel.tries.children) == len(d.results)
    # the top fix's snippet, ready to copy
    assert "(sd + 1e-06)" in panel.snippet.value
    # try #1: the step traced with the epsilon is healthy; the plain re-run is not
    try_buttons = [row.children[0] for row in panel.tries.children]
    assert [b.description for b in try_buttons] == [f"try #{r.rank}" for r in d.results]
    try_buttons[0].click()
    ((tr, row),) = tried
    assert row.rank == 1 and row.kind == "epsilon" and tr.healthy and panel.tried is tr
    plain_rank = next(r.rank for r in d.results if r.kind == "rerun")
    try_buttons[plain_rank - 1].click()
    assert tried[-1][0].origin is not None and tried[-1][0].origin.module == "norm"
    assert "tried #" in panel.status.value
    with pytest.raises(ValueError, match="no fix of rank 99"):
        panel.try_fix(99)


def test_fixes_panel_bad_arguments() -> None:
    with pytest.raises(TypeError, match="needs diagnose="):
        FixesPanel()
    with pytest.raises(TypeError, match="must be an nbdebug Diagnosis"):
        FixesPanel(diagnosis="no")


def test_the_debugger_has_a_fixes_tab_whose_try_shows_the_fixed_step(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = NormNet()
    x, y = constant_row()
    before = fingerprint(model, versions=True)
    dbg = nbdebug.debug(model, x, y, torch.nn.functional.cross_entropy)
    try:
        assert "Fixes" in dbg.tabs.titles
        panel = dbg.panel("Fixes")
        assert isinstance(panel, FixesPanel) and panel.diagnosis is None  # on request only
        assert dbg.trace.origin is not None and dbg.trace.origin.module == "norm"
        panel.button.click()
        assert panel.diagnosis is not None and panel.diagnosis.cause.kind == "epsilon"
        panel.tries.children[0].children[0].click()  # try #1
        assert dbg.trace.healthy and dbg.trace is panel.tried
        assert dbg.tabs.titles[dbg.tabs.selected_index] == "Step"
        assert "with fix #1 applied: an epsilon" in dbg.header.value
        assert dbg.step.cursor.event is not None
        # re-run goes back to the step as it is
        dbg.rerun()
        assert dbg.trace.origin is not None and "with fix" not in dbg.header.value
    finally:
        dbg.close()
    assert_unchanged(before, model)


def test_a_snapshot_debugger_diagnoses_the_snapshot(tmp_path: Path) -> None:
    path = _snapshot(tmp_path)
    dbg = nbdebug.debug(path, model=NormNet, loss_fn=torch.nn.functional.cross_entropy)
    try:
        d = dbg.panel("Fixes").run()
        assert d.step == 6 and d.cause.kind == "epsilon" and d.cause.module == "norm"
        assert d.reference["loss"] is not None  # the snapshot's history
    finally:
        dbg.close()


def test_a_recorded_trace_has_the_fixes_tab_of_its_call() -> None:
    torch.manual_seed(0)
    x, y = constant_row()
    tr = nbdebug.trace(NormNet(), x, y, torch.nn.functional.cross_entropy)
    dbg = nbdebug.debug(tr)  # the trace's recorded model and batch (issue 33)
    try:
        assert "Fixes" in dbg.tabs.titles
    finally:
        dbg.close()
