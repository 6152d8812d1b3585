"""Find likely mislabeled samples: :func:`find_label_issues`.

Three methods, all working on out-of-fold predicted probabilities:

* ``"confident_learning"`` (default): per-class thresholds, the confident joint, its
  calibration into an estimated joint of given and true labels, and pruning by the
  estimated noise rate (:mod:`nbdebug.analysis.confident_learning`); by default the number
  flagged comes from pruning by noise rate and the samples from the threshold-normalised
  margin (``prune="threshold_margin"``, chosen on ``benchmarks/bench_labels.py``);
* ``"predicted_neq_given"``: every sample whose most probable class is not its label;
* ``"ensemble"``: several models' out-of-fold probabilities; a corrected label is proposed
  only when every model predicts the same other class with probability at least ``tau``.

The result is a :class:`pandas.DataFrame`, one row per sample, most suspicious first; the
estimates behind it (confident joint, noise matrix, estimated number of issues next to the
number flagged) are in ``df.attrs["label_noise"]``, also reachable as ``df.label_issues``
(a pandas accessor that the first :func:`find_label_issues` call registers).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from . import confident_learning as cl
from .label_inputs import (
    check_label_range,
    check_labels,
    check_nonnegative_labels,
    check_pred_probs,
    describe_input,
    to_numpy,
    warn_in_sample,
)
from .oof import default_ensemble, default_model, model_name, out_of_fold_probs, wrap_model

METHODS = ("confident_learning", "predicted_neq_given", "ensemble")
RANK_BY = ("self_confidence", "normalized_margin")
PRUNE = ("threshold_margin", "global", "noise_rate")


@dataclass(eq=False)
class LabelNoise:
    """What :func:`find_label_issues` estimated about the label noise.

    Attributes
    ----------
    method : str
    n : int
        Number of samples.
    class_counts : ndarray, shape (K,), int64
        Samples per given label.
    thresholds : ndarray, shape (K,), float64
        Per-class confidence thresholds ``t_j`` (``inf`` for a class without samples).
    confident_joint : ndarray, shape (K, K), int64
        ``C[given, true]``: samples labelled ``given`` confidently predicted ``true``.
    joint : ndarray, shape (K, K), float64
        Calibrated estimate of ``p(given, true)``; sums to 1.
    noise_matrix : ndarray, shape (K, K), float64
        ``p(given | true)``; columns sum to 1 (a column without mass is the identity).
    n_estimated : int
        Estimated number of label issues, ``round(n * (1 - trace(joint)))``.
    n_flagged : int
        Number of samples flagged by ``method``.
    unassessed : list of int
        Classes with fewer than 2 samples: their samples are never flagged.
    models : list of str
        Names of the models whose probabilities were used (empty when supplied).
    note : str
        Why ``n_flagged`` differs from ``n_estimated`` (when it does).
    """

    method: str
    n: int
    class_counts: np.ndarray
    thresholds: np.ndarray
    confident_joint: np.ndarray
    joint: np.ndarray
    noise_matrix: np.ndarray
    n_estimated: int
    n_flagged: int
    unassessed: list[int] = field(default_factory=list)
    models: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def n_classes(self) -> int:
        return len(self.class_counts)

    @property
    def noise_rate(self) -> float:
        """Estimated fraction of wrong labels."""
        return float(1.0 - np.trace(self.joint))

    def summary(self) -> str:
        """One sentence: flagged next to estimated, and why they differ when they do."""
        why = f" ({self.note})" if self.note and self.n_flagged != self.n_estimated else ""
        return (
            f"{self.method}: {self.n_flagged} of {self.n} samples flagged; confident learning "
            f"estimates {self.n_estimated} label issues (noise rate {self.noise_rate:.1%}){why}."
        )

    def to_frame(self) -> pd.DataFrame:
        """The confident joint as a table (rows: given label, columns: estimated true label)."""
        k = self.n_classes
        return pd.DataFrame(
            self.confident_joint,
            index=pd.Index(range(k), name="given"),
            columns=pd.Index(range(k), name="true"),
        )

    def __repr__(self) -> str:
        return (
            f"LabelNoise(method={self.method!r}, n={self.n}, n_classes={self.n_classes}, "
            f"n_flagged={self.n_flagged}, n_estimated={self.n_estimated}, "
            f"noise_rate={self.noise_rate:.3f})"
        )


class _LabelIssuesAccessor:
    """``df.label_issues``: the :class:`LabelNoise` behind a :func:`find_label_issues` frame."""

    def __init__(self, df: pd.DataFrame):
        est = df.attrs.get("label_noise")
        if not isinstance(est, LabelNoise):
            raise AttributeError(
                "this DataFrame carries no label-noise estimate: expected the result of "
                "nbdebug.find_label_issues (df.attrs['label_noise'])."
            )
        self._est = est

    def __getattr__(self, name: str) -> Any:
        return getattr(self._est, name)

    def __repr__(self) -> str:
        return repr(self._est)


def register_accessor() -> None:
    """Make ``df.label_issues`` available on pandas DataFrames (once; later calls do
    nothing). :func:`find_label_issues` calls it: importing this module registers nothing."""
    if not hasattr(pd.DataFrame, "label_issues"):
        pd.api.extensions.register_dataframe_accessor("label_issues")(_LabelIssuesAccessor)


# --------------------------------------------------------------------------- the estimate


def _estimate(pred_probs: np.ndarray, labels: np.ndarray) -> dict[str, Any]:
    k = pred_probs.shape[1]
    counts = cl.class_counts(labels, k)
    thresholds = cl.per_class_thresholds(pred_probs, labels, counts)
    assigned = cl.confident_assignment(pred_probs, thresholds, labels)
    cj = cl.confident_joint(labels, assigned, k)
    calibrated = cl.calibrate(cj, counts)
    joint = calibrated / calibrated.sum()
    col = joint.sum(axis=0)
    noise = np.eye(k)
    has = col > 0
    noise[:, has] = joint[:, has] / col[has]
    n_est = int(np.rint(calibrated.sum() - np.trace(calibrated)))
    return {
        "counts": counts,
        "thresholds": thresholds,
        "cj": cj,
        "calibrated": calibrated,
        "joint": joint,
        "noise": noise,
        "n_est": n_est,
    }


def find_label_issues(
    labels: Any,
    *,
    pred_probs: Any = None,
    X: Any = None,
    model: Any = None,
    cv: int = 5,
    method: str = "confident_learning",
    random_state: int = 0,
    tau: float = 0.5,
    rank_by: str = "self_confidence",
    prune: str = "threshold_margin",
) -> pd.DataFrame:
    """Rank the samples by how likely their label is wrong.

    Parameters
    ----------
    labels : array-like of int, shape (n,)
        Given labels in ``0..K-1`` (numpy, list, pandas Series or torch tensor).
    pred_probs : array-like, shape (n, K), or a list of them for ``method="ensemble"``
        Out-of-fold predicted probabilities. When omitted they are computed from ``X``
        and ``model`` with ``cross_val_predict``.
    X : array-like, shape (n, ...), optional
        Features, used when ``pred_probs`` is None.
    model : scikit-learn classifier or torch.nn.Module, or a list of them for ``"ensemble"``
        Cloned (scikit-learn) or copied and re-initialised (torch) for each fold; the
        object passed is not changed. Default: standardised logistic regression (a list of
        three diverse models for the ensemble).
    cv : int
        Number of stratified folds.
    method : {"confident_learning", "predicted_neq_given", "ensemble"}
    random_state : int
        Seed of the folds and of the default models.
    tau : float in (0, 1)
        ``"ensemble"`` only: a corrected label is proposed only when every model predicts
        the same class other than the given one with probability at least ``tau``.
    rank_by : {"self_confidence", "normalized_margin"}
        Which score is ``label_quality``.
    prune : {"threshold_margin", "global", "noise_rate"}
        How confident learning turns the estimated joint into flags. ``"noise_rate"`` is
        the paper's prune-by-noise-rate: for each off-diagonal ``(i, j)``,
        ``round(n * Q[i, j])`` samples labelled ``i`` with the largest margin
        ``p_j - p_i``. ``"threshold_margin"`` (default) flags as many samples as pruning by
        noise rate does (at most the estimate ``round(n * (1 - trace(Q)))``), but chooses
        them over all classes by the threshold-normalised margin
        ``p_i / t_i - max_{j != i} p_j / t_j`` (lowest first): the per-class thresholds
        ``t`` put classes the model is sure of and classes it is not on one scale, and the
        budget is not tied to one class's estimate. ``"global"`` flags the estimated
        number with the lowest self-confidence. On every bundled scikit-learn set plus
        ``make_classification``, uniform and class-conditional noise at 5-40 %, three
        seeds and three models, ``"threshold_margin"`` is never below cleanlab 2.9's
        defaults in mean F1 per dataset (same probabilities) and is the best option on
        four of the five (wine: 0.848 against ``"global"``'s 0.850); ``"global"`` wins on
        uniform noise but loses on class-conditional noise, ``"noise_rate"`` is close to
        cleanlab everywhere (``benchmarks/bench_labels.py``).
        Samples whose given label is the model's prediction are never flagged (a given
        label tied for the top probability counts as the prediction).

    Notes
    -----
    ``method="ensemble"`` averages the models' probabilities, flags with confident
    learning on the average plus every sample the models agree to correct, and proposes a
    corrected label only where they agree (elsewhere ``suggested_label`` is ``-1`` and
    ``suggested_prob`` NaN: the reviewer decides).

    Returns
    -------
    pandas.DataFrame
        One row per sample, index = sample position (``"index"``), sorted with flagged
        samples first, then by ``label_quality`` ascending. Columns: ``given_label``,
        ``suggested_label`` (the most probable other class, or the agreed class for the
        ensemble), ``suggested_prob``, ``label_quality`` (low = suspicious),
        ``self_confidence`` (``p[given]``), ``normalized_margin``
        (``(p[given] - max_other + 1) / 2``), ``is_issue``, ``method`` (the method that
        flagged the sample, ``""`` when not flagged), ``top1``/``top1_prob`` ..
        ``top3``/``top3_prob``. ``df.attrs["label_noise"]`` (also ``df.label_issues``) is
        a :class:`LabelNoise` with the confident joint, the noise matrix and the estimated
        number of issues next to the number flagged.

    Raises
    ------
    ValueError, TypeError
        Labels outside ``0..K-1``, lengths that differ, non-finite or negative
        probabilities, an unknown method, missing inputs.
    """
    register_accessor()  # df.label_issues, on first use (no import-time side effect)
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}; got {method!r}.")
    if prune not in PRUNE:
        raise ValueError(f"prune must be one of {PRUNE}; got {prune!r}.")
    if rank_by not in RANK_BY:
        raise ValueError(f"rank_by must be one of {RANK_BY}; got {rank_by!r}.")
    if not (isinstance(tau, (int, float)) and 0.0 < float(tau) < 1.0):
        raise ValueError(f"tau must be a probability in (0, 1); got {tau!r}.")
    y = check_labels(labels)
    n = len(y)
    supplied = pred_probs is not None
    model_names: list[str] = []

    # ---- probabilities: one array (n, K), or a stack (M, n, K) for the ensemble
    if method == "ensemble":
        if supplied:
            if isinstance(pred_probs, (list, tuple)):
                stack_in = list(pred_probs)
            else:
                arr = to_numpy(pred_probs)
                if arr.ndim != 3:
                    raise ValueError(
                        "method='ensemble' needs several models' probabilities: a list of "
                        "(n, K) arrays or an array (n_models, n, K); got "
                        f"{describe_input(pred_probs)}."
                    )
                stack_in = list(arr)
            if len(stack_in) < 2:
                raise ValueError(
                    f"method='ensemble' needs at least 2 models' probabilities; got "
                    f"{len(stack_in)}."
                )
            probs_list = [
                check_pred_probs(p, n, name=f"pred_probs[{m}]") for m, p in enumerate(stack_in)
            ]
            shapes = {p.shape for p in probs_list}
            if len(shapes) > 1:
                raise ValueError(
                    f"every model's pred_probs must have the same shape; got {sorted(shapes)}."
                )
            model_names = [f"model {m}" for m in range(len(probs_list))]
        else:
            if X is None:
                raise ValueError(
                    "method='ensemble' needs pred_probs (a list of out-of-fold probabilities) "
                    "or X with model=[classifiers]; got neither."
                )
            models = default_ensemble(random_state) if model is None else model
            if not isinstance(models, (list, tuple)) or len(models) < 2:
                raise ValueError(
                    "method='ensemble' needs model= a list of at least 2 classifiers; got "
                    f"{type(models).__qualname__}."
                )
            check_nonnegative_labels(y)
            probs_list = [
                check_pred_probs(out_of_fold_probs(X, y, m, cv=cv, random_state=random_state), n)
                for m in models
            ]
            model_names = [model_name(wrap_model(m, random_state)) for m in models]
        stack = np.stack(probs_list)
        P = stack.mean(axis=0)
    else:
        if supplied:
            if (
                isinstance(pred_probs, (list, tuple))
                and len(pred_probs) > 0
                and np.ndim(pred_probs[0]) == 2
            ):
                raise ValueError(
                    f"a list of {len(pred_probs)} probability arrays is for method='ensemble'; "
                    f"method={method!r} takes one (n, K) array."
                )
            P = check_pred_probs(pred_probs, n)
        elif X is not None:
            check_nonnegative_labels(y)
            P = check_pred_probs(
                out_of_fold_probs(
                    X,
                    y,
                    default_model(random_state) if model is None else model,
                    cv=cv,
                    random_state=random_state,
                ),
                n,
            )
            model_names = (
                [model_name(wrap_model(model, random_state))]
                if model is not None
                else ["LogisticRegression"]
            )
        else:
            raise ValueError(
                "find_label_issues needs pred_probs= (out-of-fold probabilities, shape (n, K)) "
                "or X= features to compute them; got neither."
            )
        stack = None
    k = P.shape[1]
    check_label_range(y, k)

    # ---- scores
    rows = np.arange(n)
    sc = P[rows, y]
    top_cls, top_p = cl.top_k(P, 3)
    other, other_cls = cl.max_other(top_cls, top_p, y)
    margin = (sc - other + 1.0) / 2.0
    pred = top_cls[:, 0]
    if supplied:
        warn_in_sample(sc, pred, y)

    est = _estimate(P, y)
    counts = est["counts"]
    unassessed = [int(c) for c in np.flatnonzero((counts > 0) & (counts < 2))]
    if unassessed:
        warnings.warn(
            f"class{'es' if len(unassessed) > 1 else ''} {unassessed} "
            f"ha{'ve' if len(unassessed) > 1 else 's'} fewer than 2 samples and cannot be "
            "assessed: their samples are never flagged.",
            UserWarning,
            stacklevel=2,
        )

    # ---- flags and suggestions
    suggested = other_cls
    # the model's prediction: a given label tied for the top probability counts as it
    candidates = sc < top_p[:, 0]
    if unassessed:
        candidates &= ~np.isin(y, unassessed)
    n_cand = int(candidates.sum())
    if method == "predicted_neq_given":
        flagged = candidates
        note = "predicted_neq_given flags every sample the model predicts as another class"
    elif prune == "threshold_margin":
        by_rate = cl.prune_by_noise_rate(P, y, est["calibrated"], counts) & candidates
        n_take = min(int(by_rate.sum()), est["n_est"])
        flagged = cl.prune_global(cl.threshold_margin(P, y, est["thresholds"]), candidates, n_take)
        note = (
            f"pruning by noise rate finds {n_take} of the estimated issues among the samples "
            "predicted as another class"
        )
    elif prune == "global":
        note = (
            f"only {n_cand} samples are predicted as another class than their label"
            if n_cand < est["n_est"]
            else ""
        )
        flagged = cl.prune_global(sc, candidates, est["n_est"])
    else:
        flagged = cl.prune_by_noise_rate(P, y, est["calibrated"], counts) & candidates
        note = (
            "pruning by noise rate flags some samples for several classes and never flags a "
            "sample whose label is the model's prediction"
        )
    if method == "ensemble":
        assert stack is not None
        votes = stack.argmax(axis=2)  # (M, n)
        c = votes[0]
        agreed = (votes == c).all(axis=0) & (c != y) & (stack[:, rows, c].min(axis=0) >= tau)
        if unassessed:
            agreed &= ~np.isin(y, unassessed)
        n_before = int(flagged.sum())
        flagged |= agreed
        if int(flagged.sum()) > n_before:
            note = (
                f"{int(flagged.sum()) - n_before} more samples flagged because every model "
                f"agrees on another class with probability >= {tau}"
            )
        suggested = np.where(agreed, c, -1)
    suggested_prob = np.where(suggested >= 0, P[rows, np.maximum(suggested, 0)], np.nan)

    quality = sc if rank_by == "self_confidence" else margin
    # flagged first, each part by quality ascending (quality lies in [0, 1])
    order = np.argsort(np.where(flagged, quality - 2.0, quality), kind="stable")
    meth = pd.Categorical.from_codes(
        flagged[order].astype(np.int8), categories=pd.Index(["", method])
    )
    top3 = top_cls[:, 2] if k > 2 else np.full(n, -1)
    top3_p = top_p[:, 2] if k > 2 else np.full(n, np.nan)
    columns = {
        "given_label": y,
        "suggested_label": suggested.astype(np.int64),
        "suggested_prob": suggested_prob,
        "label_quality": quality,
        "self_confidence": sc,
        "normalized_margin": margin,
        "is_issue": flagged,
        "method": None,
        "top1": top_cls[:, 0],
        "top1_prob": top_p[:, 0],
        "top2": top_cls[:, 1],
        "top2_prob": top_p[:, 1],
        "top3": top3,
        "top3_prob": top3_p,
    }
    df = pd.DataFrame(
        {c: (meth if v is None else np.take(v, order)) for c, v in columns.items()},
        index=pd.Index(order, name="index"),
        copy=False,
    )
    df.attrs["label_noise"] = LabelNoise(
        method=method,
        n=n,
        class_counts=counts,
        thresholds=est["thresholds"],
        confident_joint=est["cj"],
        joint=est["joint"],
        noise_matrix=est["noise"],
        n_estimated=est["n_est"],
        n_flagged=int(flagged.sum()),
        unassessed=unassessed,
        models=model_names,
        note=note,
    )
    return df


__all__ = ["METHODS", "LabelNoise", "find_label_issues"]
