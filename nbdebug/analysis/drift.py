"""Data drift through SHAP: is the current batch different from the reference, where, and
does the model see it?

>>> rep = nbdebug.drift(model, X_valid, X_today, feature_names=names)
>>> rep.alarm, rep.features.head(), rep.clusters
>>> rep.show()       # the panel: table, overlays, SHAP map, cluster shares

The report's tests form four families: a KS test per input column, a KS test per SHAP
column, the chi-square test of cluster shares and the classifier two-sample test. They are
corrected in two levels (Benjamini and Bogomolov, 2014; Benjamini-Hochberg by default,
Bonferroni on request): across the families on their global (Simes / Bonferroni)
p-values, then within the families that drifted. ``alarm`` (some family drifted) fires at
rate ``alpha`` or less when nothing drifted, every flagged feature lies in a drifted
family, and the two multivariate tests are not drowned by the ``2 d`` per-feature tests.

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
from .explain import EXPLAINERS, adapt_model, explain_batches

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
        One row per feature, sorted by drift (flagged first, then by the larger KS
        statistic): ``quadrant``, ``ks``, ``ks_p``, ``ks_p_adj``, ``wasserstein``
        (Wasserstein-1 / reference std), ``shap_ks``, ``shap_ks_p``, ``shap_ks_p_adj``,
        ``shap_wasserstein``, ``drifted_input``, ``drifted_explanation``, ``mean_shift``
        (in reference stds), ``shap_importance`` (mean |SHAP| on the reference).
    clusters : pandas.DataFrame
        One row per cluster of the pooled rows in SHAP space: ``name``, ``n_reference``,
        ``n_current``, ``share_reference``, ``share_current``, ``change``, ``residual``.
    alarm : bool
        Some family of tests drifted (see ``tests``).
    tests : pandas.DataFrame
        One row per family (``inputs``, ``explanations``, ``cluster shares``,
        ``classifier``): ``n_tests``, ``p_value`` (global), ``p_adjusted`` (across
        families), ``drift``.
    summary : str
        One paragraph in words.
    classifier, cluster_test : ClassifierTest, ClusterTest
        The two multivariate tests.
    reference, current : numpy.ndarray
        The inputs as float64 ``(n_reference, d)``, ``(n_current, d)`` (copies).
    reference_shap, current_shap : numpy.ndarray
        Their SHAP values, same shapes.
    labels : numpy.ndarray
        int64 ``(n_reference + n_current,)``: cluster of each row, reference rows first.
    pca : numpy.ndarray
        float64 ``(n_reference + n_current, 2)``: the PCA map of the SHAP rows.
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
        """bool ``(n_reference + n_current,)``: which pooled rows come from the current batch."""
        return np.r_[np.zeros(self.n_reference, bool), np.ones(self.n_current, bool)]

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


def _summary(
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
    notes: list[str],
) -> str:
    d = len(feats)
    inp = [str(f) for f in feats.index[feats["drifted_input"]]]
    exp = [str(f) for f in feats.index[feats["drifted_explanation"]]]
    only_exp = [str(f) for f in feats.index[feats["quadrant"] == "explanation only"]]
    only_inp = [str(f) for f in feats.index[feats["quadrant"] == "input only"]]
    s = []
    if alarm:
        s.append(f"Drift alarm at alpha={alpha:g}.")
    else:
        s.append(f"No drift detected at alpha={alpha:g}.")
    if inp:
        s.append(f"{len(inp)} of {d} inputs changed distribution ({_names(inp)}).")
    else:
        s.append(f"None of the {d} inputs changed distribution.")
    if exp:
        s.append(f"The model's explanations changed for {len(exp)} ({_names(exp)}).")
    else:
        s.append("The model's explanations (SHAP values) did not change for any feature.")
    if only_inp:
        s.append(f"Input drift the model does not act on: {_names(only_inp)}.")
    if only_exp:
        s.append(
            f"Explanation drift without input drift (the model uses these differently, through "
            f"other features that moved): {_names(only_exp)}."
        )
    if ctest.k >= 2:
        i_top = int(np.argmax(clusters["change"].abs().to_numpy()))
        top = clusters.iloc[i_top]
        moved = ctest.p_adjusted <= alpha
        s.append(
            f"In SHAP space the rows form {ctest.k} clusters ({ctest.method}); their shares "
            + ("changed" if moved else "did not change significantly")
            + f" (chi-square p={ctest.p_value:.3g}, corrected {ctest.p_adjusted:.3g})"
            + (
                f": cluster {clusters.index[i_top]} ({top['name']}) went from "
                f"{top['share_reference']:.0%} of the "
                f"reference to {top['share_current']:.0%} of the current batch."
                if moved
                else "."
            )
        )
    else:
        s.append("In SHAP space all rows are alike: a single cluster, no share to compare.")
    if math.isfinite(clf.auc):
        sep = "separates" if clf.p_adjusted <= alpha else "does not separate"
        s.append(
            f"A classifier {sep} the two batches' SHAP values (cross-fitted AUC {clf.auc:.2f}, "
            f"permutation p={clf.p_value:.3g})."
        )
    s.append(
        f"Tests: four families (a KS test per input column, a KS test per SHAP column, the "
        f"chi-square test of cluster shares, the classifier test), {correction} across families "
        f"and then within the drifted ones (Benjamini-Bogomolov). SHAP: {explainer} on {output}; "
        f"{n_ref} reference vs {n_cur} current rows."
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


def drift_from_shap(
    reference: np.ndarray,
    current: np.ndarray,
    reference_shap: np.ndarray,
    current_shap: np.ndarray,
    *,
    feature_names: list[str] | None = None,
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
        Their SHAP values, same shapes.

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
    for name, a, like in (
        ("reference_shap", sr, xr),
        ("current_shap", sc, xc),
        ("current", xc, xr),
    ):
        if (
            a.ndim != 2
            or a.shape[1] != like.shape[1]
            or (name != "current" and a.shape[0] != like.shape[0])
        ):
            raise ValueError(
                f"{name} must have shape "
                f"{(like.shape[0] if name != 'current' else 'n_current', like.shape[1])}; "
                f""
                f"got {a.shape}."
            )
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
            names,
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


def _statistics(
    xr: np.ndarray,
    xc: np.ndarray,
    sr: np.ndarray,
    sc: np.ndarray,
    names: list[str],
    *,
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
    feats = st.feature_tests(xr, xc, sr, sc, names)
    timings["feature tests"] = time.perf_counter() - t

    s = np.concatenate([sr, sc], axis=0)
    x = np.concatenate([xr, xc], axis=0)
    is_cur = np.r_[np.zeros(len(xr), bool), np.ones(len(xc), bool)]
    t = time.perf_counter()
    clustering = st.cluster_shap(
        s,
        n_clusters=n_clusters,
        method=cluster_method,
        random_state=random_state,
        progress=progress,
        max_k=st.auto_max_k(len(xr), len(xc)),
    )
    table, chi2, p_clu, dof = st.cluster_table(clustering, is_cur, s, x, names)
    timings["clusters"] = time.perf_counter() - t

    if n_permutations == "auto":
        # the smallest attainable p-value, 1 / (B + 1), stays well below alpha / 4
        n_permutations = max(999, math.ceil(40 / alpha))
    t = time.perf_counter()
    clf = st.classifier_test(
        s, is_cur, n_permutations=int(n_permutations), random_state=random_state
    )
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
    )
    feats["ks_p_adj"] = adjusted["inputs"]
    feats["shap_ks_p_adj"] = adjusted["explanations"]
    feats["drifted_input"] = feats["ks_p_adj"] <= alpha
    feats["drifted_explanation"] = feats["shap_ks_p_adj"] <= alpha
    feats["quadrant"] = [
        st.quadrant(bool(a), bool(b))
        for a, b in zip(feats["drifted_input"], feats["drifted_explanation"])
    ]
    feats["_flag"] = feats["drifted_input"] | feats["drifted_explanation"]
    feats["_score"] = np.maximum(feats["ks"], feats["shap_ks"])
    feats = feats.sort_values(["_flag", "_score"], ascending=[False, False], kind="stable")
    feats = feats[
        [
            "quadrant",
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
    ]
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

    corr_name = st.CORRECTIONS[correction]
    summary = _summary(
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
        notes=notes,
        timings=timings,
    )


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
    one_hot: bool = False,
    nan_policy: str = "raise",
    progress: bool = True,
) -> DriftReport:
    """Did the inputs drift, did the model's explanations drift, where, and for whom?

    Parameters
    ----------
    model : scikit-learn estimator, torch.nn.Module or callable
        A fitted estimator; a module taking a float ``(n, d)`` tensor and returning
        ``(n,)`` or ``(n, k)``; or a function ``f(X: ndarray (n, d)) -> (n,) or (n, k)``.
        Not modified (torch modules: parameters, buffers, grads, train/eval, hooks, RNG).
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
        Clusters of the pooled rows in SHAP space; ``"auto"``: k in 2..8 by silhouette.
    alpha : float
        Level of the tests, after correction.
    correction : {"fdr", "bonferroni"}
        Benjamini-Hochberg (default) or Bonferroni, applied across the four test families
        and within the drifted ones (see the module docstring).
    random_state : int
        Seeds the background sample, the clustering, the folds and the permutations.
    output : "auto", "predicted" or int
        Which model output to explain when there are several: ``"auto"`` is class 1 of
        two classes and each row's predicted class otherwise.
    cluster_method : {"kmeans", "agglomerative"}
    n_permutations : "auto" or int
        Permutations for the classifier test (``"auto"``: enough to pass the correction).
    one_hot : bool
        One-hot encode non-numeric columns instead of refusing them.
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
        Bad batches (mismatched or non-numeric columns, NaN, fewer than 2 rows) or options,
        each in one sentence. Fewer than 20 rows in a batch only warns.
    """
    if explainer not in EXPLAINERS:
        raise ValueError(f"explainer must be one of {EXPLAINERS}; got {explainer!r}.")
    if (
        isinstance(background, bool)
        or not isinstance(background, (int, np.integer))
        or background < 1
    ):
        raise ValueError(
            f"background must be a positive number of reference rows; got {background!r}."
        )
    _check_options(alpha, correction, n_clusters, cluster_method, n_permutations, random_state)
    if output not in ("auto", "predicted") and (
        isinstance(output, bool) or not isinstance(output, (int, np.integer))
    ):
        raise ValueError(f"output must be 'auto', 'predicted' or an integer; got {output!r}.")
    timings: dict[str, float] = {}
    t = time.perf_counter()
    batches = prepare_batches(
        reference, current, feature_names=feature_names, one_hot=one_hot, nan_policy=nan_policy
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
    adapter = adapt_model(model, xr.shape[1])
    timings["validate"] = time.perf_counter() - t

    t = time.perf_counter()
    sv = explain_batches(
        model,
        xr,
        xc,
        explainer=explainer,
        background=background,
        output=output,
        random_state=random_state,
        progress=progress,
        adapter=adapter,
    )
    timings["shap"] = time.perf_counter() - t
    return drift_from_shap(
        xr,
        xc,
        sv.reference,
        sv.current,
        feature_names=names,
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
