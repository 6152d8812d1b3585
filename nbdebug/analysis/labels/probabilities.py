"""The predicted probabilities :func:`nbdebug.find_label_issues` works on: supplied, or
out of fold from ``X`` and a model; one ``(n, K)`` array, or a stack ``(M, n, K)`` of
several models' for ``method="ensemble"``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..tabular import describe_input, to_numpy
from .inputs import check_nonnegative_labels, check_pred_probs
from .oof import default_ensemble, default_model, model_name, out_of_fold_probs, wrap_model
from .options import LabelOptions


@dataclass
class Probabilities:
    """``P (n, K)`` (the models' mean for the ensemble), the stack ``(M, n, K)`` of the
    ensemble's models (None otherwise), whether they were supplied, and the models' names."""

    P: np.ndarray
    stack: np.ndarray | None
    supplied: bool
    models: list[str]


def _supplied_stack(pred_probs: object, n: int) -> list[np.ndarray]:
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
            f"method='ensemble' needs at least 2 models' probabilities; got {len(stack_in)}."
        )
    probs = [check_pred_probs(p, n, name=f"pred_probs[{m}]") for m, p in enumerate(stack_in)]
    shapes = {p.shape for p in probs}
    if len(shapes) > 1:
        raise ValueError(
            f"every model's pred_probs must have the same shape; got {sorted(shapes)}."
        )
    return probs


def _ensemble(
    y: np.ndarray, pred_probs: object, X: object, model: object, opts: LabelOptions
) -> Probabilities:
    n = len(y)
    if pred_probs is not None:
        probs = _supplied_stack(pred_probs, n)
        names = [f"model {m}" for m in range(len(probs))]
    else:
        if X is None:
            raise ValueError(
                "method='ensemble' needs pred_probs (a list of out-of-fold probabilities) "
                "or X with model=[classifiers]; got neither."
            )
        models = default_ensemble(opts.random_state) if model is None else model
        if not isinstance(models, (list, tuple)) or len(models) < 2:
            raise ValueError(
                "method='ensemble' needs model= a list of at least 2 classifiers; got "
                f"{type(models).__qualname__}."
            )
        check_nonnegative_labels(y)
        probs = [
            check_pred_probs(
                out_of_fold_probs(X, y, m, cv=opts.cv, random_state=opts.random_state), n
            )
            for m in models
        ]
        names = [model_name(wrap_model(m, opts.random_state)) for m in models]
    stack = np.stack(probs)
    return Probabilities(stack.mean(axis=0), stack, pred_probs is not None, names)


def _single(
    y: np.ndarray, pred_probs: object, X: object, model: object, opts: LabelOptions
) -> Probabilities:
    n = len(y)
    if pred_probs is not None:
        if (
            isinstance(pred_probs, (list, tuple))
            and len(pred_probs) > 0
            and np.ndim(pred_probs[0]) == 2
        ):
            raise ValueError(
                f"a list of {len(pred_probs)} probability arrays is for method='ensemble'; "
                f"method={opts.method!r} takes one (n, K) array."
            )
        return Probabilities(check_pred_probs(pred_probs, n), None, True, [])
    if X is None:
        raise ValueError(
            "find_label_issues needs pred_probs= (out-of-fold probabilities, shape (n, K)) "
            "or X= features to compute them; got neither."
        )
    check_nonnegative_labels(y)
    est = default_model(opts.random_state) if model is None else model
    P = check_pred_probs(
        out_of_fold_probs(X, y, est, cv=opts.cv, random_state=opts.random_state), n
    )
    names = (
        [model_name(wrap_model(model, opts.random_state))]
        if model is not None
        else ["LogisticRegression"]
    )
    return Probabilities(P, None, False, names)


def probabilities(
    y: np.ndarray, pred_probs: object, X: object, model: object, opts: LabelOptions
) -> Probabilities:
    """The probabilities of ``opts.method`` (see :func:`nbdebug.find_label_issues` for
    ``pred_probs``, ``X`` and ``model``)."""
    if opts.method == "ensemble":
        return _ensemble(y, pred_probs, X, model, opts)
    return _single(y, pred_probs, X, model, opts)
