"""The statistics of :func:`nbdebug.drift`: per-feature two-sample tests, multiple-testing
correction, clustering of samples in SHAP space, the cluster-share test, the classifier
two-sample test and the PCA map. scipy and scikit-learn do the work.

Every test here is label-free on the pooled data except through the batch labels it
tests: clusters and PCA are fitted without knowing which batch a row came from, so the
cluster x batch contingency table is a valid test of "same distribution".
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pandas as pd

CORRECTIONS = {"fdr": "Benjamini-Hochberg", "bonferroni": "Bonferroni"}
CLUSTER_METHODS = ("kmeans", "agglomerative")
MAX_AUTO_K = 8
SILHOUETTE_SAMPLE = 2000
AGGLOMERATIVE_MAX_ROWS = 2000


def scaled_wasserstein(ref: np.ndarray, cur: np.ndarray) -> float:
    """Wasserstein-1 distance between two samples, in units of the reference std.

    Falls back to the pooled std when the reference is constant; 0 when both are the
    same constant, ``inf`` when a constant reference moved.
    """
    from scipy.stats import wasserstein_distance

    w = float(wasserstein_distance(ref, cur))
    if w == 0.0:
        return 0.0
    sd = float(np.std(ref))
    if sd == 0.0:
        sd = float(np.std(np.concatenate([ref, cur])))
    return w / sd if sd > 0 else math.inf


def category_test(ref: np.ndarray, cur: np.ndarray) -> tuple[float, float]:
    """Category codes of one column in the two batches: the total-variation distance of
    their shares (in [0, 1], the categorical counterpart of the KS statistic) and the
    p-value of Pearson's chi-square test on the 2 x K table of counts
    (``scipy.stats.chi2_contingency``; 1 when only one category occurs)."""
    from scipy.stats import chi2_contingency

    cats = np.union1d(ref, cur)
    counts = np.stack([(ref[:, None] == cats).sum(axis=0), (cur[:, None] == cats).sum(axis=0)])
    shares = counts / counts.sum(axis=1, keepdims=True)
    tv = 0.5 * float(np.abs(shares[0] - shares[1]).sum())
    if len(cats) < 2:
        return tv, 1.0
    return tv, float(chi2_contingency(counts, correction=False).pvalue)


def feature_tests(
    xr: np.ndarray,
    xc: np.ndarray,
    sr: np.ndarray,
    sc: np.ndarray,
    names: list[str],
    categorical: frozenset[int] = frozenset(),
) -> pd.DataFrame:
    """Per-feature two-sample tests and scaled Wasserstein distances on inputs and SHAP
    values.

    Parameters
    ----------
    xr, xc : numpy.ndarray
        Inputs, float64, ``(n_reference, d)`` and ``(n_current, d)``.
    sr, sc : numpy.ndarray
        SHAP values, same shapes.
    categorical : set of int
        Columns holding category codes: their input test is the chi-square test of the
        category counts (:func:`category_test`; ``ks`` is then the total-variation distance
        of the shares, ``wasserstein`` and ``mean_shift`` NaN); the other columns get
        ``scipy.stats.ks_2samp``. SHAP columns are numbers: always KS.

    Returns
    -------
    pandas.DataFrame
        Index ``feature``; columns ``input_test`` (``"KS"`` or ``"chi-square"``), ``ks``,
        ``ks_p``, ``wasserstein``, ``shap_ks``, ``shap_ks_p``, ``shap_wasserstein``,
        ``mean_shift`` (current minus reference mean, in reference stds) and
        ``shap_importance`` (mean |SHAP| on the reference).
    """
    from scipy.stats import ks_2samp

    rows = []
    for j, name in enumerate(names):
        a, b = xr[:, j], xc[:, j]
        sa, sb = sr[:, j], sc[:, j]
        sks = ks_2samp(sa, sb)
        row = {
            "feature": name,
            "shap_ks": float(sks.statistic),
            "shap_ks_p": float(sks.pvalue),
            "shap_wasserstein": scaled_wasserstein(sa, sb),
            "shap_importance": float(np.mean(np.abs(sa))),
        }
        if j in categorical:
            tv, p = category_test(a, b)
            row.update(
                input_test="chi-square", ks=tv, ks_p=p, wasserstein=math.nan, mean_shift=math.nan
            )
        else:
            ks = ks_2samp(a, b)
            sd = float(np.std(a))
            shift = float(np.mean(b) - np.mean(a))
            row.update(
                input_test="KS",
                ks=float(ks.statistic),
                ks_p=float(ks.pvalue),
                wasserstein=scaled_wasserstein(a, b),
                mean_shift=shift / sd
                if sd > 0
                else (0.0 if shift == 0 else math.copysign(math.inf, shift)),
            )
        rows.append(row)
    cols = ["feature", "input_test", "ks", "ks_p", "wasserstein", "shap_ks", "shap_ks_p"]
    cols += ["shap_wasserstein", "mean_shift", "shap_importance"]
    return pd.DataFrame(rows)[cols].set_index("feature")


def correct(pvalues: np.ndarray, method: str) -> np.ndarray:
    """Adjusted p-values: Benjamini-Hochberg (``"fdr"``) or Bonferroni. NaN stays NaN."""
    from scipy.stats import false_discovery_control

    p = np.asarray(pvalues, dtype=np.float64)
    out = np.full_like(p, np.nan)
    ok = np.isfinite(p)
    if not ok.any():
        return out
    if method == "fdr":
        out[ok] = false_discovery_control(np.clip(p[ok], 0.0, 1.0), method="bh")
    elif method == "bonferroni":
        out[ok] = np.minimum(p[ok] * ok.sum(), 1.0)
    else:  # pragma: no cover - validated by drift()
        raise ValueError(f"correction must be one of {tuple(CORRECTIONS)}; got {method!r}.")
    return out


FAMILY_WEIGHTS = {"inputs": 0.4, "explanations": 0.3, "cluster shares": 0.15, "classifier": 0.15}
"""Share of ``alpha`` each test family of :func:`nbdebug.drift` gets in the weighted Holm
step across families (:func:`hierarchical`). The inputs family, whose per-column flags are
what users read first, gets the largest share; a linear model's SHAP columns are monotone
in their inputs, so the explanations family often repeats it and gets less."""


def holm_weighted(p: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted Holm adjusted p-values (Holm, 1979): valid under any dependence.

    Families are taken in increasing ``p / w``; the ``i``-th is rejected at ``alpha`` when
    ``p / w * (sum of the weights not yet rejected) <= alpha`` and every earlier one was.
    The first step is a weighted Bonferroni test, so under the global null the chance of
    any rejection is at most ``alpha * sum(w) / sum(w) = alpha``, whatever the dependence.
    NaN p-values (tests that did not run) stay NaN and carry no weight.
    """
    p = np.asarray(p, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    out = np.full_like(p, np.nan)
    ok = np.flatnonzero(np.isfinite(p) & (w > 0))
    if not len(ok):
        return out
    ratio = p[ok] / w[ok]
    order = ok[np.argsort(ratio, kind="stable")]
    left = float(w[ok].sum())
    running = 0.0
    for i in order:
        running = max(running, min(1.0, p[i] / w[i] * left))
        out[i] = running
        left -= w[i]
    return out


def hierarchical(
    families: dict[str, np.ndarray],
    method: str,
    alpha: float,
    weights: dict[str, float] | None = None,
) -> tuple[dict[str, np.ndarray], pd.DataFrame]:
    """Two-level multiple-testing correction: weighted Holm across families, ``method``
    within them.

    1. Each family's p-values are corrected within the family (``method``); the smallest
       corrected value is the family's global p-value (Simes' test for BH, Bonferroni's
       for Bonferroni).
    2. The families' global p-values go through a weighted Holm step-down
       (:func:`holm_weighted`, ``weights``, equal by default): a family has drifted when
       its Holm-adjusted p is at or below ``alpha``. ``alarm`` (some family drifted) fires
       with probability at most ``alpha`` when nothing drifted, whatever the dependence
       between the families (inputs and their own SHAP values are strongly dependent;
       Benjamini-Hochberg across them, used before, measured 0.070-0.075 at 0.05).
    3. Inside a drifted family ``f``, a test is flagged when its within-family corrected
       p-value, scaled by ``W_f / w_f``, is at or below ``alpha``, where ``W_f`` is the
       weight of ``f`` plus that of the families that did not drift: ``f`` is tested at
       ``alpha * w_f / W_f``, the level at which Holm's last step would have tested it
       (``alpha`` itself when every family drifted). That scaled value is what is
       returned, so "adjusted p <= alpha" reads the same everywhere, and a flagged test
       always lies in a drifted family (a family that did not drift has a scaled value
       above ``alpha``).

    Parameters
    ----------
    families : dict of str to numpy.ndarray
        Family name -> float p-values (NaN for a test that could not run).
    weights : dict of str to float, optional
        Family name -> positive weight (normalised here); equal weights by default.

    Returns
    -------
    (adjusted, table)
        ``adjusted``: family name -> adjusted p-values as above (NaN stays NaN);
        ``table``: index ``family``; columns ``n_tests``, ``weight``, ``p_value``
        (global), ``p_adjusted`` (weighted Holm across families) and ``drift`` (bool).
    """
    names = list(families)
    raw = np.array([1.0 if weights is None else float(weights[k]) for k in names])
    if (raw <= 0).any() or not np.isfinite(raw).all():
        raise ValueError(f"family weights must be positive numbers; got {weights!r}.")
    w = raw / raw.sum()
    within = {k: correct(v, method) for k, v in families.items()}
    glob = np.array(
        [np.nanmin(v) if np.isfinite(v).any() else np.nan for v in within.values()],
        dtype=np.float64,
    )
    top = holm_weighted(glob, w)
    drifted = np.where(np.isfinite(top), top <= alpha, False)
    idle = float(w[np.isfinite(glob) & ~drifted].sum())
    adjusted = {}
    for (k, v), wk, t in zip(within.items(), w, top):
        if len(v) == 1:  # a family of one test: its adjusted p is the across-family one
            adjusted[k] = np.array([t])
        else:
            adjusted[k] = np.minimum(v * (wk + idle) / wk, 1.0)
    table = pd.DataFrame(
        {
            "family": names,
            "n_tests": [len(v) for v in families.values()],
            "weight": w,
            "p_value": glob,
            "p_adjusted": top,
            "drift": drifted.astype(bool),
        }
    ).set_index("family")
    return adjusted, table


# ---------------------------------------------------------------------------- clustering


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
    n_clusters: Any = "auto",
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


# ---------------------------------------------------------------------------- classifier test


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
