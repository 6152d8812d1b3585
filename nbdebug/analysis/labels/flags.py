"""Which samples :func:`nbdebug.find_label_issues` flags, and the label it suggests: the
confident-learning estimate of the noise, then the pruning rule of ``prune`` (or of
``method``) and, for the ensemble, the models' agreement."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import confident_learning as cl
from .options import LabelOptions


@dataclass
class NoiseEstimate:
    """The confident-learning estimate of the label noise."""

    counts: np.ndarray  # (K,) samples per given label
    thresholds: np.ndarray  # (K,) per-class thresholds
    cj: np.ndarray  # (K, K) confident joint
    calibrated: np.ndarray  # (K, K), sums to n
    joint: np.ndarray  # (K, K), sums to 1
    noise: np.ndarray  # (K, K) p(given | true)
    n_est: int  # estimated number of issues

    @property
    def unassessed(self) -> list[int]:
        """Classes with fewer than 2 samples: their samples are never flagged."""
        return [int(c) for c in np.flatnonzero((self.counts > 0) & (self.counts < 2))]


def estimate(pred_probs: np.ndarray, labels: np.ndarray) -> NoiseEstimate:
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
    return NoiseEstimate(counts, thresholds, cj, calibrated, joint, noise, n_est)


@dataclass
class Scores:
    """Per sample, computed once per call: ``p[given]`` ``(n,)``, the three most probable
    classes and their probabilities ``(n, 3)`` (:func:`~.confident_learning.top_k`), and the
    most probable class other than the given one with its probability ``(n,)``."""

    self_confidence: np.ndarray
    top_classes: np.ndarray
    top_probs: np.ndarray
    other_prob: np.ndarray
    other_class: np.ndarray


def scores(P: np.ndarray, y: np.ndarray) -> Scores:
    """The :class:`Scores` of probabilities ``P (n, K)`` and labels ``y (n,)``."""
    sc = np.take_along_axis(P, y[:, None], axis=1)[:, 0]
    top_cls, top_p = cl.top_k(P, 3)
    other_p, other_cls = cl.max_other(top_cls, top_p, y)
    return Scores(sc, top_cls, top_p, other_p, other_cls)


@dataclass
class Flags:
    """The flagged samples ``(n,)`` bool, the suggested label of each ``(n,)`` int64 (``-1``:
    none) and why the number flagged differs from the estimate."""

    flagged: np.ndarray
    suggested: np.ndarray
    note: str


def prune(
    P: np.ndarray, y: np.ndarray, est: NoiseEstimate, candidates: np.ndarray, opts: LabelOptions
) -> tuple[np.ndarray, str]:
    """The flags of ``opts.method`` / ``opts.prune`` among ``candidates`` (the samples the
    model predicts as another class), and the note on their number."""
    n_cand = int(candidates.sum())
    if opts.method == "predicted_neq_given":
        note = "predicted_neq_given flags every sample the model predicts as another class"
        return candidates, note
    if opts.prune == "threshold_margin":
        by_rate = cl.prune_by_noise_rate(P, y, est.calibrated, est.counts) & candidates
        n_take = min(int(by_rate.sum()), est.n_est)
        flagged = cl.prune_global(cl.threshold_margin(P, y, est.thresholds), candidates, n_take)
        note = (
            f"pruning by noise rate finds {n_take} of the estimated issues among the samples "
            "predicted as another class"
        )
        return flagged, note
    if opts.prune == "global":
        note = (
            f"only {n_cand} samples are predicted as another class than their label"
            if n_cand < est.n_est
            else ""
        )
        return cl.prune_global(P[np.arange(len(y)), y], candidates, est.n_est), note
    flagged = cl.prune_by_noise_rate(P, y, est.calibrated, est.counts) & candidates
    note = (
        "pruning by noise rate flags some samples for several classes and never flags a "
        "sample whose label is the model's prediction"
    )
    return flagged, note


def agreement(
    stack: np.ndarray, y: np.ndarray, tau: float, unassessed: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Where every model of the ensemble predicts the same class other than the given one
    with probability at least ``tau``: the mask ``(n,)`` and that class ``(n,)``."""
    rows = np.arange(len(y))
    votes = stack.argmax(axis=2)  # (M, n)
    c = votes[0]
    agreed = (votes == c).all(axis=0) & (c != y) & (stack[:, rows, c].min(axis=0) >= tau)
    if unassessed:
        agreed &= ~np.isin(y, unassessed)
    return agreed, c


def flags(
    P: np.ndarray,
    y: np.ndarray,
    est: NoiseEstimate,
    stack: np.ndarray | None,
    opts: LabelOptions,
    s: Scores,
) -> Flags:
    """Flags and suggestions; ``stack``: the ensemble's ``(M, n, K)`` probabilities, ``s``
    the :func:`scores` of ``P`` and ``y``."""
    unassessed = est.unassessed
    # the model's prediction: a given label tied for the top probability counts as it
    candidates = s.self_confidence < s.top_probs[:, 0]
    if unassessed:
        candidates &= ~np.isin(y, unassessed)
    flagged, note = prune(P, y, est, candidates, opts)
    suggested = s.other_class
    if opts.method == "ensemble":
        assert stack is not None
        agreed, c = agreement(stack, y, opts.tau, unassessed)
        n_before = int(flagged.sum())
        flagged = flagged | agreed
        if int(flagged.sum()) > n_before:
            note = (
                f"{int(flagged.sum()) - n_before} more samples flagged because every model "
                f"agrees on another class with probability >= {opts.tau}"
            )
        suggested = np.where(agreed, c, -1)
    return Flags(flagged, suggested, note)
