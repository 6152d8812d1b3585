"""The feature tabs of the debugger: Checks, Gradcheck, Drift and Labels.

:func:`add_feature_tabs` composes the panels of the other features into a
:class:`~nbdebug.widgets.app.Debugger`; each panel lives in its own file and computes
nothing itself (the results come from ``nbdebug.analysis``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .app import Debugger


def add_feature_tabs(
    dbg: Debugger,
    *,
    model: Any = None,
    inputs: Any = None,
    reference: Any = None,
    labels: Any = None,
    pred_probs: Any = None,
    journal: str | os.PathLike[str] = "labels.journal.jsonl",
    backend: str | None = None,
) -> None:
    """Add the tabs that the given data allow.

    * Checks: always (the health checks of the trace shown, refreshed on re-run);
      clicking a finding moves the Step tab to its event or highlights its parameter in
      the Layers tab, and the header shows the counts of errors and warnings.
    * Gradcheck: when the debugger has a model and a batch (the module sweep runs on
      request, from the tab's button).
    * Drift: when a ``reference`` batch is given (the current batch is ``inputs``).
    * Labels: when ``labels`` and ``pred_probs`` are given (the samples are ``inputs``).
    """
    _add_checks(dbg)
    if model is not None and inputs is not None:
        from .gradcheck import GradcheckPanel

        dbg.add_tab("Gradcheck", GradcheckPanel(model=model, inputs=inputs, backend=backend))
    if reference is not None:
        if model is None or inputs is None:
            raise TypeError(
                "reference= needs the model and its current batch (debug(model, inputs, reference=...))."
            )
        from ..analysis.drift import drift
        from .drift import DriftPanel

        dbg.add_tab(
            "Drift", DriftPanel(drift(model, reference, _as_table(inputs)), backend=backend)
        )
    if labels is not None or pred_probs is not None:
        if labels is None or pred_probs is None or inputs is None:
            raise TypeError(
                "the Labels tab needs both labels= and pred_probs= (and the samples as the batch)."
            )
        from ..analysis.labels import find_label_issues
        from .labels import LabelCleaner

        issues = find_label_issues(labels, pred_probs=pred_probs)
        dbg.add_tab(
            "Labels",
            LabelCleaner(_as_table(inputs), labels, issues, journal=journal, backend=backend),
        )


def _add_checks(dbg: Debugger) -> None:
    from ..analysis.checks import check
    from .checks import ChecksPanel, badge, counts_summary

    def on_select(finding: Any) -> None:
        if finding.event is not None:
            dbg.step.goto(finding.event)
            dbg.select_tab("Step")
        elif finding.param is not None:
            dbg.layers.select(finding.param)
            dbg.select_tab("Layers")

    def refresh(findings: Any) -> None:
        worst = (
            "error"
            if any(f.severity == "error" for f in findings)
            else ("warning" if any(f.severity == "warning" for f in findings) else "info")
        )
        dbg.set_header_extra(badge(counts_summary(findings), worst))

    findings = check(dbg.trace)
    panel = ChecksPanel(findings, on_select=on_select)
    refresh(findings)
    dbg.add_tab("Checks", panel)

    def on_retrace(d: Debugger) -> None:
        fresh = check(d.trace)
        panel.update(fresh)
        refresh(fresh)

    dbg.on_retrace(on_retrace)


def _as_table(inputs: Any) -> Any:
    """The batch as one 2-D table for drift and label review (a single tensor input)."""
    import torch

    if isinstance(inputs, (tuple, list)) and len(inputs) == 1:
        inputs = inputs[0]
    if isinstance(inputs, torch.Tensor):
        return inputs.detach().cpu().numpy()
    return inputs
