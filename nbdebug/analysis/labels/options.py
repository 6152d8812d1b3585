"""The options of :func:`nbdebug.find_label_issues`: one frozen :class:`LabelOptions`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ...core.options import options_from

METHODS = ("confident_learning", "predicted_neq_given", "ensemble")
RANK_BY = ("self_confidence", "normalized_margin")
PRUNE = ("threshold_margin", "global", "noise_rate")


@dataclass(frozen=True)
class LabelOptions:
    """How :func:`nbdebug.find_label_issues` finds and ranks label issues (each option is
    described there). Invalid values raise ``ValueError`` when the value is made.

    Attributes
    ----------
    method : str
    cv : int
    random_state : int
    tau : float
    rank_by : str
    prune : str
    """

    method: str = "confident_learning"
    cv: int = 5
    random_state: int = 0
    tau: float = 0.5
    rank_by: str = "self_confidence"
    prune: str = "threshold_margin"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}; got {self.method!r}.")
        if self.prune not in PRUNE:
            raise ValueError(f"prune must be one of {PRUNE}; got {self.prune!r}.")
        if self.rank_by not in RANK_BY:
            raise ValueError(f"rank_by must be one of {RANK_BY}; got {self.rank_by!r}.")
        tau = self.tau
        if not (isinstance(tau, (int, float, np.floating)) and 0.0 < float(tau) < 1.0):
            raise ValueError(f"tau must be a probability in (0, 1); got {tau!r}.")

    def with_keywords(self, given: Mapping[str, object], where: str) -> LabelOptions:
        """A copy with the options of the keyword arguments ``given`` of the call ``where``
        (an unknown name is a ``TypeError`` naming it and listing the options)."""
        return options_from(LabelOptions, given, where=where, base=self)
