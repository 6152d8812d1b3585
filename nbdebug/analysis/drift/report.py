"""The result of :func:`nbdebug.drift`: :class:`DriftReport` and its two multivariate
tests."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ...core.display import show as show_result

FEATURE_COLUMNS = [
    "quadrant",
    "input_test",
    "exposure_share",
    "exposure",
    "exposure_noise",
    "shap_mean_shift",
    "ks",
    "ks_p",
    "ks_p_adj",
    "wasserstein",
    "shap_ks",
    "shap_ks_p",
    "shap_ks_p_adj",
    "shap_wasserstein",
    "drifted_input",
    "drifted_explanation",
    "mean_shift",
    "shap_importance",
]
"""The columns of ``DriftReport.features``, in order."""


@dataclass(repr=False)
class ClassifierTest:
    """Classifier two-sample test on the SHAP matrix (see
    :func:`nbdebug.analysis.drift.classifier.classifier_test`)."""

    auc: float
    p_value: float
    p_adjusted: float
    n_permutations: int
    n_splits: int
    classifier: str

    def __repr__(self) -> str:
        return (
            f"ClassifierTest(auc={self.auc:.3f}, p={self.p_value:.4g}, "
            f"p_adjusted={self.p_adjusted:.4g})"
        )


@dataclass(repr=False)
class ClusterTest:
    """Chi-square test of the cluster shares, reference vs current."""

    chi2: float
    p_value: float
    p_adjusted: float
    dof: int
    k: int
    method: str
    silhouette: float

    def __repr__(self) -> str:
        return (
            f"ClusterTest(k={self.k}, method={self.method!r}, chi2={self.chi2:.2f}, "
            f"p={self.p_value:.4g}, p_adjusted={self.p_adjusted:.4g})"
        )


@dataclass(repr=False)
class DriftReport:
    """What :func:`drift` found.

    Attributes
    ----------
    features : pandas.DataFrame
        One row per feature, sorted by drift (flagged first, then by exposure share, then
        by the larger KS statistic): ``quadrant``, ``exposure_share``, ``exposure``,
        ``exposure_noise``, ``shap_mean_shift`` (all in output units, see
        :mod:`~nbdebug.analysis.drift.exposure`), ``input_test`` (``"KS"``, or
        ``"chi-square"`` on the category counts of a string column), ``ks``, ``ks_p``,
        ``ks_p_adj`` (for a category column: total-variation distance of the shares and
        the chi-square p-value), ``wasserstein`` (Wasserstein-1 / reference std; NaN for a
        category column), ``shap_ks``, ``shap_ks_p``,
        ``shap_ks_p_adj``, ``shap_wasserstein``, ``drifted_input``,
        ``drifted_explanation`` (the model acts on it: its SHAP distribution changed
        significantly *and* materially), ``mean_shift`` (in reference stds),
        ``shap_importance`` (mean |SHAP| on the reference).
    clusters : pandas.DataFrame
        One row per cluster of the explained rows in SHAP space: ``name`` (what defines
        it: a predicted class or a rule on the inputs, see
        :mod:`~nbdebug.analysis.drift.groups`), ``purity``, ``coverage``,
        ``group_share_reference``, ``group_share_current`` (share of all rows of each batch
        matching the name), ``shap_profile`` (the SHAP features that set it apart),
        ``n_reference``, ``n_current``, ``share_reference``, ``share_current``, ``change``,
        ``residual``.
    alarm : bool
        Some family of tests drifted (see ``tests``).
    tests : pandas.DataFrame
        One row per family (``inputs``, ``explanations``, ``cluster shares``,
        ``classifier``): ``n_tests``, ``weight`` (share of ``alpha``), ``p_value``
        (global), ``p_adjusted`` (weighted Holm across families), ``drift``.
    headline : str
        One sentence: what changed and whether the model cares (also ``summary()``).
    details : str
        One paragraph in words (starts with the headline).
    prediction_shift : float
        Current minus reference mean of the explained output (sum of ``shap_mean_shift``).
    output_scale : float
        Standard deviation of the explained output over the reference rows: exposure below
        ``EXPOSURE_MIN`` times this is not material.
    classifier, cluster_test : ClassifierTest, ClusterTest
        The two multivariate tests.
    reference, current : numpy.ndarray
        The inputs as float64 ``(n_reference, d)``, ``(n_current, d)`` (copies).
    reference_rows, current_rows : numpy.ndarray
        int64: the rows of each batch that were explained (all rows of small batches).
    reference_shap, current_shap : numpy.ndarray
        Their SHAP values, ``(len(reference_rows), d)`` and ``(len(current_rows), d)``.
    sampling_error : float
        DKW bound on the error of each explained batch's SHAP CDFs (0: all rows explained).
    labels : numpy.ndarray
        int64 ``(m_reference + m_current,)``: cluster of each explained row, reference first.
    pca : numpy.ndarray
        float64 ``(m_reference + m_current, 2)``: the PCA map of the SHAP rows.
    """

    features: pd.DataFrame
    clusters: pd.DataFrame
    alarm: bool
    details: str
    classifier: ClassifierTest
    cluster_test: ClusterTest
    alpha: float
    correction: str
    tests: pd.DataFrame
    explainer: str
    output: str
    feature_names: list[str]
    reference: np.ndarray
    current: np.ndarray
    reference_shap: np.ndarray
    current_shap: np.ndarray
    labels: np.ndarray
    pca: np.ndarray
    pca_variance: np.ndarray
    headline: str = ""
    prediction_shift: float = math.nan
    output_scale: float = math.nan
    reference_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    current_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    sampling_error: float = 0.0
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def n_reference(self) -> int:
        return int(self.reference.shape[0])

    @property
    def n_current(self) -> int:
        return int(self.current.shape[0])

    @property
    def is_current(self) -> np.ndarray:
        """bool ``(m_reference + m_current,)``: which explained rows (the rows of ``labels``
        and ``pca``) come from the current batch."""
        return np.r_[
            np.zeros(len(self.reference_shap), bool), np.ones(len(self.current_shap), bool)
        ]

    @property
    def drifted_inputs(self) -> list[str]:
        return [str(f) for f in self.features.index[self.features["drifted_input"]]]

    @property
    def drifted_explanations(self) -> list[str]:
        return [str(f) for f in self.features.index[self.features["drifted_explanation"]]]

    @property
    def ok(self) -> bool:
        """No family of tests drifted (``not alarm``)."""
        return not self.alarm

    def summary(self) -> str:
        """One sentence: what changed and whether the model cares (the headline)."""
        return self.headline

    def to_frame(self) -> pd.DataFrame:
        """The feature table (a copy)."""
        return self.features.copy()

    def show(self, **options: object) -> object:
        """The interactive panel (:class:`nbdebug.widgets.drift.DriftPanel`)."""
        return show_result(self, **options)

    def __repr__(self) -> str:
        d = len(self.feature_names)
        return (
            f"DriftReport(alarm={self.alarm}, inputs drifted {len(self.drifted_inputs)}/{d}, "
            f"explanations drifted {len(self.drifted_explanations)}/{d}, "
            f"{self.cluster_test.k} clusters (p_adj={self.cluster_test.p_adjusted:.3g}), "
            f"classifier AUC={self.classifier.auc:.3f} (p_adj={self.classifier.p_adjusted:.3g}), "
            f"n_reference={self.n_reference}, n_current={self.n_current})"
        )
