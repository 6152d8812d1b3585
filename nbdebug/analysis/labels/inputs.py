"""Validation of the inputs of :func:`nbdebug.find_label_issues` and the label cleaner.

Every function returns fresh arrays (the caller's objects are never modified) and raises
one clear sentence naming what was expected and what was given.
"""

from __future__ import annotations

import warnings

import numpy as np

from ...core.text import count_text
from ..tabular import describe_input, to_numpy

# mean self-confidence above which supplied probabilities look in-sample
IN_SAMPLE_CONFIDENCE = 0.98


def check_labels(labels: object) -> np.ndarray:
    """Labels as a fresh int64 array of shape ``(n,)``; raises on anything else."""
    if labels is None:
        raise TypeError("labels must be a 1-D sequence of integer class indices; got None.")
    arr = to_numpy(labels)
    if arr.ndim != 1:
        raise ValueError(
            f"labels must be 1-D (one integer class per sample); got {describe_input(labels)}."
        )
    if len(arr) == 0:
        raise ValueError("labels is empty: expected one integer class per sample.")
    if arr.dtype == bool or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise TypeError(
            f"labels must be integer class indices 0..K-1; got dtype {arr.dtype} "
            "(map class names to integers first, e.g. with sklearn.preprocessing.LabelEncoder)."
        )
    if np.issubdtype(arr.dtype, np.floating):
        bad = ~np.isfinite(arr) | (arr != np.round(arr))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"labels must be integer class indices 0..K-1; sample {i} has label "
                f"{arr[i].item()!r}."
            )
    return arr.astype(np.int64, copy=True)


def check_pred_probs(
    pred_probs: object, n: int | None = None, *, name: str = "pred_probs"
) -> np.ndarray:
    """Probabilities as a float64 array ``(n, K)`` whose rows sum to 1.

    Rows that do not sum to 1 are normalised with a warning; NaN, inf or negative entries
    are refused. The caller's array is never modified.
    """
    arr = to_numpy(pred_probs)
    if arr.ndim != 2:
        raise ValueError(
            f"{name} must be 2-D, shape (n_samples, n_classes); got {describe_input(pred_probs)}."
        )
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"{name} must hold numbers; got dtype {arr.dtype}.")
    if arr.shape[1] < 2:
        raise ValueError(f"{name} must have at least 2 class columns; got shape {arr.shape}.")
    if n is not None and arr.shape[0] != n:
        raise ValueError(
            f"{name} has {arr.shape[0]} rows but there are {n} labels: expected one row of "
            "class probabilities per label."
        )
    # read-only from here on: the caller's array is used as is unless it must be converted
    arr = np.asarray(arr, dtype=np.float64)
    sums = arr.sum(axis=1)
    if not np.isfinite(sums).all():  # a NaN or inf anywhere makes its row's sum non-finite
        finite = np.isfinite(arr)
        i = int(np.flatnonzero(~finite.all(axis=1))[0])
        raise ValueError(
            f"{name} must be finite; row {i} holds {arr[i][~finite[i]][0]} "
            f"({count_text(int((~finite).any(axis=1).sum()), 'such row')})."
        )
    if arr.min() < 0:
        i = int(np.flatnonzero((arr < 0).any(axis=1))[0])
        raise ValueError(
            f"{name} must be non-negative probabilities; row {i} holds {arr[i].min():.4g} "
            "(pass probabilities, e.g. softmax of the logits, not the logits)."
        )
    if (sums <= 0).any():
        i = int(np.flatnonzero(sums <= 0)[0])
        raise ValueError(f"{name} row {i} is all zeros: expected probabilities summing to 1.")
    dev = np.abs(sums - 1.0)
    off = dev > 1e-3
    if off.any():
        i = int(np.flatnonzero(off)[0])
        warnings.warn(
            f"{name}: {int(off.sum())} rows do not sum to 1 (row {i} sums to {sums[i]:.4g}); "
            "they were normalised.",
            UserWarning,
            stacklevel=3,
        )
    if dev.max() > 1e-12:
        arr = arr / sums[:, None]  # a new array: the caller's is never written to
    return arr


def check_label_range(labels: np.ndarray, k: int) -> None:
    bad = (labels < 0) | (labels >= k)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"labels must lie in 0..{k - 1} (the {k} probability columns); sample {i} has "
            f"label {labels[i]} ({int(bad.sum())} out of range)."
        )


def check_nonnegative_labels(labels: np.ndarray) -> None:
    if labels.min() < 0:
        i = int(np.argmin(labels))
        raise ValueError(f"labels must be class indices 0..K-1; sample {i} has label {labels[i]}.")


def warn_in_sample(sc: np.ndarray, pred: np.ndarray, labels: np.ndarray) -> None:
    mean_sc = float(sc.mean())
    if mean_sc >= IN_SAMPLE_CONFIDENCE and float((pred != labels).mean()) < 0.005:
        warnings.warn(
            f"pred_probs look in-sample: mean self-confidence {mean_sc:.3f} and the model "
            "agrees with almost every label. Label noise can only be found with out-of-fold "
            "probabilities (sklearn.model_selection.cross_val_predict, or pass X= and model=).",
            UserWarning,
            stacklevel=3,
        )
