"""Clusters of the pooled SHAP rows of :func:`nbdebug.drift`, the test of their shares
between the batches, and the PCA map of SHAP space. scikit-learn does the fitting.

Clusters and PCA are fitted without knowing which batch a row came from, so the
cluster x batch contingency table is a valid test of "same distribution".
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np
import pandas as pd

CLUSTER_METHODS = ("kmeans", "agglomerative")
MAX_AUTO_K = 8
SILHOUETTE_SAMPLE = 2000
AGGLOMERATIVE_MAX_ROWS = 2000


@dataclass
class Clustering:
    """Cluster labels of the pooled rows (reference rows first)."""

    labels: np.ndarray  # (n_reference + n_current,) int64, 0..k-1
    k: int
    method: str
    silhouette: float  # NaN when k was not chosen by silhouette or only one cluster
    scores: dict[int, float]  # silhouette per k tried (auto only)
    candidates: dict[int, np.ndarray] = field(default_factory=dict)  # labels per k tried


def auto_max_k(n_reference: int, n_current: int) -> int:
    """Largest k for ``n_clusters="auto"``: 8, or fewer so that an average cluster holds
    at least 10 rows of the smaller batch (many tiny clusters dilute the share test)."""
    return max(2, min(MAX_AUTO_K, min(n_reference, n_current) // 10))


def _fit_labels(s: np.ndarray, k: int, method: str, random_state: int) -> np.ndarray:
    from sklearn.cluster import AgglomerativeClustering, KMeans

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConvergenceWarning on duplicate points
        if method == "kmeans":
            return KMeans(n_clusters=k, n_init=3, random_state=random_state).fit_predict(s)
        if len(s) <= AGGLOMERATIVE_MAX_ROWS:
            return AgglomerativeClustering(n_clusters=k, linkage="ward").fit_predict(s)
        # ward needs O(n^2) memory: fit on a sample, give every row its nearest centroid
        rng = np.random.default_rng(random_state)
        idx = rng.choice(len(s), size=AGGLOMERATIVE_MAX_ROWS, replace=False)
        sub = AgglomerativeClustering(n_clusters=k, linkage="ward").fit_predict(s[idx])
        centers = np.stack([s[idx][sub == c].mean(axis=0) for c in range(k)])
        d2 = ((s[:, None, :] - centers[None, :, :]) ** 2).sum(axis=2)
        return d2.argmin(axis=1)


def _relabel_by_size(labels: np.ndarray) -> np.ndarray:
    """Clusters numbered 0..k-1 by decreasing size (stable, readable ids)."""
    uniq, counts = np.unique(labels, return_counts=True)
    order = uniq[np.argsort(-counts, kind="stable")]
    mapping = {int(old): new for new, old in enumerate(order)}
    return np.array([mapping[int(v)] for v in labels], dtype=np.int64)


def cluster_shap(
    s: np.ndarray,
    *,
    n_clusters: int | Literal["auto"] = "auto",
    method: str = "kmeans",
    random_state: int = 0,
    progress: bool = False,
    max_k: int = MAX_AUTO_K,
) -> Clustering:
    """Cluster the pooled SHAP rows.

    Parameters
    ----------
    s : numpy.ndarray
        float64 ``(n, d)``: SHAP values of both batches, stacked. SHAP values share the
        model output's unit, so no scaling is applied.
    n_clusters : "auto" or int
        ``"auto"``: k in 2..``max_k`` with the best silhouette (on at most 2,000 sampled
        rows).
    max_k : int
        Largest k tried by ``"auto"`` (:func:`auto_max_k` keeps clusters big enough for
        the chi-square test).
    method : {"kmeans", "agglomerative"}
        Agglomerative (Ward) is fitted on at most 2,000 rows; the others join the nearest
        cluster centre.
    """
    from sklearn.metrics import silhouette_score
    from tqdm.auto import tqdm

    n_distinct = len(np.unique(np.round(s, 12), axis=0))
    if n_distinct < 2:
        return Clustering(np.zeros(len(s), dtype=np.int64), 1, method, math.nan, {})
    if n_clusters != "auto":
        k = min(int(n_clusters), n_distinct)
        labels = _fit_labels(s, k, method, random_state)
        return Clustering(_relabel_by_size(labels), len(np.unique(labels)), method, math.nan, {})
    ks = list(range(2, min(max_k, n_distinct - 1, len(s) - 1) + 1)) or [2]
    scores: dict[int, float] = {}
    candidates: dict[int, np.ndarray] = {}
    best: tuple[float, int, np.ndarray] | None = None
    sample = min(len(s), SILHOUETTE_SAMPLE)
    for k in tqdm(ks, desc="clusters (silhouette)", delay=1.0, disable=not progress, leave=False):
        labels = _fit_labels(s, k, method, random_state)
        n_lab = len(np.unique(labels))
        if n_lab < 2 or n_lab > len(s) - 1:
            continue
        score = float(silhouette_score(s, labels, sample_size=sample, random_state=random_state))
        scores[k] = score
        candidates[k] = _relabel_by_size(labels)
        if best is None or score > best[0]:
            best = (score, k, labels)
    if best is None:
        return Clustering(np.zeros(len(s), dtype=np.int64), 1, method, math.nan, scores)
    return Clustering(
        _relabel_by_size(best[2]), len(np.unique(best[2])), method, best[0], scores, candidates
    )


def most_shifted_clustering(
    clustering: Clustering, is_current: np.ndarray, n_permutations: int, random_state: int
) -> tuple[Clustering, float, float]:
    """Of the clusterings tried by ``n_clusters="auto"`` (k = 2..max_k), the one whose
    shares moved most, and an exact p-value for "no share moved at any k".

    Each k's chi-square statistic is turned into its asymptotic p-value (a common scale
    across k); the test statistic is the smallest of them, and its null distribution comes
    from permuting the batch labels over the fixed clusterings (a max-type permutation
    test, so choosing k by the data costs no level). Returns ``(clustering, chi2, p)``;
    a clustering with one candidate gets the plain permutation test.
    """
    from scipy.stats import chi2 as chi2_dist

    cands = clustering.candidates
    if len(cands) < 2:
        chi2, p = share_permutation_p(
            clustering.labels, is_current, clustering.k, n_permutations, random_state
        )
        return clustering, chi2, p
    n, n_cur = len(is_current), int(is_current.sum())
    ks = sorted(cands)
    cols = {k: np.bincount(cands[k], minlength=k).astype(np.float64) for k in ks}

    def min_p(cur_mask_counts: dict[int, np.ndarray]) -> np.ndarray:
        ps = []
        for k in ks:
            stat = _chi2_statistic(cur_mask_counts[k], cols[k], n_cur, n)
            dof = max(int((cols[k] > 0).sum()) - 1, 1)
            ps.append(chi2_dist.sf(stat, dof))
        return np.min(np.stack(ps), axis=0)

    observed_counts = {k: np.bincount(cands[k][is_current], minlength=k) for k in ks}
    p_each = {
        k: float(
            chi2_dist.sf(
                _chi2_statistic(observed_counts[k], cols[k], n_cur, n),
                max(int((cols[k] > 0).sum()) - 1, 1),
            )
        )
        for k in ks
    }
    observed = min(p_each.values())
    rng = np.random.default_rng(random_state)
    hits, done = 0, 0
    chunk = max(1, min(n_permutations, 500_000 // max(n, 1)))
    while done < n_permutations:
        c = min(chunk, n_permutations - done)
        perms = rng.permuted(np.broadcast_to(np.arange(n), (c, n)), axis=1)[:, :n_cur]
        counts = {k: _row_counts(cands[k][perms], k) for k in ks}
        hits += int((min_p(counts) <= observed * (1 + 1e-9)).sum())
        done += c
    best_k = min(ks, key=lambda k: (p_each[k], k))
    labels = cands[best_k]
    chi2 = float(_chi2_statistic(observed_counts[best_k], cols[best_k], n_cur, n))
    chosen = replace(
        clustering,
        labels=labels,
        k=len(np.unique(labels)),
        silhouette=clustering.scores.get(best_k, math.nan),
    )
    return chosen, chi2, (1 + hits) / (1 + n_permutations)


def cluster_name(
    members: np.ndarray, s: np.ndarray, x: np.ndarray, names: list[str], top: int = 2
) -> str:
    """A short name from the SHAP features that set a cluster apart.

    The ``top`` features whose mean SHAP value in the cluster differs most from the pooled
    mean, each labelled "high"/"low"/"mid" by the cluster's mean input value (in pooled
    stds): e.g. "high `worst radius`, low `mean texture`".
    """
    if members.all():
        return "all rows"
    diff = s[members].mean(axis=0) - s.mean(axis=0)
    order = np.argsort(-np.abs(diff), kind="stable")[:top]
    sd = x.std(axis=0)
    parts = []
    for j in order:
        z = (x[members, j].mean() - x[:, j].mean()) / sd[j] if sd[j] > 0 else 0.0
        level = "high" if z > 0.25 else "low" if z < -0.25 else "mid"
        parts.append(f"{level} `{names[j]}`")
    return ", ".join(parts)


def _chi2_statistic(counts_current: np.ndarray, col: np.ndarray, n_cur: int, n: int) -> np.ndarray:
    """Pearson's chi-square of 2 x k tables given the current row counts ``(..., k)``, the
    column totals ``col (k,)`` and the row totals: vectorised over leading axes."""
    n_ref = n - n_cur
    e1 = col * (n_cur / n)
    e0 = col * (n_ref / n)
    ref = col - counts_current
    with np.errstate(divide="ignore", invalid="ignore"):
        t = (counts_current - e1) ** 2 / e1 + (ref - e0) ** 2 / e0
    return np.where(col > 0, t, 0.0).sum(axis=-1)


def _row_counts(labels_rows: np.ndarray, k: int) -> np.ndarray:
    """Cluster counts of each row of an int ``(c, m)`` array of labels: ``(c, k)``."""
    c = labels_rows.shape[0]
    flat = (np.arange(c)[:, None] * k + labels_rows).ravel()
    return np.bincount(flat, minlength=c * k).reshape(c, k)


def share_permutation_p(
    labels: np.ndarray, is_current: np.ndarray, k: int, n_permutations: int, random_state: int
) -> tuple[float, float]:
    """Chi-square statistic of the cluster x batch table and its permutation p-value.

    The batch labels are permuted over the fixed clusters ``n_permutations`` times;
    ``p = (1 + #{chi2_perm >= chi2}) / (1 + n_permutations)``. Exact at any cluster size
    (the chi-square approximation is not, with small expected counts), because the
    clusters were fitted without the batch labels.
    """
    n, n_cur = len(labels), int(is_current.sum())
    col = np.bincount(labels, minlength=k).astype(np.float64)
    observed = float(_chi2_statistic(np.bincount(labels[is_current], minlength=k), col, n_cur, n))
    if k < 2 or n_permutations < 1:
        return observed, 1.0
    rng = np.random.default_rng(random_state)
    hits, done = 0, 0
    chunk = max(1, min(n_permutations, 2_000_000 // max(n, 1)))
    while done < n_permutations:
        c = min(chunk, n_permutations - done)
        perm = rng.permuted(np.broadcast_to(labels, (c, n)), axis=1)[:, :n_cur]
        counts = _row_counts(perm, k)
        hits += int((_chi2_statistic(counts, col, n_cur, n) >= observed - 1e-9).sum())
        done += c
    return observed, (1 + hits) / (1 + n_permutations)


def cluster_table(
    clustering: Clustering,
    is_current: np.ndarray,
    s: np.ndarray,
    x: np.ndarray,
    names: list[str],
    *,
    n_permutations: int = 999,
    random_state: int = 0,
    test: tuple[float, float] | None = None,
) -> tuple[pd.DataFrame, float, float, int]:
    """Shares of each cluster in the two batches and a test on them.

    The p-value is the permutation p-value of Pearson's chi-square statistic
    (:func:`share_permutation_p`), exact at any cluster size, unless ``test`` gives
    ``(chi2, p)`` already (:func:`most_shifted_clustering`).

    Returns
    -------
    (table, chi2, p_value, dof)
        ``table``: index ``cluster``; columns ``name``, ``n_reference``, ``n_current``,
        ``share_reference``, ``share_current``, ``change`` (current minus reference share)
        and ``residual`` (adjusted Pearson residual of the current count: above 2 in
        absolute value means this cluster's share moved).
    """
    from scipy.stats import chi2_contingency

    labels = clustering.labels
    k = clustering.k
    n_ref, n_cur = int((~is_current).sum()), int(is_current.sum())
    counts = np.zeros((2, k), dtype=np.int64)
    for c in range(k):
        counts[0, c] = int(((labels == c) & ~is_current).sum())
        counts[1, c] = int(((labels == c) & is_current).sum())
    if k >= 2:
        res = chi2_contingency(counts, correction=False)
        dof = int(res.dof)
        chi2, p = test or share_permutation_p(labels, is_current, k, n_permutations, random_state)
        expected = res.expected_freq
    else:
        chi2, p, dof = 0.0, 1.0, 0
        expected = counts.astype(float)
    n = counts.sum()
    col = counts.sum(axis=0) / n
    row = np.array([n_ref, n_cur]) / n
    with np.errstate(divide="ignore", invalid="ignore"):
        resid = (counts[1] - expected[1]) / np.sqrt(expected[1] * (1 - row[1]) * (1 - col))
    resid = np.where(np.isfinite(resid), resid, 0.0)
    table = pd.DataFrame(
        {
            "cluster": np.arange(k),
            "name": [cluster_name(labels == c, s, x, names) for c in range(k)],
            "n_reference": counts[0],
            "n_current": counts[1],
            "share_reference": counts[0] / max(n_ref, 1),
            "share_current": counts[1] / max(n_cur, 1),
        }
    ).set_index("cluster")
    table["change"] = table["share_current"] - table["share_reference"]
    table["residual"] = resid
    return table, chi2, p, dof


def pca_map(s: np.ndarray, random_state: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """2-D PCA coordinates of the pooled SHAP rows and the explained variance ratios.

    Returns
    -------
    (coords, ratio)
        ``coords`` float64 ``(n, 2)`` (a zero second column when there is one feature);
        ``ratio`` float64 ``(2,)``.
    """
    from sklearn.decomposition import PCA

    n_comp = min(2, s.shape[1], s.shape[0])
    coords = np.zeros((len(s), 2))
    ratio = np.zeros(2)
    if np.allclose(s, s[:1]):
        return coords, ratio
    pca = PCA(n_components=n_comp, random_state=random_state)
    coords[:, :n_comp] = pca.fit_transform(s)
    ratio[:n_comp] = pca.explained_variance_ratio_
    return coords, ratio
