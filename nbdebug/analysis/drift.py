"""Data drift through SHAP: is the current batch different from the reference, where, and
does the model see it?

>>> rep = nbdebug.drift(model, X_valid, X_today, feature_names=names)
>>> rep.alarm, rep.features.head(), rep.clusters
>>> rep.show()       # the panel: table, overlays, SHAP map, cluster shares

Each feature gets its **exposure**: how far its drift moved its push on the model's
predictions, in the output's own units, against the noise of the same quantity between
two halves of the reference, and its share of the prediction shift
(:mod:`nbdebug.analysis.drift_exposure`). The quadrant of a feature comes from input drift
and exposure: "input+explanation" (the model acts on the drift), "input only" (the input
moved, predictions did not move with it), "explanation only", "none".

Input tests run on every row; SHAP values on every row of small batches and on a
stratified subsample of large ones, sized by the sampling error it allows
(:mod:`nbdebug.analysis.drift_sample`).

The report's tests form four families: a KS test per input column, a KS test per SHAP
column, the permutation test of cluster shares and the classifier two-sample test. Across
the families a weighted Holm step (weights ``drift_stats.FAMILY_WEIGHTS``: inputs 0.4,
explanations 0.3, cluster shares 0.15, classifier 0.15) runs on each family's global
(Simes, or Bonferroni on request) p-value; within a family that drifted,
Benjamini-Hochberg (default) or Bonferroni flags the tests
(:func:`nbdebug.analysis.drift_stats.hierarchical`). ``alarm`` (some family drifted) and
so every flag fire at rate ``alpha`` or less when nothing drifted, whatever the dependence
between the families (``benchmarks/bench_drift.py calibration``); every flagged feature
lies in a drifted family, and the two multivariate tests are not drowned by the ``2 d``
per-feature tests.

Choose a reference the model was *not* trained on (a validation split): SHAP values on
training rows differ from those on new rows when the model over-fits, and that difference
would read as explanation drift.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..core.display import show as show_result
from . import drift_stats as st
from .drift_data import prepare_batches
from .drift_exposure import EXPOSURE_MIN, exposure_table, quadrant
from .drift_groups import groups_frame, name_groups
from .drift_sample import DEFAULT_SAMPLING_ERROR, dkw_error, rows_for_error, stratified_rows
from .explain import adapt_model, check_explainer, explain_batches, predict_batches
from .explain_pipeline import takes_strings

__all__ = ["ClassifierTest", "ClusterTest", "DriftReport", "drift", "drift_from_shap"]


@dataclass(repr=False)
class ClassifierTest:
    """Classifier two-sample test on the SHAP matrix (see
    :func:`nbdebug.analysis.drift_stats.classifier_test`)."""

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
        :mod:`~nbdebug.analysis.drift_exposure`), ``input_test`` (``"KS"``, or
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
        :mod:`~nbdebug.analysis.drift_groups`), ``purity``, ``coverage``,
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
        One sentence: what changed and whether the model cares.
    summary : str
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
    summary: str
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

    def to_frame(self) -> pd.DataFrame:
        """The feature table (a copy)."""
        return self.features.copy()

    def show(self, **kwargs: Any) -> Any:
        """The interactive panel (:class:`nbdebug.widgets.drift.DriftPanel`)."""
        return show_result(self, **kwargs)

    def __repr__(self) -> str:
        d = len(self.feature_names)
        return (
            f"DriftReport(alarm={self.alarm}, inputs drifted {len(self.drifted_inputs)}/{d}, "
            f"explanations drifted {len(self.drifted_explanations)}/{d}, "
            f"{self.cluster_test.k} clusters (p_adj={self.cluster_test.p_adjusted:.3g}), "
            f"classifier AUC={self.classifier.auc:.3f} (p_adj={self.classifier.p_adjusted:.3g}), "
            f"n_reference={self.n_reference}, n_current={self.n_current})"
        )


def _names(items: list[str], limit: int = 5) -> str:
    shown = [f"`{s}`" for s in items[:limit]]
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(shown) + more


def _headline(feats: pd.DataFrame, *, alarm: bool, shift: float, unit: str) -> str:
    """One sentence: what changed, and whether the model's predictions move with it."""
    d = len(feats)
    inp = [str(f) for f in feats.index[feats["drifted_input"]]]
    acted = [str(f) for f in feats.index[feats["quadrant"] == "input+explanation"]]
    ignored = [str(f) for f in feats.index[feats["quadrant"] == "input only"]]
    via = [str(f) for f in feats.index[feats["quadrant"] == "explanation only"]]
    share = float(feats.loc[acted + via, "exposure_share"].sum()) if acted or via else 0.0
    moved = f"the mean prediction moved by {shift:+.3g} ({unit})"
    if not inp and not via:
        if alarm:
            return (
                f"No single input drifted, but the batches differ jointly (see the cluster and "
                f"classifier tests); {moved}."
            )
        return (
            "Nothing drifted: no input changed distribution and the model's explanations "
            f"did not move ({moved})."
        )
    head = f"{len(inp)} of {d} inputs drifted" + (f" ({_names(inp, 3)})" if inp else "")
    if acted:
        parts = [f"the model acts on {_names(acted, 3)}"]
        if via:
            parts.append(f"and, through them, on {_names(via, 2)}")
        parts.append(f"({share:.0%} of the prediction shift)")
        tail = " ".join(parts)
        if ignored:
            tail += f" but not on {_names(ignored, 3)}"
        return f"{head}: {tail}; {moved}."
    if via:
        return (
            f"{head}; the model's use of {_names(via, 3)} changed ({share:.0%} of the prediction "
            f"shift) although those inputs did not drift; {moved}."
        )
    them = "it" if len(inp) == 1 else "them"
    return f"{head}, but the model's predictions do not move with {them} ({moved})."


def _summary(
    headline: str,
    feats: pd.DataFrame,
    clusters: pd.DataFrame,
    ctest: ClusterTest,
    clf: ClassifierTest,
    *,
    alarm: bool,
    alpha: float,
    correction: str,
    explainer: str,
    output: str,
    n_ref: int,
    n_cur: int,
    m_ref: int,
    m_cur: int,
    sampling_error: float,
    notes: list[str],
) -> str:
    only_inp = [str(f) for f in feats.index[feats["quadrant"] == "input only"]]
    only_exp = [str(f) for f in feats.index[feats["quadrant"] == "explanation only"]]
    s = [headline]
    s.append(f"Drift alarm at alpha={alpha:g}." if alarm else f"No drift alarm at alpha={alpha:g}.")
    if only_inp:
        s.append(f"Input drift the model does not act on: {_names(only_inp)}.")
    if only_exp:
        s.append(
            f"Explanation drift without input drift (the model uses these differently, through "
            f"other features that moved): {_names(only_exp)}."
        )
    if ctest.k >= 2:
        i_top = int(np.argmax(clusters["change"].to_numpy()))
        top = clusters.iloc[i_top]
        moved = ctest.p_adjusted <= alpha
        s.append(
            f"In SHAP space the rows form {ctest.k} clusters ({ctest.method}); their shares "
            + ("changed" if moved else "did not change significantly")
            + f" (permutation p={ctest.p_value:.3g}, corrected {ctest.p_adjusted:.3g})"
            + (
                f": {top['name']} (purity {top['purity']:.0%}) grew from "
                f"{top['group_share_reference']:.0%} of the reference to "
                f"{top['group_share_current']:.0%} of the current batch."
                if moved
                else "."
            )
        )
    else:
        s.append("In SHAP space all rows are alike: a single cluster, no share to compare.")
    if math.isfinite(clf.auc):
        sep = "separates" if clf.p_adjusted <= alpha else "does not separate"
        s.append(
            f"A classifier {sep} the two batches' SHAP values (held-out AUC {clf.auc:.2f}, "
            f"p={clf.p_value:.3g})."
        )
    else:
        s.append("The classifier test did not run: fewer than 4 explained rows in a batch.")
    sampled = (
        f"SHAP on a stratified subsample of {m_ref} + {m_cur} rows (CDF error <= "
        f"{sampling_error:.2f} at 95%, DKW)"
        if sampling_error > 0
        else "SHAP on every row"
    )
    s.append(
        f"Tests: four families (a KS test per input column, a KS test per SHAP column, the "
        f"permutation test of cluster shares, the classifier test), weighted Holm across "
        f"families, {correction} within the drifted ones; exposure is "
        f"material from "
        f"{EXPOSURE_MIN:.0%} of the output's spread. SHAP: {explainer} on {output}; "
        f"{n_ref} reference vs {n_cur} current rows; {sampled}."
    )
    if notes:
        s.append("Notes: " + "; ".join(notes) + ".")
    return " ".join(s)


def _check_options(
    alpha: Any,
    correction: Any,
    n_clusters: Any,
    cluster_method: Any,
    n_permutations: Any,
    random_state: Any = 0,
) -> None:
    if isinstance(random_state, bool) or not isinstance(random_state, (int, np.integer)):
        raise ValueError(f"random_state must be an integer; got {random_state!r}.")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < 1:
        raise ValueError(f"alpha must be a number strictly between 0 and 1; got {alpha!r}.")
    if correction not in st.CORRECTIONS:
        raise ValueError(f"correction must be one of {tuple(st.CORRECTIONS)}; got {correction!r}.")
    if n_clusters != "auto" and (
        isinstance(n_clusters, bool)
        or not isinstance(n_clusters, (int, np.integer))
        or n_clusters < 2
    ):
        raise ValueError(f"n_clusters must be 'auto' or an integer >= 2; got {n_clusters!r}.")
    if cluster_method not in st.CLUSTER_METHODS:
        raise ValueError(
            f"cluster_method must be one of {st.CLUSTER_METHODS}; got {cluster_method!r}."
        )
    if n_permutations != "auto" and (
        isinstance(n_permutations, bool)
        or not isinstance(n_permutations, (int, np.integer))
        or n_permutations < 1
    ):
        raise ValueError(
            f"n_permutations must be 'auto' or a positive integer; got {n_permutations!r}."
        )


def _rows(rows: Any, n: int, name: str) -> np.ndarray:
    if rows is None:
        return np.arange(n, dtype=np.int64)
    r = np.asarray(rows, dtype=np.int64)
    if r.ndim != 1 or (len(r) and (r.min() < 0 or r.max() >= n)):
        raise ValueError(f"{name} must be row indices in [0, {n}); got shape {r.shape}.")
    return r


def drift_from_shap(
    reference: np.ndarray,
    current: np.ndarray,
    reference_shap: np.ndarray,
    current_shap: np.ndarray,
    *,
    feature_names: list[str] | None = None,
    reference_rows: Any = None,
    current_rows: Any = None,
    classes_reference: np.ndarray | None = None,
    classes_current: np.ndarray | None = None,
    categorical: Any = (),
    n_clusters: Any = "auto",
    cluster_method: str = "kmeans",
    alpha: float = 0.05,
    correction: str = "fdr",
    n_permutations: Any = "auto",
    random_state: int = 0,
    progress: bool = True,
    explainer: str = "precomputed",
    output: str = "precomputed SHAP values",
    notes: list[str] | None = None,
    timings: dict[str, float] | None = None,
) -> DriftReport:
    """The statistics of :func:`drift` on inputs and SHAP values already computed.

    Parameters
    ----------
    reference, current : numpy.ndarray
        float ``(n_reference, d)`` and ``(n_current, d)`` inputs, finite.
    reference_shap, current_shap : numpy.ndarray
        SHAP values of the explained rows, ``(m_reference, d)`` and ``(m_current, d)``.
    reference_rows, current_rows : array of int, optional
        Which rows were explained (default: all, in order; then ``m = n``).
    classes_reference, classes_current : numpy.ndarray, optional
        The model's predicted class of every row, ``(n_reference,)`` and ``(n_current,)``:
        clusters that are a class are named by it.
    categorical : dict of int to list, or sequence of int
        Columns holding category codes (0, 1, ...), with their categories when a dict:
        their input test is a chi-square test on the category counts instead of KS, and
        a group rule on them names the categories.

    Other parameters are those of :func:`drift`; ``explainer``, ``output``, ``notes`` and
    ``timings`` only describe where the SHAP values came from.

    Returns
    -------
    DriftReport
    """
    _check_options(alpha, correction, n_clusters, cluster_method, n_permutations, random_state)
    xr = np.array(reference, dtype=np.float64)
    xc = np.array(current, dtype=np.float64)
    sr = np.array(reference_shap, dtype=np.float64)
    sc = np.array(current_shap, dtype=np.float64)
    if xr.ndim != 2 or xc.ndim != 2 or xc.shape[1] != xr.shape[1]:
        raise ValueError(
            f"reference and current must be 2-D with the same number of columns; got "
            f"{xr.shape} and {xc.shape}."
        )
    ir = _rows(reference_rows, len(xr), "reference_rows")
    ic = _rows(current_rows, len(xc), "current_rows")
    for name, a, m in (("reference_shap", sr, len(ir)), ("current_shap", sc, len(ic))):
        if a.ndim != 2 or a.shape != (m, xr.shape[1]):
            raise ValueError(f"{name} must have shape {(m, xr.shape[1])}; got {a.shape}.")
    for name, a in (
        ("reference", xr),
        ("current", xc),
        ("reference_shap", sr),
        ("current_shap", sc),
    ):
        if not np.isfinite(a).all():
            raise ValueError(
                f"{name} holds {int((~np.isfinite(a)).sum())} NaN/inf values; expected "
                f"finite numbers."
            )
    d = xr.shape[1]
    names = (
        [str(n) for n in feature_names]
        if feature_names is not None
        else [f"x{j}" for j in range(d)]
    )
    if len(names) != d:
        raise ValueError(f"feature_names has {len(names)} names but the data has {d} columns.")
    cat: dict[int, list[Any] | None] = (
        {int(j): list(v) for j, v in categorical.items()}
        if isinstance(categorical, dict)
        else {int(j): None for j in categorical}
    )
    if any(j < 0 or j >= d for j in cat):
        raise ValueError(f"categorical must be column indices in [0, {d}); got {sorted(cat)}.")
    timings = dict(timings or {})
    notes = list(notes or [])
    from threadpoolctl import threadpool_limits

    # one BLAS/OpenMP thread: k-means on a busy machine is up to 25x slower with more,
    # and the results no longer depend on the thread count
    with threadpool_limits(limits=1):
        return _statistics(
            xr,
            xc,
            sr,
            sc,
            ir,
            ic,
            names,
            classes_reference,
            classes_current,
            categorical=cat,
            n_clusters=n_clusters,
            cluster_method=cluster_method,
            alpha=float(alpha),
            correction=correction,
            n_permutations=n_permutations,
            random_state=random_state,
            progress=progress,
            explainer=explainer,
            output=output,
            notes=notes,
            timings=timings,
        )


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


def _statistics(
    xr: np.ndarray,
    xc: np.ndarray,
    sr: np.ndarray,
    sc: np.ndarray,
    ir: np.ndarray,
    ic: np.ndarray,
    names: list[str],
    classes_reference: np.ndarray | None,
    classes_current: np.ndarray | None,
    *,
    categorical: dict[int, list[Any] | None],
    n_clusters: Any,
    cluster_method: str,
    alpha: float,
    correction: str,
    n_permutations: Any,
    random_state: int,
    progress: bool,
    explainer: str,
    output: str,
    notes: list[str],
    timings: dict[str, float],
) -> DriftReport:
    t = time.perf_counter()
    feats = st.feature_tests(xr, xc, sr, sc, names, frozenset(categorical))
    expo, scale = exposure_table(sr, sc, names, random_state=random_state)
    feats = feats.join(expo)
    timings["feature tests"] = time.perf_counter() - t

    s = np.concatenate([sr, sc], axis=0)
    x = np.concatenate([xr[ir], xc[ic]], axis=0)
    is_cur = np.r_[np.zeros(len(sr), bool), np.ones(len(sc), bool)]
    if n_permutations == "auto":
        # the smallest attainable p-value, 1 / (B + 1), stays well below alpha / 4
        n_permutations = max(999, math.ceil(40 / alpha))
    t = time.perf_counter()
    clustering = st.cluster_shap(
        s,
        n_clusters=n_clusters,
        method=cluster_method,
        random_state=random_state,
        progress=progress,
        max_k=st.auto_max_k(len(sr), len(sc)),
    )
    clustering, chi2, p_clu = st.most_shifted_clustering(
        clustering, is_cur, int(n_permutations), random_state
    )
    table, chi2, p_clu, dof = st.cluster_table(clustering, is_cur, s, x, names, test=(chi2, p_clu))
    have_classes = classes_reference is not None and classes_current is not None
    groups = name_groups(
        clustering.labels,
        x,
        names,
        xr,
        xc,
        classes=np.r_[classes_reference[ir], classes_current[ic]]
        if have_classes and classes_reference is not None and classes_current is not None
        else None,
        classes_reference=classes_reference,
        classes_current=classes_current,
        categories={j: v for j, v in categorical.items() if v is not None},
        random_state=random_state,
    )
    table = table.rename(columns={"name": "shap_profile"})
    table = groups_frame(groups).join(table)
    timings["clusters"] = time.perf_counter() - t

    t = time.perf_counter()
    clf = st.classifier_test(s, is_cur, random_state=random_state)
    timings["classifier test"] = time.perf_counter() - t

    adjusted, families = st.hierarchical(
        {
            "inputs": feats["ks_p"].to_numpy(),
            "explanations": feats["shap_ks_p"].to_numpy(),
            "cluster shares": np.array([p_clu]),
            "classifier": np.array([clf.p_value]),
        },
        correction,
        alpha,
        st.FAMILY_WEIGHTS,
    )
    feats["ks_p_adj"] = adjusted["inputs"]
    feats["shap_ks_p_adj"] = adjusted["explanations"]
    feats["drifted_input"] = feats["ks_p_adj"] <= alpha
    feats["drifted_explanation"] = (feats["shap_ks_p_adj"] <= alpha) & feats["material"]
    feats["quadrant"] = [
        quadrant(bool(a), bool(b))
        for a, b in zip(feats["drifted_input"], feats["drifted_explanation"])
    ]
    feats["_flag"] = feats["drifted_input"] | feats["drifted_explanation"]
    feats["_score"] = np.maximum(feats["ks"], feats["shap_ks"])
    feats = feats.sort_values(
        ["_flag", "drifted_explanation", "exposure_share", "_score"],
        ascending=[False, False, False, False],
        kind="stable",
    )
    feats = feats[FEATURE_COLUMNS]
    ctest = ClusterTest(
        chi2,
        p_clu,
        float(adjusted["cluster shares"][0]),
        dof,
        clustering.k,
        clustering.method,
        clustering.silhouette,
    )
    ctest_obj = ClassifierTest(
        clf.auc,
        clf.p_value,
        float(adjusted["classifier"][0]),
        clf.n_permutations,
        clf.n_splits,
        clf.classifier,
    )
    alarm = bool(families["drift"].any())

    t = time.perf_counter()
    coords, ratio = st.pca_map(s, random_state)
    timings["pca"] = time.perf_counter() - t

    shift = float(sc.sum(axis=1).mean() - sr.sum(axis=1).mean())
    unit = output.rsplit("(", 1)[-1].rstrip(")") if "(" in output else output
    headline = _headline(feats, alarm=alarm, shift=shift, unit=unit)
    sampling_error = max(
        dkw_error(len(ir)) if len(ir) < len(xr) else 0.0,
        dkw_error(len(ic)) if len(ic) < len(xc) else 0.0,
    )
    corr_name = st.CORRECTIONS[correction]
    summary = _summary(
        headline,
        feats,
        table,
        ctest,
        ctest_obj,
        alarm=alarm,
        alpha=float(alpha),
        correction=corr_name,
        explainer=explainer,
        output=output,
        n_ref=len(xr),
        n_cur=len(xc),
        m_ref=len(ir),
        m_cur=len(ic),
        sampling_error=sampling_error,
        notes=notes,
    )
    return DriftReport(
        features=feats,
        clusters=table,
        alarm=alarm,
        summary=summary,
        classifier=ctest_obj,
        cluster_test=ctest,
        alpha=float(alpha),
        correction=corr_name,
        tests=families,
        explainer=explainer,
        output=output,
        feature_names=names,
        reference=xr,
        current=xc,
        reference_shap=sr,
        current_shap=sc,
        labels=clustering.labels,
        pca=coords,
        pca_variance=ratio,
        headline=headline,
        prediction_shift=shift,
        output_scale=scale,
        reference_rows=ir,
        current_rows=ic,
        sampling_error=sampling_error,
        notes=notes,
        timings=timings,
    )


def _strata_score(preds: np.ndarray) -> np.ndarray:
    """One number per row to stratify on: the output (one output), class 1's score (two),
    else the predicted class, then its score."""
    if preds.shape[1] == 1:
        return preds[:, 0]
    if preds.shape[1] == 2:
        return preds[:, 1]
    top = preds.argmax(axis=1)
    mx = preds.max(axis=1)
    span = np.ptp(mx) or 1.0
    return top + (mx - mx.min()) / span * 0.999


def drift(
    model: Any,
    reference: Any,
    current: Any,
    *,
    feature_names: list[str] | None = None,
    explainer: str = "auto",
    background: int = 100,
    n_clusters: Any = "auto",
    alpha: float = 0.05,
    correction: str = "fdr",
    random_state: int = 0,
    output: Any = "auto",
    cluster_method: str = "kmeans",
    n_permutations: Any = "auto",
    sampling_error: float = DEFAULT_SAMPLING_ERROR,
    one_hot: bool = False,
    nan_policy: str = "raise",
    progress: bool = True,
) -> DriftReport:
    """Did the inputs drift, does the model act on it, where, and for whom?

    Parameters
    ----------
    model : scikit-learn estimator or Pipeline, torch.nn.Module or callable
        A fitted estimator (with ``predict_proba``, ``decision_function`` or ``predict``);
        a module taking a float ``(n, d)`` tensor and returning ``(n,)`` or ``(n, k)``; or
        a function ``f(X: ndarray (n, d)) -> (n,) or (n, k)``. Not modified (torch modules:
        parameters, buffers, grads, train/eval, hooks, RNG).
    reference, current : pandas.DataFrame, numpy.ndarray or torch.Tensor
        ``(n_reference, d)`` and ``(n_current, d)``. DataFrames are matched by column
        name. Use a reference the model was not trained on. Not modified.
    feature_names : list of str, optional
        Display names (default: the DataFrame columns, else ``x0, x1, ...``).
    explainer : {"auto", "tree", "linear", "deep", "gradient", "kernel", "permutation"}
        shap explainer; ``"auto"`` picks by model kind (see :mod:`nbdebug.analysis.explain`).
    background : int
        Reference rows sampled as the explainer's background (tree models need none).
    n_clusters : "auto" or int
        Clusters of the explained rows in SHAP space; ``"auto"``: k in 2..8 by silhouette.
    alpha : float
        Level of the tests, after correction.
    correction : {"fdr", "bonferroni"}
        Benjamini-Hochberg (default) or Bonferroni within each test family (its global
        p-value: Simes or Bonferroni); across the four families a weighted Holm step
        (see the module docstring).
    random_state : int
        Seeds the subsample, the background, the clustering, the folds and the permutations.
    output : "auto", "predicted" or int
        Which model output to explain when there are several: ``"auto"`` is class 1 of
        two classes and, for more, the signed sum of the outputs by the sign of each
        one's mean change between the batches, measured on every row: for
        probabilities, the probability mass that moved between classes
        (:func:`nbdebug.analysis.explain.moved_direction`); ``"predicted"`` explains each
        row's predicted class.
    cluster_method : {"kmeans", "agglomerative"}
    n_permutations : "auto" or int
        Permutations for the cluster-share test (``"auto"``: enough to pass the correction).
    sampling_error : float
        Batches of more than 1,000 rows get SHAP values on a stratified subsample of
        ``ceil(ln(40) / (2 sampling_error^2))`` rows (82 by default); each SHAP column's
        distribution is then within ``sampling_error`` of the whole batch's at 95%
        confidence (:mod:`nbdebug.analysis.drift_sample`). Input tests use every row.
    one_hot : bool
        One-hot encode non-numeric columns instead of refusing them. A ``Pipeline``
        fitted on a DataFrame (e.g. one whose ``ColumnTransformer`` one-hot encodes string
        columns) gets the strings as they are: each such column is one feature, its SHAP
        value the sum over its one-hot columns, its input test a chi-square test on the
        category counts.
    nan_policy : {"raise", "impute"}
        Refuse NaN/inf values (default) or replace them with the reference median.
    progress : bool
        ``tqdm`` progress bars on stages slower than a second.

    Returns
    -------
    DriftReport

    Raises
    ------
    TypeError, ValueError
        Bad batches (mismatched columns or dtypes, non-numeric columns, NaN, fewer than 2
        rows), a model without ``predict_proba``/``predict``, or bad options, each in one
        sentence. Fewer than 20 rows in a batch only warns.
    """
    check_explainer(explainer, background)
    if (
        isinstance(sampling_error, bool)
        or not isinstance(sampling_error, (int, float))
        or not 0 < sampling_error < 1
    ):
        raise ValueError(
            f"sampling_error must be a number strictly between 0 and 1; got {sampling_error!r}."
        )
    _check_options(alpha, correction, n_clusters, cluster_method, n_permutations, random_state)
    if output not in ("auto", "predicted") and (
        isinstance(output, bool) or not isinstance(output, (int, np.integer))
    ):
        raise ValueError(f"output must be 'auto', 'predicted' or an integer; got {output!r}.")
    timings: dict[str, float] = {}
    t = time.perf_counter()
    batches = prepare_batches(
        reference,
        current,
        feature_names=feature_names,
        one_hot=one_hot,
        nan_policy=nan_policy,
        categorical=takes_strings(model),
    )
    xr, xc, names = batches.reference, batches.current, batches.feature_names
    notes = list(batches.notes)
    model_cols = [str(c) for c in getattr(model, "feature_names_in_", [])] or None
    if model_cols is not None and batches.frame_columns is not None:
        have = batches.frame_columns
        missing = [c for c in model_cols if c not in have]
        extra = [c for c in have if c not in model_cols]
        if missing or extra:
            raise ValueError(
                f"the batches' columns do not match the columns the model was fitted on; "
                f"missing: {missing}, not used by the model: {extra}."
            )
        if have != model_cols:
            order = [have.index(c) for c in model_cols]
            xr, xc = xr[:, order], xc[:, order]
            names = [names[j] for j in order]
            notes.append("columns were put in the order the model was fitted with")
    adapter = adapt_model(model, xr.shape[1], batches.categories or None)
    cols = model_cols or batches.frame_columns or []
    categorical = {j: batches.categories[c] for j, c in enumerate(cols) if c in batches.categories}
    timings["validate"] = time.perf_counter() - t

    t = time.perf_counter()
    pr, pc = predict_batches(adapter, xr, xc, random_state)
    m = rows_for_error(float(sampling_error))
    ir = stratified_rows(_strata_score(pr), m, random_state)
    ic = stratified_rows(_strata_score(pc), m, random_state + 1)
    classes = adapter.classes
    cls_r = cls_c = None
    if classes is not None and pr.shape[1] == len(classes) and len(classes) >= 2:
        lookup = np.asarray(classes, dtype=object)
        cls_r, cls_c = lookup[pr.argmax(axis=1)], lookup[pc.argmax(axis=1)]
    timings["predict"] = time.perf_counter() - t

    t = time.perf_counter()
    sv = explain_batches(
        model,
        xr[ir],
        xc[ic],
        explainer=explainer,
        background=background,
        output=output,
        random_state=random_state,
        progress=progress,
        adapter=adapter,
        predictions=(pr, pc),
    )
    timings["shap"] = time.perf_counter() - t
    return drift_from_shap(
        xr,
        xc,
        sv.reference,
        sv.current,
        feature_names=names,
        reference_rows=ir,
        current_rows=ic,
        classes_reference=cls_r,
        classes_current=cls_c,
        categorical=categorical,
        n_clusters=n_clusters,
        cluster_method=cluster_method,
        alpha=alpha,
        correction=correction,
        n_permutations=n_permutations,
        random_state=random_state,
        progress=progress,
        explainer=sv.explainer,
        output=sv.output,
        notes=notes + sv.notes,
        timings=timings,
    )
