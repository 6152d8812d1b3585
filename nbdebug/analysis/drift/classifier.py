"""The classifier two-sample test of :func:`nbdebug.drift` on the pooled SHAP rows."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np


@dataclass
class ClassifierResult:
    auc: float
    p_value: float
    n_permutations: int
    n_splits: int
    classifier: str


def classifier_test(
    s: np.ndarray,
    is_current: np.ndarray,
    *,
    n_permutations: int = 0,
    random_state: int = 0,
) -> ClassifierResult:
    """Classifier two-sample test on the SHAP matrix, with an exact level.

    The rows are split in two stratified halves. A standardised logistic regression fitted
    on one half scores the other half, and the other way round. Under no drift the held-out
    scores do not depend on the held-out batch labels, so each half's AUC has the
    Mann-Whitney null distribution (one-sided: current rows scored higher); the two
    p-values are combined by Bonferroni, ``p = min(1, 2 min(p1, p2))``, valid whatever
    their dependence. ``auc`` is the mean of the two held-out AUCs. (Permuting labels over
    cross-fitted scores, as before, is not exact: the scores were fitted with the labels.)

    Parameters
    ----------
    s : numpy.ndarray
        float64 ``(n, d)`` pooled SHAP values.
    is_current : numpy.ndarray
        bool ``(n,)``.
    n_permutations : int
        Unused (kept for the result's field); the test is exact.
    """
    from scipy.stats import mannwhitneyu
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    y = is_current.astype(np.int64)
    n1 = int(y.sum())
    n0 = len(y) - n1
    name = "logistic regression (standardised SHAP), two held-out halves, Mann-Whitney"
    if min(n1, n0) < 4:
        return ClassifierResult(math.nan, math.nan, 0, 0, name)
    cv = StratifiedKFold(n_splits=2, shuffle=True, random_state=random_state)
    aucs, ps = [], []
    for fit_rows, test_rows in cv.split(s, y):
        clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            clf.fit(s[fit_rows], y[fit_rows])
        score = clf.decision_function(s[test_rows])
        yt = y[test_rows]
        a, b = score[yt == 1], score[yt == 0]
        if np.ptp(score) == 0:
            aucs.append(0.5)
            ps.append(1.0)
            continue
        res = mannwhitneyu(a, b, alternative="greater")
        aucs.append(float(res.statistic) / (len(a) * len(b)))
        ps.append(float(res.pvalue))
    p = min(1.0, 2.0 * min(ps))
    return ClassifierResult(float(np.mean(aucs)), p, 0, 2, name)
