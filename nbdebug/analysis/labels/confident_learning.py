"""Confident learning, vectorised in numpy.

Written from the definitions in Northcutt, Jiang & Chuang, "Confident Learning: Estimating
Uncertainty in Dataset Labels" (JAIR 2021):

* per-class thresholds ``t_j``: the mean predicted probability of class ``j`` over the
  examples *labelled* ``j``;
* the confident joint ``C[i, j]``: examples labelled ``i`` whose probability of ``j`` reaches
  ``t_j`` (the most probable such ``j`` when several do);
* calibration: each row of ``C`` rescaled to the number of examples labelled ``i``, the
  whole divided by ``n``, gives the joint ``Q[i, j] ~ p(given=i, true=j)``;
* prune by noise rate: for every off-diagonal ``(i, j)``, the ``round(n * Q[i, j])``
  examples labelled ``i`` with the largest margin ``p_j - p_i`` are label issues.

:func:`threshold_margin` carries the thresholds over from counting to ranking: an example
is as suspicious as the most confident other class is, measured in units of that class's
threshold (``p_j / t_j``), against its own label's (``p_i / t_i``), the comparison the
confident joint makes when it assigns an example to a column.

Every function takes ``pred_probs`` of shape ``(n, K)`` (float) and ``labels`` of shape
``(n,)`` (int64, values in ``0..K-1``), already validated.
"""

from __future__ import annotations

import numpy as np


def class_counts(labels: np.ndarray, n_classes: int) -> np.ndarray:
    """Number of examples per given label, shape ``(K,)`` int64."""
    return np.bincount(labels, minlength=n_classes).astype(np.int64)


def self_confidence(pred_probs: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``p[given]`` per example, shape ``(n,)``."""
    return pred_probs[np.arange(len(labels)), labels]


def max_other(
    top_classes: np.ndarray, top_probs: np.ndarray, labels: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The largest probability among the classes other than the given one, and that class,
    from the two most probable classes of :func:`top_k`.

    Returns
    -------
    (values, classes) : float array ``(n,)`` and int64 array ``(n,)``
    """
    first_is_given = top_classes[:, 0] == labels
    cls = np.where(first_is_given, top_classes[:, 1], top_classes[:, 0])
    return np.where(first_is_given, top_probs[:, 1], top_probs[:, 0]), cls


def per_class_thresholds(
    pred_probs: np.ndarray, labels: np.ndarray, counts: np.ndarray
) -> np.ndarray:
    """``t_j`` = mean of ``p_j`` over the examples labelled ``j``; ``inf`` for an empty class."""
    k = pred_probs.shape[1]
    sums = np.bincount(labels, weights=self_confidence(pred_probs, labels), minlength=k)
    with np.errstate(invalid="ignore", divide="ignore"):
        t = sums / counts
    t[counts == 0] = np.inf
    return t


def confident_assignment(
    pred_probs: np.ndarray, thresholds: np.ndarray, labels: np.ndarray | None = None
) -> np.ndarray:
    """For each example, the most probable class among those reaching their threshold,
    or ``-1`` when none does; with ``labels``, the given label where it ties for the most
    probable (a tie is no evidence against it). Shape ``(n,)`` int64."""
    # a small tolerance so that an example exactly at the mean counts; probabilities are
    # >= 0, so a class below its threshold scores -1 and a row whose best score is -1 has
    # no class above (a given label below its threshold ties only in such a row)
    scored = np.where(pred_probs >= thresholds[None, :] - 1e-9, pred_probs, -1.0)
    best = scored.argmax(axis=1)
    top = np.take_along_axis(scored, best[:, None], axis=1)[:, 0]
    if labels is not None:
        tied = np.take_along_axis(scored, labels[:, None], axis=1)[:, 0] >= top
        best[tied] = labels[tied]
    best[top < 0.0] = -1
    return best


def confident_joint(labels: np.ndarray, assigned: np.ndarray, n_classes: int) -> np.ndarray:
    """Counts ``C[given, confidently-assigned]``, shape ``(K, K)`` int64."""
    ok = assigned >= 0
    flat = labels[ok] * n_classes + assigned[ok]
    return np.bincount(flat, minlength=n_classes * n_classes).reshape(n_classes, n_classes)


def calibrate(cj: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Rows of the confident joint rescaled to the class counts (sums to ``n``).

    A class whose examples were all below every threshold gets its count on the diagonal
    (no evidence of noise).
    """
    cj = cj.astype(np.float64)
    row = cj.sum(axis=1)
    out = np.zeros_like(cj)
    has = row > 0
    out[has] = cj[has] / row[has, None] * counts[has, None]
    empty = np.flatnonzero(~has)
    out[empty, empty] = counts[empty]
    return out


def prune_by_noise_rate(
    pred_probs: np.ndarray,
    labels: np.ndarray,
    calibrated: np.ndarray,
    counts: np.ndarray,
    *,
    min_keep: int = 1,
) -> np.ndarray:
    """Boolean mask ``(n,)`` of label issues found by pruning by noise rate.

    For each off-diagonal ``(i, j)`` the ``round(calibrated[i, j])`` examples labelled ``i``
    with the largest margin ``p_j - p_i`` are flagged; at least ``min_keep`` examples of each
    class are never flagged.
    """
    n = pred_probs.shape[0]
    to_remove = np.rint(calibrated).astype(np.int64)
    np.fill_diagonal(to_remove, 0)
    flagged = np.zeros(n, dtype=bool)
    order = group_order(labels, len(counts))
    starts = np.concatenate(([0], np.cumsum(counts)))
    for i in np.flatnonzero(to_remove.sum(axis=1) > 0):
        rows = order[starts[i] : starts[i + 1]]
        budget = max(len(rows) - min_keep, 0)
        if budget == 0:
            continue
        p_rows = np.take(pred_probs, rows, axis=0)  # faster than pred_probs[rows]
        margins = p_rows - p_rows[:, i : i + 1]
        hit = np.zeros(len(rows), dtype=bool)
        for j in np.flatnonzero(to_remove[i]):
            m = min(int(to_remove[i, j]), budget)
            if m <= 0:
                continue
            col = margins[:, j]
            top = np.argpartition(-col, m - 1)[:m] if m < len(rows) else np.arange(len(rows))
            hit[top] = True
        if hit.sum() > budget:  # keep the least suspicious ones (smallest max margin)
            mm = np.where(hit, margins.max(axis=1), -np.inf)
            keep = stable_argsort(mm)[: len(rows) - budget]
            hit[keep] = False
        flagged[rows[hit]] = True
    return flagged


def threshold_margin(
    pred_probs: np.ndarray, labels: np.ndarray, thresholds: np.ndarray
) -> np.ndarray:
    """``p_i / t_i - max_{j != i} p_j / t_j`` per example, ``i`` its given label; shape ``(n,)``.

    Negative when some other class is more confident, relative to its threshold, than the
    given label is to its own: the per-class thresholds of the confident joint put the
    probabilities of classes the model is more or less sure of on one scale. A class
    without examples (``t = inf``) contributes 0; a threshold of 0 is taken as the smallest
    positive float.
    """
    t = np.maximum(thresholds, np.finfo(np.float64).tiny)
    scaled = pred_probs / t[None, :]
    rows = np.arange(len(labels))
    own = scaled[rows, labels]
    scaled[rows, labels] = -np.inf
    # the largest value, found by argmax (faster than max on short rows)
    return own - np.take_along_axis(scaled, scaled.argmax(axis=1)[:, None], axis=1)[:, 0]


def top_k(pred_probs: np.ndarray, k: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` most probable classes per example, most probable first.

    Returns
    -------
    (classes, probs) : int64 ``(n, k)`` and float ``(n, k)``
    """
    n, n_classes = pred_probs.shape
    k = min(k, n_classes)
    if k < n_classes:
        part = np.argpartition(pred_probs, n_classes - k, axis=1)[:, n_classes - k :]
    else:
        part = np.broadcast_to(np.arange(n_classes), (n, n_classes)).copy()
    vals = np.take_along_axis(pred_probs, part, axis=1)
    o = np.argsort(-vals, axis=1, kind="stable")
    return np.take_along_axis(part, o, axis=1).astype(np.int64), np.take_along_axis(vals, o, axis=1)


def stable_argsort(keys: np.ndarray) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` for 1-D keys without NaN, faster: the (vectorised)
    default sort, then equal keys put back in index order."""
    order = np.argsort(keys)
    s = keys[order]
    new_run = s[1:] != s[:-1]
    if new_run.all():
        return order
    run = np.concatenate(([0], np.cumsum(new_run)))
    return np.sort(run * len(keys) + order) % len(keys)


def group_order(labels: np.ndarray, n_classes: int) -> np.ndarray:
    """``np.argsort(labels, kind="stable")`` for labels in ``0..n_classes-1``: the sample
    positions grouped by label, each group in index order (a radix sort on small ints)."""
    small = np.int16 if n_classes <= np.iinfo(np.int16).max else np.int64
    return np.argsort(labels.astype(small, copy=False), kind="stable")


def prune_global(scores: np.ndarray, candidates: np.ndarray, n_remove: int) -> np.ndarray:
    """Boolean mask ``(n,)``: the ``n_remove`` candidates with the lowest ``scores``.

    With ``candidates`` the samples whose most probable class is not their label and
    ``n_remove`` a number of issues (the calibrated estimate ``n * (1 - trace(Q))``, or the
    number pruning by noise rate finds), this prunes with one ranking over all classes
    instead of one per (given, true) pair; ``scores`` is the self-confidence or
    :func:`threshold_margin`.
    """
    flagged = np.zeros(len(scores), dtype=bool)
    idx = np.flatnonzero(candidates)
    if n_remove <= 0 or len(idx) == 0:
        return flagged
    if n_remove < len(idx):
        idx = idx[np.argpartition(scores[idx], n_remove - 1)[:n_remove]]
    flagged[idx] = True
    return flagged
