"""Label noise: :func:`find_label_issues` and the review of what it finds.

Modules, one job each: :mod:`.options` (``LabelOptions``), :mod:`.inputs` (labels and
probabilities checked), :mod:`.probabilities` (supplied or out of fold, :mod:`.oof`,
:mod:`.torch_classifier`), :mod:`.confident_learning` (the estimator),
:mod:`.flags` (which samples are flagged), :mod:`.result` (``LabelIssues``,
``LabelNoise``), :mod:`.find` (the entry point), :mod:`.journal` and :mod:`.review` (the
reviewer's decisions, without any UI).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .find import find_label_issues
from .journal import Journal, fingerprint
from .options import METHODS, LabelOptions
from .result import LabelIssues, LabelNoise
from .review import LabelReview, SplitGuardError

if TYPE_CHECKING:  # pragma: no cover
    from .torch_classifier import TorchClassifier

__all__ = [
    "METHODS",
    "Journal",
    "LabelIssues",
    "LabelNoise",
    "LabelOptions",
    "LabelReview",
    "SplitGuardError",
    "TorchClassifier",
    "find_label_issues",
    "fingerprint",
]


def __getattr__(name: str) -> object:
    # TorchClassifier imports scikit-learn: loaded when first asked for
    if name == "TorchClassifier":
        from .torch_classifier import TorchClassifier

        return TorchClassifier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
