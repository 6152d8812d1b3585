"""The feature tabs of the debugger: Gradcheck, Drift and Labels.

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

    * Gradcheck: when the debugger has a model and a batch (the module sweep runs on
      request, from the tab's button).
    * Drift: when a ``reference`` batch is given (the current batch is ``inputs``).
    * Labels: when ``labels`` and ``pred_probs`` are given (the samples are ``inputs``).
    """
    if model is not None and inputs is not None:
        from .gradcheck import GradcheckPanel

        dbg.add_tab("Gradcheck", GradcheckPanel(model=model, inputs=inputs, backend=backend))
    if reference is not None:
        if model is None or inputs is None:
            raise TypeError("reference= needs the model and its current batch (debug(model, inputs, reference=...)).")
        from ..analysis.drift import drift
        from .drift import DriftPanel

        dbg.add_tab("Drift", DriftPanel(drift(model, reference, _as_table(inputs)), backend=backend))
    if labels is not None or pred_probs is not None:
        if labels is None or pred_probs is None or inputs is None:
            raise TypeError("the Labels tab needs both labels= and pred_probs= (and the samples as the batch).")
        from ..analysis.labels import find_label_issues
        from .labels import LabelCleaner

        issues = find_label_issues(labels, pred_probs=pred_probs)
        dbg.add_tab("Labels", LabelCleaner(_as_table(inputs), labels, issues, journal=journal, backend=backend))


def _as_table(inputs: Any) -> Any:
    """The batch as one 2-D table for drift and label review (a single tensor input)."""
    import torch

    if isinstance(inputs, (tuple, list)) and len(inputs) == 1:
        inputs = inputs[0]
    if isinstance(inputs, torch.Tensor):
        return inputs.detach().cpu().numpy()
    return inputs
