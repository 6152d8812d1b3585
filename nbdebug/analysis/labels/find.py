"""Find likely mislabeled samples: :func:`find_label_issues`.

Three methods, all working on out-of-fold predicted probabilities:

* ``"confident_learning"`` (default): per-class thresholds, the confident joint, its
  calibration into an estimated joint of given and true labels, and pruning by the
  estimated noise rate (:mod:`nbdebug.analysis.labels.confident_learning`); by default the number
  flagged comes from pruning by noise rate and the samples from the threshold-normalised
  margin (``prune="threshold_margin"``, chosen on ``benchmarks/bench_labels.py``);
* ``"predicted_neq_given"``: every sample whose most probable class is not its label;
* ``"ensemble"``: several models' out-of-fold probabilities; a corrected label is proposed
  only when every model predicts the same other class with probability at least ``tau``.

The result is a :class:`~nbdebug.analysis.labels.result.LabelIssues` table (a
:class:`pandas.DataFrame`), one row per sample, most suspicious first; the
estimates behind it (confident joint, noise matrix, estimated number of issues next to the
number flagged) are in ``df.attrs["label_noise"]``, also reachable as ``df.label_issues``
(a pandas accessor that the first :func:`find_label_issues` call registers).
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from . import confident_learning as cl
from .flags import Flags, NoiseEstimate, Scores, estimate, flags, scores
from .inputs import check_label_range, check_labels, warn_in_sample
from .options import LabelOptions
from .probabilities import probabilities
from .result import LabelIssues, LabelNoise, register_accessor


def _warn_unassessed(unassessed: list[int]) -> None:
    if unassessed:
        many = len(unassessed) > 1
        warnings.warn(
            f"class{'es' if many else ''} {unassessed} "
            f"ha{'ve' if many else 's'} fewer than 2 samples and cannot be "
            "assessed: their samples are never flagged.",
            UserWarning,
            stacklevel=3,
        )


def _warn_unlabelled(predicted: np.ndarray, counts: np.ndarray) -> None:
    """A class no sample is labelled with, while the model predicts it for some: confident
    learning sets a class's threshold from the samples labelled with it, so those samples
    can never be found mislabelled; say so rather than report a clean dataset."""
    hit = np.bincount(predicted, minlength=len(counts))
    empty = [int(c) for c in np.flatnonzero((counts == 0) & (hit > 0))]
    if empty:
        rows = int(hit[empty].sum())
        many = len(empty) > 1
        warnings.warn(
            f"class{'es' if many else ''} {empty} ha{'ve' if many else 's'} no sample "
            f"labelled with {'them' if many else 'it'}, but the model predicts "
            f"{'them' if many else 'it'} for {rows} sample{'s' if rows != 1 else ''}: "
            "confident learning takes a class's threshold from its labelled samples, so "
            "those samples cannot be flagged (their labels may be wrong: look at them).",
            UserWarning,
            stacklevel=3,
        )


def _table(P: np.ndarray, y: np.ndarray, f: Flags, opts: LabelOptions, s: Scores) -> LabelIssues:
    """One row per sample, flagged first, each part by quality ascending."""
    n, k = P.shape
    sc, top_cls, top_p = s.self_confidence, s.top_classes, s.top_probs
    margin = (sc - s.other_prob + 1.0) / 2.0
    picked = np.take_along_axis(P, np.maximum(f.suggested, 0)[:, None], axis=1)[:, 0]
    suggested_prob = np.where(f.suggested >= 0, picked, np.nan)
    quality = sc if opts.rank_by == "self_confidence" else margin
    # quality lies in [0, 1]
    order = cl.stable_argsort(np.where(f.flagged, quality - 2.0, quality))
    is_issue = f.flagged[order]
    meth = pd.Categorical.from_codes(
        is_issue.astype(np.int8), categories=pd.Index(["", opts.method])
    )
    columns = {
        "given_label": y,
        "suggested_label": f.suggested.astype(np.int64, copy=False),
        "suggested_prob": suggested_prob,
        "label_quality": quality,
        "self_confidence": sc,
        "normalized_margin": margin,
        "is_issue": None,
        "method": None,
        "top1": top_cls[:, 0],
        "top1_prob": top_p[:, 0],
        "top2": top_cls[:, 1],
        "top2_prob": top_p[:, 1],
        "top3": top_cls[:, 2] if k > 2 else np.full(n, -1),
        "top3_prob": top_p[:, 2] if k > 2 else np.full(n, np.nan),
    }
    done = {"is_issue": is_issue, "method": meth}
    return LabelIssues(
        {c: done[c] if v is None else np.take(v, order) for c, v in columns.items()},
        index=pd.Index(order, name="index"),
        copy=False,
    )


def _noise(est: NoiseEstimate, f: Flags, opts: LabelOptions, models: list[str]) -> LabelNoise:
    return LabelNoise(
        method=opts.method,
        n=len(f.flagged),
        class_counts=est.counts,
        thresholds=est.thresholds,
        confident_joint=est.cj,
        joint=est.joint,
        noise_matrix=est.noise,
        n_estimated=est.n_est,
        n_flagged=int(f.flagged.sum()),
        unassessed=est.unassessed,
        models=models,
        note=f.note,
    )


def find_label_issues(
    labels: object,
    *,
    pred_probs: object = None,
    X: object = None,
    model: object = None,
    options: LabelOptions | None = None,
    **kw: object,
) -> LabelIssues:
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
    options : LabelOptions, optional
        The options below in one value; each can also be given as a keyword (a keyword
        wins). An unknown keyword raises ``TypeError`` listing the options.
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
    LabelIssues
        A :class:`pandas.DataFrame` with ``summary()``, ``ok``, ``to_frame()`` and
        ``show()``. One row per sample, index = sample position (``"index"``), sorted with flagged
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
    opts = (options or LabelOptions()).with_keywords(kw, "find_label_issues()")
    y = check_labels(labels)
    probs = probabilities(y, pred_probs, X, model, opts)
    P = probs.P
    check_label_range(y, P.shape[1])
    s = scores(P, y)
    if probs.supplied:
        warn_in_sample(s.self_confidence, s.top_classes[:, 0], y)
    est = estimate(P, y)
    _warn_unassessed(est.unassessed)
    _warn_unlabelled(s.top_classes[:, 0], est.counts)
    f = flags(P, y, est, probs.stack, opts, s)
    df = _table(P, y, f, opts, s)
    df.attrs["label_noise"] = _noise(est, f, opts, probs.models)
    return df
