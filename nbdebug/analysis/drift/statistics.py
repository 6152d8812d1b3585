"""The per-feature tests of :func:`nbdebug.drift` and its multiple-testing correction:
two-sample tests on each input and SHAP column, Benjamini-Hochberg or Bonferroni within a
test family, a weighted Holm step across the families. scipy does the work.

The clusters of SHAP space and their share test are in
:mod:`nbdebug.analysis.drift.clustering`, the classifier two-sample test in
:mod:`nbdebug.analysis.drift.classifier`.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

CORRECTIONS = {"fdr": "Benjamini-Hochberg", "bonferroni": "Bonferroni"}


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
