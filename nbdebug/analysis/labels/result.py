"""The result of :func:`nbdebug.find_label_issues`: a :class:`LabelIssues` table (a
:class:`pandas.DataFrame`) carrying its :class:`LabelNoise` estimate, and the
``df.label_issues`` accessor."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ...core.display import show as show_result


@dataclass(eq=False)
class LabelNoise:
    """What :func:`find_label_issues` estimated about the label noise.

    Attributes
    ----------
    method : str
    n : int
        Number of samples.
    class_counts : ndarray, shape (K,), int64
        Samples per given label.
    thresholds : ndarray, shape (K,), float64
        Per-class confidence thresholds ``t_j`` (``inf`` for a class without samples).
    confident_joint : ndarray, shape (K, K), int64
        ``C[given, true]``: samples labelled ``given`` confidently predicted ``true``.
    joint : ndarray, shape (K, K), float64
        Calibrated estimate of ``p(given, true)``; sums to 1.
    noise_matrix : ndarray, shape (K, K), float64
        ``p(given | true)``; columns sum to 1 (a column without mass is the identity).
    n_estimated : int
        Estimated number of label issues, ``round(n * (1 - trace(joint)))``.
    n_flagged : int
        Number of samples flagged by ``method``.
    unassessed : list of int
        Classes with fewer than 2 samples: their samples are never flagged.
    models : list of str
        Names of the models whose probabilities were used (empty when supplied).
    note : str
        Why ``n_flagged`` differs from ``n_estimated`` (when it does).
    """

    method: str
    n: int
    class_counts: np.ndarray
    thresholds: np.ndarray
    confident_joint: np.ndarray
    joint: np.ndarray
    noise_matrix: np.ndarray
    n_estimated: int
    n_flagged: int
    unassessed: list[int] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def n_classes(self) -> int:
        return len(self.class_counts)

    @property
    def noise_rate(self) -> float:
        """Estimated fraction of wrong labels."""
        return float(1.0 - np.trace(self.joint))

    def summary(self) -> str:
        """One sentence: flagged next to estimated, and why they differ when they do."""
        why = f" ({self.note})" if self.note and self.n_flagged != self.n_estimated else ""
        return (
            f"{self.method}: {self.n_flagged} of {self.n} samples flagged; confident learning "
            f"estimates {self.n_estimated} label issues (noise rate {self.noise_rate:.1%}){why}."
        )

    def to_frame(self) -> pd.DataFrame:
        """The confident joint as a table (rows: given label, columns: estimated true label)."""
        k = self.n_classes
        return pd.DataFrame(
            self.confident_joint,
            index=pd.Index(range(k), name="given"),
            columns=pd.Index(range(k), name="true"),
        )

    def __repr__(self) -> str:
        return (
            f"LabelNoise(method={self.method!r}, n={self.n}, n_classes={self.n_classes}, "
            f"n_flagged={self.n_flagged}, n_estimated={self.n_estimated}, "
            f"noise_rate={self.noise_rate:.3f})"
        )


class LabelIssues(pd.DataFrame):
    """What :func:`nbdebug.find_label_issues` returns: a :class:`pandas.DataFrame`, one row
    per sample, with the result protocol.

    The :class:`LabelNoise` estimate travels in ``attrs["label_noise"]`` (pandas carries
    ``attrs`` through slicing, sorting and copying), also reachable as ``df.label_issues``.
    ``summary()``, ``ok``, ``to_frame()`` and ``show()`` read it.

    Attributes
    ----------
    noise : LabelNoise
        The estimate behind the table (flagged and estimated counts, the noise rate).
    ok : bool
        No sample is flagged.

    Examples
    --------
    >>> issues = nbdebug.find_label_issues(y, pred_probs=p)
    >>> issues.summary(), issues.to_frame().head()
    """

    @property
    def _constructor(self) -> type[LabelIssues]:
        return LabelIssues

    @property
    def noise(self) -> LabelNoise:
        """The estimate behind the table."""
        est = self.attrs.get("label_noise")
        if not isinstance(est, LabelNoise):
            raise AttributeError(_NO_ESTIMATE)
        return est

    @property
    def ok(self) -> bool:
        """No sample is flagged."""
        return self.noise.n_flagged == 0

    def summary(self) -> str:
        """One sentence: flagged next to estimated (:meth:`LabelNoise.summary`)."""
        return self.noise.summary()

    def to_frame(self) -> pd.DataFrame:
        """The table as a plain :class:`pandas.DataFrame` (a copy, ``attrs`` kept)."""
        out = pd.DataFrame(self, copy=True)
        out.attrs = dict(self.attrs)
        return out

    def show(self, **options: object) -> object:
        """The panel of the label issues (registered by the widgets layer)."""
        return show_result(self, **options)


_NO_ESTIMATE = (
    "this DataFrame carries no label-noise estimate: expected the result of "
    "nbdebug.find_label_issues (df.attrs['label_noise'])."
)


class LabelIssuesAccessor:
    """``df.label_issues``: the :class:`LabelNoise` behind a :func:`find_label_issues` frame."""

    def __init__(self, df: pd.DataFrame):
        est = df.attrs.get("label_noise")
        if not isinstance(est, LabelNoise):
            raise AttributeError(_NO_ESTIMATE)
        self._est = est

    def __getattr__(self, name: str) -> object:
        return getattr(self._est, name)

    def __repr__(self) -> str:
        return repr(self._est)


def register_accessor() -> None:
    """Make ``df.label_issues`` available on pandas DataFrames (once; later calls do
    nothing). :func:`find_label_issues` calls it: importing this module registers nothing."""
    if not hasattr(pd.DataFrame, "label_issues"):
        pd.api.extensions.register_dataframe_accessor("label_issues")(LabelIssuesAccessor)
