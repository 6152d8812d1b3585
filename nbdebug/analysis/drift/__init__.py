"""Data drift through SHAP: :func:`drift` and its :class:`DriftReport`.

Modules, one job each: :mod:`.options` (``DriftOptions``), :mod:`.batches` (the two batches
as aligned matrices), :mod:`.models` (one calling convention for the model kinds),
:mod:`.explainers` and :mod:`.pipeline` (shap's explainers), :mod:`.explain` (SHAP values of
both batches), :mod:`.sample` (which rows are explained), :mod:`.statistics` (per-feature
tests, multiple testing), :mod:`.clustering` (SHAP space), :mod:`.classifier` (the
classifier two-sample test), :mod:`.exposure`, :mod:`.groups` (naming clusters),
:mod:`.wording`, :mod:`.report` (the result), :mod:`.from_shap` and :mod:`.from_model` (the
two entry points).
"""

from .explain import ShapValues, explain_batches, moved_direction
from .from_model import drift
from .from_shap import ShapSource, drift_from_shap
from .options import (
    ClusterOptions,
    DriftOptions,
    ExplainOptions,
    InputOptions,
    SignificanceOptions,
)
from .report import ClassifierTest, ClusterTest, DriftReport

__all__ = [
    "ClassifierTest",
    "ClusterOptions",
    "ClusterTest",
    "DriftOptions",
    "DriftReport",
    "ExplainOptions",
    "InputOptions",
    "ShapSource",
    "ShapValues",
    "SignificanceOptions",
    "drift",
    "drift_from_shap",
    "explain_batches",
    "moved_direction",
]
