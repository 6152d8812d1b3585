"""One calling convention for the three kinds of model :func:`nbdebug.drift` explains: a
scikit-learn estimator, a torch module taking a ``(n, d)`` tensor, a prediction function.

The user's model is never changed: a torch module is copied (the copy is put in eval mode
and is what shap's hooks go on), an estimator is only called.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeGuard

import numpy as np

from ..tabular import loaded_torch, model_frame, type_name

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass
class ModelAdapter:
    """One calling convention for the three model kinds.

    ``predict(X)`` takes a float64 ``(n, d)`` array and returns a float64 ``(n, k)`` array.
    """

    kind: str  # "sklearn" | "torch" | "function"
    model: object
    predict: Callable[[np.ndarray], np.ndarray]
    output_name: str  # "predict_proba", "decision_function", "predict", "output"
    classes: list[object] | None = None
    torch_copy: torch.nn.Module | None = None  # torch: the module shap works on (a copy)
    torch_dtype: torch.dtype | None = None
    torch_device: torch.device | None = None
    categories: dict[str, list[object]] | None = None  # string categories held as float codes

    def to_tensor(self, x: np.ndarray) -> torch.Tensor:
        import torch

        return torch.as_tensor(x, dtype=self.torch_dtype, device=self.torch_device)


def is_torch_module(model: object) -> TypeGuard[torch.nn.Module]:
    torch = loaded_torch()
    return torch is not None and isinstance(model, torch.nn.Module)


def _is_estimator(model: object) -> bool:
    return hasattr(model, "fit") and (hasattr(model, "predict") or hasattr(model, "predict_proba"))


class BadOutput(Exception):
    """Marks errors about what a model returned (as opposed to the model failing)."""


class BadOutputValue(BadOutput, ValueError):
    pass


class BadOutputType(BadOutput, TypeError):
    pass


def _as_2d(out: object, n: int, what: str) -> np.ndarray:
    try:
        arr = np.asarray(out, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise BadOutputValue(
            f"{what} must return numbers; it returned {type(out).__qualname__}."
        ) from e
    if arr.ndim == 1:
        arr = arr[:, None]
    if arr.ndim != 2 or arr.shape[0] != n:
        raise BadOutputValue(
            f"{what} must return an array of shape (n,) or (n, k) for n={n} rows; got "
            f"shape {arr.shape}."
        )
    return arr


def tabular_output(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` wrapped so that a ``(n,)`` output becomes ``(n, 1)``."""
    import torch

    class TabularOutput(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.inner(x)
            if not isinstance(out, torch.Tensor):
                raise BadOutputType(
                    "a torch model for drift must return a tensor of shape (n,) or (n, k); "
                    f"it returned {type(out).__qualname__}."
                )
            return out.unsqueeze(1) if out.ndim == 1 else out

    return TabularOutput(module)


def _torch_adapter(model: torch.nn.Module) -> ModelAdapter:
    import torch

    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    dtype = p.dtype if p is not None else torch.get_default_dtype()
    device = p.device if p is not None else torch.device("cpu")
    try:
        work: torch.nn.Module | None = copy.deepcopy(model)
    except Exception:  # e.g. a module holding a lock or a file handle
        work = None
    if work is not None:
        work.eval()
        for q in work.parameters():
            q.requires_grad_(False)
    wrapped = tabular_output(work if work is not None else model)

    def predict_torch(x: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            if work is None:
                model.eval()  # the caller holds preserved(model)
            out = wrapped(torch.as_tensor(x, dtype=dtype, device=device))
        return out.detach().to(device="cpu", dtype=torch.float64).numpy()

    copy_ = wrapped if work is not None else None
    return ModelAdapter("torch", model, predict_torch, "output", None, copy_, dtype, device)


def _check_fitted(model: object, n_features: int) -> None:
    from sklearn.exceptions import NotFittedError
    from sklearn.utils.validation import check_is_fitted

    try:
        check_is_fitted(model)
    except NotFittedError as e:
        raise ValueError(
            f"the model {type(model).__name__} is not fitted; fit it before drift()."
        ) from e
    except TypeError:  # not a scikit-learn estimator: trust its predict
        pass
    n_in = getattr(model, "n_features_in_", None)
    if n_in is not None and int(n_in) != n_features:
        raise ValueError(
            f"the model {type(model).__name__} was fitted on {n_in} features but the batches "
            f"have {n_features} columns."
        )


def _estimator_adapter(
    model: object, n_features: int, categories: dict[str, list[object]] | None
) -> ModelAdapter:
    from sklearn.base import is_classifier

    _check_fitted(model, n_features)
    names_in = getattr(model, "feature_names_in_", None)
    columns = [str(c) for c in names_in] if names_in is not None else None
    if is_classifier(model) and hasattr(model, "predict_proba"):
        method = "predict_proba"
    elif hasattr(model, "decision_function"):
        method = "decision_function"
    else:
        method = "predict"
    fn = getattr(model, method)

    def predict_sklearn(x: np.ndarray) -> np.ndarray:
        frame = model_frame(x, columns, categories) if columns is not None else x
        return _as_2d(fn(frame), len(x), f"{type(model).__name__}.{method}")

    classes = [c.item() if isinstance(c, np.generic) else c for c in getattr(model, "classes_", [])]
    return ModelAdapter(
        "sklearn", model, predict_sklearn, method, classes or None, categories=categories
    )


def adapt_model(
    model: object, n_features: int, categories: dict[str, list[object]] | None = None
) -> ModelAdapter:
    """Wrap ``model`` (scikit-learn estimator, torch module or prediction function).

    ``categories``: for an estimator fitted on a DataFrame, the columns whose float codes
    stand for string categories (``Batches.categories`` of
    :func:`~nbdebug.analysis.drift.batches.prepare_batches`); the model is called with the
    strings.

    Raises
    ------
    TypeError
        ``model`` is none of the three kinds.
    ValueError
        An unfitted estimator, or one fitted on a different number of features.
    """
    if is_torch_module(model):
        return _torch_adapter(model)
    if _is_estimator(model):
        return _estimator_adapter(model, n_features, categories)
    if hasattr(model, "fit") and not callable(model):
        raise TypeError(
            f"the model {type(model).__name__} has neither predict_proba nor predict; drift "
            "explains a model's predictions, so it needs one of them."
        )
    if callable(model):
        fn = model

        def predict_fn(x: np.ndarray) -> np.ndarray:
            return _as_2d(fn(x), len(x), "the prediction function")

        return ModelAdapter("function", model, predict_fn, "output")
    raise TypeError(
        "model must be a fitted scikit-learn estimator, a torch.nn.Module taking a (n, d) tensor, "
        f"or a prediction function f(X) -> (n,) or (n, k); got {type_name(model)}."
    )


def check_model_runs(adapter: ModelAdapter, x: np.ndarray) -> int:
    """Call the model on two rows; return the number of outputs ``k``.

    Raises
    ------
    ValueError
        With the model's own error chained, when it cannot be called on the batch.
    """
    rows = x[: min(2, len(x))]
    try:
        out = adapter.predict(rows)
    except BadOutput:  # the model ran; what it returned is wrong: that message says it
        raise
    except Exception as e:
        raise ValueError(
            f"the model could not be called on {len(rows)} rows of the reference batch "
            f"(shape {rows.shape}, float): {type(e).__name__}: {e}"
        ) from e
    return int(out.shape[1])
