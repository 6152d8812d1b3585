"""Which rows of a batch get SHAP values: all of them, or a stratified subsample whose size
is set by the sampling error it allows.

SHAP values are the slow part of :func:`nbdebug.drift` (a full-depth 100-tree forest
costs about 20 ms a row in shap's TreeExplainer), while the input tests are cheap. So the
input tests run on every row, and each batch's SHAP values on at most

    m = ceil(ln(2 / delta) / (2 eps^2))

rows (batches of at most :data:`FULL_BATCH_ROWS` rows are explained whole: there SHAP
is cheap and a subsample would only lose power). By the Dvoretzky-Kiefer-Wolfowitz
inequality the empirical distribution of any SHAP column on ``m`` rows drawn at random
is within ``eps`` (sup-norm of the CDFs) of its distribution on the whole batch with
probability ``1 - delta``. The default
``eps = 0.15``, ``delta = 0.05`` gives ``m = 82`` rows per batch. The subsample is
stratified (proportional allocation) on quantiles of the model's output, computed on all
rows, so the explained rows' predictions match the batch's, which a random draw of the
same size only does on average.
"""

from __future__ import annotations

import math

import numpy as np

DEFAULT_SAMPLING_ERROR = 0.15
CONFIDENCE = 0.95
N_STRATA = 10
FULL_BATCH_ROWS = 1000


def rows_for_error(eps: float, confidence: float = CONFIDENCE) -> int:
    """The DKW sample size: rows per batch for a CDF error at most ``eps``."""
    return math.ceil(math.log(2 / (1 - confidence)) / (2 * eps * eps))


def dkw_error(m: int, confidence: float = CONFIDENCE) -> float:
    """The CDF error bound of ``m`` sampled rows (0 when ``m`` is the whole batch)."""
    return math.sqrt(math.log(2 / (1 - confidence)) / (2 * m))


def stratified_rows(score: np.ndarray, m: int, random_state: int) -> np.ndarray:
    """All rows of a batch of at most :data:`FULL_BATCH_ROWS` rows; else the sorted
    indices of ``m`` rows, drawn within :data:`N_STRATA` quantile bins of
    ``score (n,)`` in proportion to their sizes (largest remainders)."""
    n = len(score)
    if m >= n or n <= FULL_BATCH_ROWS:
        return np.arange(n)
    rng = np.random.default_rng(random_state)
    order = np.argsort(score, kind="stable")
    bins = np.array_split(order, min(N_STRATA, m))
    quota = np.array([len(b) for b in bins], dtype=np.float64) * m / n
    take = np.floor(quota).astype(int)
    rest = m - int(take.sum())
    if rest:
        take[np.argsort(-(quota - take), kind="stable")[:rest]] += 1
    picked = [rng.choice(b, size=t, replace=False) for b, t in zip(bins, take) if t]
    return np.sort(np.concatenate(picked))
