"""Data drift through SHAP: is the current batch different from the reference, where, and
does the model see it?

>>> rep = nbdebug.drift(model, X_valid, X_today, feature_names=names)
>>> rep.alarm, rep.features.head(), rep.clusters
>>> rep.show()       # the panel: table, overlays, SHAP map, cluster shares

Each feature gets its **exposure**: how far its drift moved its push on the model's
predictions, in the output's own units, against the noise of the same quantity between
two halves of the reference, and its share of the prediction shift
(:mod:`nbdebug.analysis.drift.exposure`). The quadrant of a feature comes from input drift
and exposure: "input+explanation" (the model acts on the drift), "input only" (the input
moved, predictions did not move with it), "explanation only", "none".

Input tests run on every row; SHAP values on every row of small batches and on a
stratified subsample of large ones, sized by the sampling error it allows
(:mod:`nbdebug.analysis.drift.sample`).

The report's tests form four families: a KS test per input column, a KS test per SHAP
column, the permutation test of cluster shares and the classifier two-sample test. Across
the families a weighted Holm step (weights ``statistics.FAMILY_WEIGHTS``: inputs 0.4,
explanations 0.3, cluster shares 0.15, classifier 0.15) runs on each family's global
(Simes, or Bonferroni on request) p-value; within a family that drifted,
Benjamini-Hochberg (default) or Bonferroni flags the tests
(:func:`nbdebug.analysis.drift.statistics.hierarchical`). ``alarm`` (some family drifted) and
so every flag fire at rate ``alpha`` or less when nothing drifted, whatever the dependence
between the families (``benchmarks/bench_drift.py calibration``); every flagged feature
lies in a drifted family, and the two multivariate tests are not drowned by the ``2 d``
per-feature tests.

Choose a reference the model was *not* trained on (a validation split): SHAP values on
training rows differ from those on new rows when the model over-fits, and that difference
would read as explanation drift.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from .batches import Batches, prepare_batches
from .explain import explain_batches, predict_batches
from .from_shap import ShapSource, statistics_on
from .models import adapt_model
from .options import DriftOptions, resolve
from .pipeline import takes_strings
from .report import DriftReport
from .sample import rows_for_error, stratified_rows


def _fit_to_model(model: object, b: Batches) -> tuple[list[str] | None, list[str]]:
    """Put the batches' columns in the order the model was fitted with (in place); returns
    the model's columns (None when it names none) and the feature names."""
    names = b.feature_names
    model_cols = [str(c) for c in getattr(model, "feature_names_in_", [])] or None
    if model_cols is None or b.frame_columns is None:
        return model_cols, names
    have = b.frame_columns
    missing = [c for c in model_cols if c not in have]
    extra = [c for c in have if c not in model_cols]
    if missing or extra:
        raise ValueError(
            f"the batches' columns do not match the columns the model was fitted on; "
            f"missing: {missing}, not used by the model: {extra}."
        )
    if have != model_cols:
        order = [have.index(c) for c in model_cols]
        b.reference, b.current = b.reference[:, order], b.current[:, order]
        names = [names[j] for j in order]
        b.notes.append("columns were put in the order the model was fitted with")
    return model_cols, names


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
    model: object,
    reference: object,
    current: object,
    *,
    feature_names: Sequence[str] | None = None,
    options: DriftOptions | None = None,
    **kw: object,
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
    options : DriftOptions, optional
        All the options below in one value (:class:`DriftOptions`); each can also be given
        as a keyword (a keyword wins over ``options``). An unknown keyword raises
        ``TypeError`` listing the options.
    explainer : {"auto", "tree", "linear", "deep", "gradient", "kernel", "permutation"}
        shap explainer; ``"auto"`` picks by model kind (see :mod:`nbdebug.analysis.drift.explain`).
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
        (:func:`nbdebug.analysis.drift.explain.moved_direction`); ``"predicted"`` explains each
        row's predicted class.
    cluster_method : {"kmeans", "agglomerative"}
    n_permutations : "auto" or int
        Permutations for the cluster-share test (``"auto"``: enough to pass the correction).
    sampling_error : float
        Batches of more than 1,000 rows get SHAP values on a stratified subsample of
        ``ceil(ln(40) / (2 sampling_error^2))`` rows (82 by default); each SHAP column's
        distribution is then within ``sampling_error`` of the whole batch's at 95%
        confidence (:mod:`nbdebug.analysis.drift.sample`). Input tests use every row.
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
    opts = resolve(options, kw, "drift()")
    timings: dict[str, float] = {}
    t = time.perf_counter()
    b = prepare_batches(
        reference,
        current,
        feature_names=feature_names,
        one_hot=opts.inputs.one_hot,
        nan_policy=opts.inputs.nan_policy,
        categorical=takes_strings(model),
    )
    model_cols, names = _fit_to_model(model, b)
    xr, xc = b.reference, b.current
    adapter = adapt_model(model, xr.shape[1], b.categories or None)
    cols = model_cols or b.frame_columns or []
    categorical = {j: b.categories[c] for j, c in enumerate(cols) if c in b.categories}
    timings["validate"] = time.perf_counter() - t

    t = time.perf_counter()
    seed = opts.random_state
    pr, pc = predict_batches(adapter, xr, xc, seed)
    m = rows_for_error(float(opts.explain.sampling_error))
    ir = stratified_rows(_strata_score(pr), m, seed)
    ic = stratified_rows(_strata_score(pc), m, seed + 1)
    classes = adapter.classes
    cls_r = cls_c = None
    if classes is not None and pr.shape[1] == len(classes) and len(classes) >= 2:
        lookup = np.asarray(classes, dtype=object)
        cls_r, cls_c = lookup[pr.argmax(axis=1)], lookup[pc.argmax(axis=1)]
    timings["predict"] = time.perf_counter() - t

    t = time.perf_counter()
    sv = explain_batches(model, xr[ir], xc[ic], options=opts, adapter=adapter, predictions=(pr, pc))
    timings["shap"] = time.perf_counter() - t
    src = ShapSource(
        reference_rows=ir,
        current_rows=ic,
        classes_reference=cls_r,
        classes_current=cls_c,
        categorical=categorical,
        explainer=sv.explainer,
        output=sv.output,
        notes=b.notes + sv.notes,
        timings=timings,
    )
    arrays = {
        "reference": xr,
        "current": xc,
        "reference_shap": sv.reference,
        "current_shap": sv.current,
    }
    return statistics_on(arrays, names, src, opts)
