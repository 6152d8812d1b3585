"""The statistics of :func:`nbdebug.drift` on inputs and SHAP values already computed:
:func:`drift_from_shap`, and the assembly of a :class:`DriftReport` from the tests of
:mod:`~nbdebug.analysis.drift.statistics`, :mod:`~nbdebug.analysis.drift.clustering` and
:mod:`~nbdebug.analysis.drift.classifier`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

import numpy as np
import pandas as pd

from ...core.options import refuse_unknown
from . import clustering as cu
from . import statistics as st
from .classifier import classifier_test
from .exposure import exposure_table, quadrant
from .groups import PredictedClasses, groups_frame, name_groups
from .options import DriftOptions, resolve
from .report import FEATURE_COLUMNS, ClassifierTest, ClusterTest, DriftReport
from .sample import dkw_error
from .wording import details, headline


@dataclass(frozen=True, eq=False)
class ShapSource:
    """What :func:`drift_from_shap` is told about its SHAP values besides the values.

    Attributes
    ----------
    reference_rows, current_rows : array of int, optional
        Which rows were explained (default: all, in order).
    classes_reference, classes_current : numpy.ndarray, optional
        The model's predicted class of every row of each batch.
    categorical : dict of int to list, or sequence of int
        Columns holding category codes, with their categories when a dict.
    explainer, output : str
        Where the SHAP values came from and which model output they explain.
    notes : sequence of str
        What was done to the data before.
    timings : dict of str to float
        Seconds per stage so far.
    """

    reference_rows: Sequence[int] | np.ndarray | None = None
    current_rows: Sequence[int] | np.ndarray | None = None
    classes_reference: np.ndarray | None = None
    classes_current: np.ndarray | None = None
    categorical: Mapping[int, Sequence[object]] | Sequence[int] = ()
    explainer: str = "precomputed"
    output: str = "precomputed SHAP values"
    notes: Sequence[str] = ()
    timings: Mapping[str, float] = field(default_factory=dict)


SOURCE_NAMES = [f.name for f in fields(ShapSource)]


@dataclass
class _Explained:
    """The validated inputs of the statistics: float64 copies and row indices."""

    xr: np.ndarray  # (n_reference, d) inputs
    xc: np.ndarray  # (n_current, d)
    sr: np.ndarray  # (m_reference, d) SHAP values of the rows ir
    sc: np.ndarray  # (m_current, d) of the rows ic
    ir: np.ndarray
    ic: np.ndarray
    names: list[str]
    categorical: dict[int, list[object] | None]
    classes: tuple[np.ndarray, np.ndarray] | None  # predicted class of every row, per batch

    @property
    def sampling_error(self) -> float:
        """DKW bound of the SHAP CDFs of a subsampled batch (0 when all rows are explained)."""
        return max(
            dkw_error(len(self.ir)) if len(self.ir) < len(self.xr) else 0.0,
            dkw_error(len(self.ic)) if len(self.ic) < len(self.xc) else 0.0,
        )

    @property
    def pooled(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """SHAP rows and input rows of both batches stacked (reference first), and which
        are current."""
        s = np.concatenate([self.sr, self.sc], axis=0)
        x = np.concatenate([self.xr[self.ir], self.xc[self.ic]], axis=0)
        is_cur = np.r_[np.zeros(len(self.sr), bool), np.ones(len(self.sc), bool)]
        return s, x, is_cur


def _rows(rows: Sequence[int] | np.ndarray | None, n: int, name: str) -> np.ndarray:
    if rows is None:
        return np.arange(n, dtype=np.int64)
    r = np.asarray(rows, dtype=np.int64)
    if r.ndim != 1 or (len(r) and (r.min() < 0 or r.max() >= n)):
        raise ValueError(f"{name} must be row indices in [0, {n}); got shape {r.shape}.")
    return r


def _checked_arrays(
    arrays: dict[str, np.ndarray], ir: np.ndarray, ic: np.ndarray
) -> dict[str, np.ndarray]:
    xr = arrays["reference"]
    for name, m in (("reference_shap", len(ir)), ("current_shap", len(ic))):
        a = arrays[name]
        if a.ndim != 2 or a.shape != (m, xr.shape[1]):
            raise ValueError(f"{name} must have shape {(m, xr.shape[1])}; got {a.shape}.")
    for name, a in arrays.items():
        if not np.isfinite(a).all():
            raise ValueError(
                f"{name} holds {int((~np.isfinite(a)).sum())} NaN/inf values; expected "
                f"finite numbers."
            )
    return arrays


def _explained(
    arrays: dict[str, np.ndarray], feature_names: Sequence[str] | None, src: ShapSource
) -> _Explained:
    """Validate the four arrays and what the source says about them."""
    xr, xc = arrays["reference"], arrays["current"]
    if xr.ndim != 2 or xc.ndim != 2 or xc.shape[1] != xr.shape[1]:
        raise ValueError(
            f"reference and current must be 2-D with the same number of columns; got "
            f"{xr.shape} and {xc.shape}."
        )
    ir = _rows(src.reference_rows, len(arrays["reference"]), "reference_rows")
    ic = _rows(src.current_rows, len(arrays["current"]), "current_rows")
    a = _checked_arrays(arrays, ir, ic)
    d = a["reference"].shape[1]
    names = (
        [str(n) for n in feature_names]
        if feature_names is not None
        else [f"x{j}" for j in range(d)]
    )
    if len(names) != d:
        raise ValueError(f"feature_names has {len(names)} names but the data has {d} columns.")
    cat: dict[int, list[object] | None] = (
        {int(j): list(v) for j, v in src.categorical.items()}
        if isinstance(src.categorical, Mapping)
        else {int(j): None for j in src.categorical}
    )
    if any(j < 0 or j >= d for j in cat):
        raise ValueError(f"categorical must be column indices in [0, {d}); got {sorted(cat)}.")
    have = src.classes_reference is not None and src.classes_current is not None
    classes = (src.classes_reference, src.classes_current) if have else None
    return _Explained(
        a["reference"],
        a["current"],
        a["reference_shap"],
        a["current_shap"],
        ir,
        ic,
        names,
        cat,
        classes,  # type: ignore[arg-type]
    )


def _cluster_section(
    e: _Explained, opts: DriftOptions
) -> tuple[cu.Clustering, pd.DataFrame, tuple[float, float, int]]:
    """Clusters of the pooled SHAP rows, named, with their share table and test
    ``(chi2, p, dof)``."""
    s, x, is_cur = e.pooled
    clustering = cu.cluster_shap(
        s,
        n_clusters=opts.clusters.n_clusters,
        method=opts.clusters.cluster_method,
        random_state=opts.random_state,
        progress=opts.progress,
        max_k=cu.auto_max_k(len(e.sr), len(e.sc)),
    )
    clustering, chi2, p_clu = cu.most_shifted_clustering(
        clustering, is_cur, opts.significance.permutations, opts.random_state
    )
    table, chi2, p_clu, dof = cu.cluster_table(
        clustering, is_cur, s, x, e.names, test=(chi2, p_clu)
    )
    classes = None
    if e.classes is not None:
        cr, cc = e.classes
        classes = PredictedClasses(np.r_[cr[e.ir], cc[e.ic]], cr, cc)
    groups = name_groups(
        clustering.labels,
        x,
        e.names,
        e.xr,
        e.xc,
        classes=classes,
        categories={j: v for j, v in e.categorical.items() if v is not None},
        random_state=opts.random_state,
    )
    table = groups_frame(groups).join(table.rename(columns={"name": "shap_profile"}))
    return clustering, table, (chi2, p_clu, dof)


def _flagged(feats: pd.DataFrame, adjusted: dict[str, np.ndarray], alpha: float) -> pd.DataFrame:
    """The feature table with its corrected p-values, flags and quadrants, sorted by drift."""
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
    return feats[FEATURE_COLUMNS]


def _timed(timings: dict[str, float], name: str, t: float) -> float:
    now = time.perf_counter()
    timings[name] = now - t
    return now


def report_from_shap(e: _Explained, src: ShapSource, opts: DriftOptions) -> DriftReport:
    """Every test on validated inputs and SHAP values, as a :class:`DriftReport`."""
    timings, notes = dict(src.timings), list(src.notes)
    alpha = float(opts.significance.alpha)
    t = time.perf_counter()
    feats = st.feature_tests(e.xr, e.xc, e.sr, e.sc, e.names, frozenset(e.categorical))
    expo, scale = exposure_table(e.sr, e.sc, e.names, random_state=opts.random_state)
    feats = feats.join(expo)
    t = _timed(timings, "feature tests", t)
    clustering, table, (chi2, p_clu, dof) = _cluster_section(e, opts)
    t = _timed(timings, "clusters", t)
    s, _, is_cur = e.pooled
    clf = classifier_test(s, is_cur, random_state=opts.random_state)
    t = _timed(timings, "classifier test", t)
    adjusted, families = st.hierarchical(
        {
            "inputs": feats["ks_p"].to_numpy(),
            "explanations": feats["shap_ks_p"].to_numpy(),
            "cluster shares": np.array([p_clu]),
            "classifier": np.array([clf.p_value]),
        },
        opts.significance.correction,
        alpha,
        st.FAMILY_WEIGHTS,
    )
    feats = _flagged(feats, adjusted, alpha)
    ctest = ClusterTest(
        chi2, p_clu, float(adjusted["cluster shares"][0]), dof, clustering.k,
        clustering.method, clustering.silhouette,
    )  # fmt: skip
    ctest_obj = ClassifierTest(
        clf.auc, clf.p_value, float(adjusted["classifier"][0]), clf.n_permutations,
        clf.n_splits, clf.classifier,
    )  # fmt: skip
    alarm = bool(families["drift"].any())
    coords, ratio = cu.pca_map(s, opts.random_state)
    _timed(timings, "pca", t)
    shift = float(e.sc.sum(axis=1).mean() - e.sr.sum(axis=1).mean())
    unit = src.output.rsplit("(", 1)[-1].rstrip(")") if "(" in src.output else src.output
    rep = DriftReport(
        features=feats,
        clusters=table,
        alarm=alarm,
        details="",
        classifier=ctest_obj,
        cluster_test=ctest,
        alpha=alpha,
        correction=st.CORRECTIONS[opts.significance.correction],
        tests=families,
        explainer=src.explainer,
        output=src.output,
        feature_names=e.names,
        reference=e.xr,
        current=e.xc,
        reference_shap=e.sr,
        current_shap=e.sc,
        labels=clustering.labels,
        pca=coords,
        pca_variance=ratio,
        headline=headline(feats, alarm=alarm, shift=shift, unit=unit),
        prediction_shift=shift,
        output_scale=scale,
        reference_rows=e.ir,
        current_rows=e.ic,
        sampling_error=e.sampling_error,
        notes=notes,
        timings=timings,
    )
    rep.details = details(rep)
    return rep


def statistics_on(
    arrays: dict[str, np.ndarray],
    feature_names: Sequence[str] | None,
    src: ShapSource,
    opts: DriftOptions,
) -> DriftReport:
    """Validate, then :func:`report_from_shap` with one BLAS/OpenMP thread."""
    from threadpoolctl import threadpool_limits

    e = _explained(arrays, feature_names, src)
    # one BLAS/OpenMP thread: k-means on a busy machine is up to 25x slower with more,
    # and the results no longer depend on the thread count
    with threadpool_limits(limits=1):
        return report_from_shap(e, src, opts)


def drift_from_shap(
    reference: np.ndarray,
    current: np.ndarray,
    reference_shap: np.ndarray,
    current_shap: np.ndarray,
    *,
    feature_names: Sequence[str] | None = None,
    source: ShapSource | None = None,
    options: DriftOptions | None = None,
    **kw: object,
) -> DriftReport:
    """The statistics of :func:`nbdebug.drift` on inputs and SHAP values already computed.

    Parameters
    ----------
    reference, current : numpy.ndarray
        float ``(n_reference, d)`` and ``(n_current, d)`` inputs, finite.
    reference_shap, current_shap : numpy.ndarray
        SHAP values of the explained rows, ``(m_reference, d)`` and ``(m_current, d)``.
    feature_names : list of str, optional
        Default ``x0, x1, ...``.
    source : ShapSource, optional
        What is known about the SHAP values; each of its fields may also be given as a
        keyword:
    reference_rows, current_rows : array of int, optional
        Which rows were explained (default: all, in order; then ``m = n``).
    classes_reference, classes_current : numpy.ndarray, optional
        The model's predicted class of every row, ``(n_reference,)`` and ``(n_current,)``:
        clusters that are a class are named by it.
    categorical : dict of int to list, or sequence of int
        Columns holding category codes (0, 1, ...), with their categories when a dict:
        their input test is a chi-square test on the category counts instead of KS, and
        a group rule on them names the categories.
    explainer, output, notes, timings
        Only describe where the SHAP values came from (``"precomputed"``).
    options : DriftOptions, optional
        The options of :func:`nbdebug.drift`, also as keywords; of these the statistics
        read ``n_clusters``, ``cluster_method``, ``alpha``, ``correction``,
        ``n_permutations``, ``random_state`` and ``progress``.

    Returns
    -------
    DriftReport

    Raises
    ------
    TypeError
        A keyword that is neither a field of :class:`ShapSource` nor an option.
    """
    mine = {k: v for k, v in kw.items() if k in SOURCE_NAMES}
    rest = {k: v for k, v in kw.items() if k not in SOURCE_NAMES}
    refuse_unknown(
        rest,
        [k for k in DriftOptions.names() if k not in SOURCE_NAMES],
        where="drift_from_shap()",
        listed=["feature_names", "source", "options", *SOURCE_NAMES],
    )
    opts = resolve(options, rest, "drift_from_shap()")
    src = replace(source or ShapSource(), **mine)  # type: ignore[arg-type]
    arrays = {
        "reference": np.array(reference, dtype=np.float64),
        "current": np.array(current, dtype=np.float64),
        "reference_shap": np.array(reference_shap, dtype=np.float64),
        "current_shap": np.array(current_shap, dtype=np.float64),
    }
    return statistics_on(arrays, feature_names, src, opts)
