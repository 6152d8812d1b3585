"""Out-of-fold predicted probabilities for :func:`nbdebug.find_label_issues`."""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from ..tabular import describe_counts, loaded_torch, nonfinite_counts


def default_model(random_state: int) -> object:
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))


def wrap_model(model: object, random_state: int) -> object:
    torch = loaded_torch()
    if torch is not None and isinstance(model, torch.nn.Module):
        from .torch_classifier import TorchClassifier

        return TorchClassifier(model, random_state=random_state)
    if not (hasattr(model, "fit") and hasattr(model, "predict_proba")):
        raise TypeError(
            "model must be a scikit-learn classifier with fit and predict_proba, or a "
            f"torch.nn.Module; got {type(model).__qualname__}."
        )
    return model


def model_name(model: object) -> str:
    inner = getattr(model, "module", None)
    if inner is not None and type(model).__name__ == "TorchClassifier":
        return f"torch {type(inner).__name__}"
    steps = getattr(model, "steps", None)
    if steps:
        return type(steps[-1][1]).__name__
    return type(model).__name__


def out_of_fold_probs(
    X: object, labels: np.ndarray, model: object, *, cv: int = 5, random_state: int = 0
) -> np.ndarray:
    """Out-of-fold probabilities ``(n, K)`` from ``cross_val_predict`` with stratified folds.

    ``model`` is cloned per fold by scikit-learn (the one passed is not fitted); a torch
    module is wrapped in :class:`~nbdebug.analysis.labels.torch_classifier.TorchClassifier`.
    """
    from sklearn.model_selection import StratifiedKFold, cross_val_predict

    if not isinstance(cv, (int, np.integer)) or isinstance(cv, bool) or cv < 2:
        raise ValueError(f"cv must be an integer number of folds >= 2; got {cv!r}.")
    Xa = X
    torch = loaded_torch()
    if torch is not None and isinstance(X, torch.Tensor):
        Xa = X.detach().cpu().numpy()
    shape = getattr(Xa, "shape", None)
    n_x = shape[0] if shape is not None else len(Xa)  # type: ignore[arg-type]
    if n_x != len(labels):
        raise ValueError(
            f"X has {n_x} rows but there are {len(labels)} labels: expected one row per label."
        )
    est = wrap_model(model, random_state)
    if type(est).__name__ != "TorchClassifier":
        _check_shape(Xa)
    counts = np.bincount(labels)
    present = counts[counts > 0]
    if present.max() < cv:
        raise ValueError(
            f"cv={cv} folds need at least {cv} samples in some class; the largest class has "
            f"{present.max()}."
        )
    folds = StratifiedKFold(n_splits=int(cv), shuffle=True, random_state=random_state)
    with warnings.catch_warnings():
        # small classes: reported once, clearly, by find_label_issues
        warnings.filterwarnings("ignore", message=".*least populated class.*")
        warnings.filterwarnings("ignore", message=".*Number of classes in training fold.*")
        try:
            probs = cross_val_predict(est, Xa, labels, cv=folds, method="predict_proba")
        except ValueError as e:
            bad = _nonfinite_features(Xa)
            if bad is None:
                raise
            # the model does not take NaN (some do: HistGradientBoosting, an imputer first)
            raise ValueError(
                f"X holds {bad}: expected finite features for {model_name(est)}; impute or "
                "drop them first, or use a model that takes NaN."
            ) from e
    # columns follow the classes present in labels; a class absent from labels gets zeros
    classes = np.unique(labels)
    full = np.zeros((len(labels), int(labels.max()) + 1), dtype=np.float64)
    full[:, classes] = probs
    return full


def _check_shape(X: object) -> None:
    """A scikit-learn model's features are 2-D (one sentence instead of its own message)."""
    shape = getattr(X, "shape", None)
    if shape is not None and len(shape) > 2:
        raise ValueError(
            f"X has shape {tuple(shape)}: a scikit-learn model (the default one included) "
            "takes 2-D features (samples, features); pass X.reshape(len(X), -1), or a torch "
            "model for shaped inputs."
        )


def _nonfinite_features(X: object) -> str | None:
    """How many NaN/inf values X's numeric columns hold, and where; None when none."""
    if isinstance(X, pd.DataFrame):  # its numeric columns
        num = X.select_dtypes(include="number")
        names, values = [str(c) for c in num.columns], num.to_numpy(dtype=np.float64)
    else:
        arr = np.asarray(X)
        if arr.dtype.kind not in "fiub" or arr.ndim != 2:
            return None
        names, values = [f"column {j}" for j in range(arr.shape[1])], arr.astype(np.float64)
    counts = nonfinite_counts(values, names)
    if not counts:
        return None
    total = sum(counts.values())
    return f"{total} NaN/inf values in {len(counts)} feature column(s) ({describe_counts(counts)})"


def default_ensemble(random_state: int) -> list[object]:
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    return [
        default_model(random_state),
        RandomForestClassifier(n_estimators=200, random_state=random_state),
        make_pipeline(StandardScaler(), KNeighborsClassifier(n_neighbors=10)),
    ]
