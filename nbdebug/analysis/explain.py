"""SHAP values of two batches with one of shap's explainers (never a home-made SHAP).

``explainer="auto"`` picks, by model kind:

* tree ensembles (scikit-learn trees and forests, gradient boosting, xgboost, lightgbm):
  ``shap.TreeExplainer`` with its path-dependent algorithm (exact, no background needed;
  the interventional variant is 5-10x slower);
* linear models (anything with ``coef_`` from ``sklearn.linear_model`` / ``sklearn.svm``):
  ``shap.LinearExplainer`` over ``background`` reference rows;
* torch modules taking a ``(n, d)`` tensor: ``shap.DeepExplainer`` (DeepLIFT) on a copy of
  the module when its layers are supported, checked on a few rows; else
  ``shap.GradientExplainer`` (expected gradients);
* a scikit-learn ``Pipeline`` whose final estimator is a tree or linear model: that
  estimator's exact explainer on the transformed columns, summed back per input column
  (:mod:`nbdebug.analysis.explain_pipeline`); a pipeline whose steps mix columns (PCA,
  polynomial features) goes to the kernel explainer, with a note;
* anything else (other estimators, plain prediction functions):
  ``shap.KernelExplainer`` over ``background`` reference rows, with shap's default
  number of coalition samples (``2 d + 2048``); it calls the model about
  ``n_rows x samples x background`` times, so pass a small ``background`` (20-50) for slow
  models. ``explainer="permutation"`` (``shap.PermutationExplainer``) is the alternative;
  its first use in a process compiles shap's numba kernels (8-18 s here).

The user's model is never changed: torch modules are copied (the copy is put in eval mode
and receives shap's hooks), the original is wrapped in :func:`nbdebug.core.state.preserved`
(train/eval flags, grads, hooks, RNG restored), and the global RNG states are restored for
every kind of model.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core.state import RngState, preserved
from .drift_data import model_frame
from .explain_pipeline import plan_pipeline

EXPLAINERS = ("auto", "tree", "linear", "deep", "gradient", "kernel", "permutation")
_TREE_MODULES = ("sklearn.ensemble", "sklearn.tree", "xgboost", "lightgbm", "catboost")
_LINEAR_MODULES = ("sklearn.linear_model", "sklearn.svm")


@dataclass
class ShapValues:
    """SHAP values of the two batches for one model output.

    Attributes
    ----------
    reference, current : numpy.ndarray
        float64, shapes ``(n_reference, d)`` and ``(n_current, d)``.
    explainer : str
        The shap explainer used, e.g. ``"TreeExplainer (path-dependent)"``.
    output : str
        Which model output is explained, e.g. ``"class 1 of predict_proba"``.
    background : int
        Reference rows used as background (0 when the explainer needs none).
    notes : list[str]
        Fallbacks taken (e.g. DeepExplainer not applicable, GradientExplainer used).
    """

    reference: np.ndarray
    current: np.ndarray
    explainer: str
    output: str
    background: int
    notes: list[str]


def _kind(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"


# ---------------------------------------------------------------------------- model adapter


@dataclass
class ModelAdapter:
    """One calling convention for the three model kinds.

    ``predict(X)`` takes a float64 ``(n, d)`` array and returns a float64 ``(n, k)`` array.
    """

    kind: str  # "sklearn" | "torch" | "function"
    model: Any
    predict: Callable[[np.ndarray], np.ndarray]
    output_name: str  # "predict_proba", "decision_function", "predict", "output"
    classes: list[Any] | None = None
    torch_copy: Any = None  # torch: the module shap works on (a copy when possible)
    torch_dtype: Any = None
    torch_device: Any = None
    categories: dict[str, list[Any]] | None = None  # string categories held as float codes

    def to_tensor(self, x: np.ndarray) -> Any:
        import torch

        return torch.as_tensor(x, dtype=self.torch_dtype, device=self.torch_device)


def _is_torch_module(model: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, torch.nn.Module)


def _is_estimator(model: Any) -> bool:
    return hasattr(model, "fit") and (hasattr(model, "predict") or hasattr(model, "predict_proba"))


class BadOutput(Exception):
    """Marks errors about what a model returned (as opposed to the model failing)."""


class BadOutputValue(BadOutput, ValueError):
    pass


class BadOutputType(BadOutput, TypeError):
    pass


def _as_2d(out: Any, n: int, what: str) -> np.ndarray:
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


class _TabularOutput:
    """Factory for a module wrapper that turns a ``(n,)`` output into ``(n, 1)``."""

    @staticmethod
    def wrap(module: Any) -> Any:
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


def adapt_model(
    model: Any, n_features: int, categories: dict[str, list[Any]] | None = None
) -> ModelAdapter:
    """Wrap ``model`` (scikit-learn estimator, torch module or prediction function).

    ``categories``: for an estimator fitted on a DataFrame, the columns whose float codes
    stand for string categories (:class:`~nbdebug.analysis.drift_data.Batches`); the
    model is called with the strings.

    Raises
    ------
    TypeError
        ``model`` is none of the three kinds.
    ValueError
        An unfitted estimator, or one fitted on a different number of features.
    """
    if _is_torch_module(model):
        import torch

        p = next((p for p in model.parameters() if p.is_floating_point()), None)
        dtype = p.dtype if p is not None else torch.get_default_dtype()
        device = p.device if p is not None else torch.device("cpu")
        try:
            work = copy.deepcopy(model)
        except Exception:  # e.g. a module holding a lock or a file handle
            work = None
        if work is not None:
            work.eval()
            for q in work.parameters():
                q.requires_grad_(False)
        wrapped = _TabularOutput.wrap(work if work is not None else model)

        def predict_torch(x: np.ndarray) -> np.ndarray:
            with torch.no_grad():
                if work is None:
                    model.eval()  # the caller holds preserved(model)
                out = wrapped(torch.as_tensor(x, dtype=dtype, device=device))
            return out.detach().to(device="cpu", dtype=torch.float64).numpy()

        return ModelAdapter(
            "torch",
            model,
            predict_torch,
            "output",
            None,
            wrapped if work is not None else None,
            dtype,
            device,
        )

    if _is_estimator(model):
        from sklearn.base import is_classifier
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

        classes = [
            c.item() if isinstance(c, np.generic) else c for c in getattr(model, "classes_", [])
        ]
        return ModelAdapter(
            "sklearn", model, predict_sklearn, method, classes or None, categories=categories
        )

    if hasattr(model, "fit") and not callable(model):
        raise TypeError(
            f"the model {type(model).__name__} has neither predict_proba nor predict; drift "
            "explains a model's predictions, so it needs one of them."
        )

    if callable(model):

        def predict_fn(x: np.ndarray) -> np.ndarray:
            return _as_2d(model(x), len(x), "the prediction function")

        return ModelAdapter("function", model, predict_fn, "output")

    raise TypeError(
        "model must be a fitted scikit-learn estimator, a torch.nn.Module taking a (n, d) tensor, "
        f"or a prediction function f(X) -> (n,) or (n, k); got {_kind(model)}."
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


# ---------------------------------------------------------------------------- explainers


def _exact_kind(model: Any) -> str | None:
    """``"tree"`` or ``"linear"`` when shap has an exact explainer for this estimator."""
    mod = type(model).__module__
    if mod.startswith(_TREE_MODULES):
        return "tree"
    if mod.startswith(_LINEAR_MODULES) and hasattr(model, "coef_"):
        return "linear"
    return None


def _choose(adapter: ModelAdapter, explainer: str) -> str:
    if explainer != "auto":
        return explainer
    if adapter.kind == "torch":
        return "deep"
    if adapter.kind == "sklearn":
        exact = _exact_kind(adapter.model)
        if exact is not None:
            return exact
    # KernelExplainer rather than PermutationExplainer: the latter spends 8-18 s compiling
    # shap's numba kernels in every new process
    return "kernel"


def _stack_outputs(v: Any) -> np.ndarray:
    """shap returns ``(n, d)``, ``(n, d, k)`` or (older versions) a list of ``(n, d)``."""
    if isinstance(v, list):
        v = np.stack([np.asarray(a) for a in v], axis=-1)
    return np.asarray(v, dtype=np.float64)


class _WrongKind(ValueError):
    """The explainer asked for does not apply to this kind of model."""


@dataclass
class _Built:
    name: str
    values: Callable[[np.ndarray], np.ndarray]  # (m, d) -> (m, d) or (m, d, k)
    chunk: int
    background: int


def _build(kind: str, adapter: ModelAdapter, bg: np.ndarray, d: int, random_state: int) -> _Built:
    import shap

    if kind == "tree":
        if adapter.kind != "sklearn":
            raise _WrongKind(
                f"explainer='tree' needs a tree-based estimator; got {_kind(adapter.model)}."
            )
        ex = shap.TreeExplainer(adapter.model)
        return _Built(
            "TreeExplainer (path-dependent)",
            lambda x: _stack_outputs(ex.shap_values(x, check_additivity=False)),
            2000,
            0,
        )
    if kind == "linear":
        if adapter.kind != "sklearn" or not hasattr(adapter.model, "coef_"):
            raise _WrongKind(
                f"explainer='linear' needs a linear estimator with coef_; got "
                f"{_kind(adapter.model)}."
            )
        lin = shap.LinearExplainer(adapter.model, shap.maskers.Independent(bg, max_samples=len(bg)))
        return _Built(
            "LinearExplainer", lambda x: _stack_outputs(lin.shap_values(x)), 100_000, len(bg)
        )
    if kind in ("deep", "gradient"):
        if adapter.kind != "torch":
            raise _WrongKind(
                f"explainer={kind!r} needs a torch.nn.Module; got {_kind(adapter.model)}."
            )
        if adapter.torch_copy is None:
            if kind == "deep":
                raise _WrongKind(
                    "explainer='deep' adds hooks and attributes to the module, so it "
                    "runs on a copy; "
                    "this model could not be copied with copy.deepcopy."
                )
            target = _TabularOutput.wrap(adapter.model)
        else:
            target = adapter.torch_copy
        bg_t = adapter.to_tensor(bg)
        if kind == "deep":
            deep = shap.DeepExplainer(target, bg_t)
            return _Built(
                "DeepExplainer (DeepLIFT)",
                lambda x: _stack_outputs(
                    deep.shap_values(adapter.to_tensor(x), check_additivity=True)
                ),
                64,
                len(bg),
            )
        grad = shap.GradientExplainer(target, bg_t)
        return _Built(
            "GradientExplainer (expected gradients)",
            lambda x: _stack_outputs(grad.shap_values(adapter.to_tensor(x), rseed=random_state)),
            32,
            len(bg),
        )
    if kind == "kernel":
        kex = shap.KernelExplainer(adapter.predict, bg)
        return _Built(
            "KernelExplainer (sampled)",
            lambda x: _stack_outputs(kex.shap_values(x, nsamples="auto", silent=True)),
            16,
            len(bg),
        )
    if kind == "permutation":
        pex = shap.PermutationExplainer(
            adapter.predict, shap.maskers.Independent(bg, max_samples=len(bg)), seed=random_state
        )
        evals = max(500, 2 * d + 1)
        return _Built(
            "PermutationExplainer",
            lambda x: _stack_outputs(pex(x, max_evals=evals, silent=True).values),
            16,
            len(bg),
        )
    raise ValueError(f"explainer must be one of {EXPLAINERS}; got {kind!r}.")  # pragma: no cover


def _build_pipeline(
    kind: str, adapter: ModelAdapter, bg: np.ndarray, d: int, random_state: int, notes: list[str]
) -> tuple[_Built, ModelAdapter] | None:
    """The final estimator's exact explainer, mapped back to the input columns; None (and
    a note) when the pipeline cannot be explained that way."""
    plan, why = plan_pipeline(adapter.model, d, adapter.categories)
    if plan is None:
        if why != "not a pipeline":
            notes.append(f"pipeline explained as a whole by KernelExplainer: {why}")
        return None
    exact = _exact_kind(plan.final)
    if exact is None or kind not in ("auto", exact):
        if kind == "auto":
            notes.append(
                f"pipeline explained as a whole by KernelExplainer: its final "
                f"{type(plan.final).__name__} has no exact shap explainer"
            )
        return None
    bg_z = plan.transform(bg)
    final = adapt_model(plan.final, bg_z.shape[1])
    inner = _build(exact, final, bg_z, bg_z.shape[1], random_state)

    def values(x: np.ndarray) -> np.ndarray:
        return plan.to_inputs(inner.values(plan.transform(x)))

    name = (
        f"{inner.name} of the pipeline's final {type(plan.final).__name__} "
        f"({bg_z.shape[1]} transformed columns summed into {d} inputs)"
    )
    return _Built(name, values, inner.chunk, inner.background), final


def _deep_works(built: _Built, x: np.ndarray) -> str | None:
    """Why DeepExplainer does not fit this module (None if it does), from a few rows."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            built.values(x[: min(4, len(x))])
        except Exception as e:  # additivity fails on unsupported operations
            first = str(e).split("!")[0].split(". ")[0].strip()[:120]
            return f"{type(e).__name__}: {first}"
    unknown = sorted({str(w.message) for w in caught if "unrecognized nn.Module" in str(w.message)})
    if unknown:
        return "; ".join(unknown)
    return None


@contextmanager
def _protected(adapter: ModelAdapter, random_state: int) -> Iterator[None]:
    """Restore the global RNG states (and, for torch, the module's state and the thread
    count) on exit; one BLAS / torch thread inside."""
    from threadpoolctl import threadpool_limits

    with ExitStack() as stack:
        if adapter.kind == "torch":
            import torch

            stack.enter_context(preserved(adapter.model))
            # shap's torch explainers run one small forward/backward per row: one thread is
            # up to 10x faster than several competing for busy cores
            threads = torch.get_num_threads()
            stack.callback(torch.set_num_threads, threads)
            torch.set_num_threads(1)
        stack.enter_context(threadpool_limits(limits=1))
        rng = RngState.capture()
        stack.callback(rng.restore)
        np.random.seed(random_state % (2**32))
        yield


def _scale(kind: str, adapter: ModelAdapter) -> str:
    """What the explained numbers are: probability, log-odds, raw output."""
    from sklearn.base import is_classifier

    if adapter.kind == "torch":
        return "module output"
    clf = adapter.kind == "sklearn" and is_classifier(adapter.model)
    if kind == "tree":
        name = type(adapter.model).__name__
        if clf:
            return (
                "probability"
                if name.startswith(("RandomForest", "ExtraTree", "DecisionTree"))
                else "raw tree output, log-odds"
            )
        return "prediction"
    if kind == "linear":
        return "log-odds" if clf else "prediction"
    return {"predict_proba": "probability", "decision_function": "decision function"}.get(
        adapter.output_name, "prediction"
    )


def _pick_output(
    values: np.ndarray, preds: np.ndarray, output: Any, adapter: ModelAdapter, scale: str
) -> tuple[np.ndarray, str]:
    """``(n, d)`` values of the chosen output, and its description."""
    classes = adapter.classes
    if values.ndim == 3 and values.shape[2] == 1:
        values = values[:, :, 0]
    if values.ndim == 2:
        binary = classes is not None and len(classes) == 2
        if not (output == "auto" or (binary and output in (1, -1))):
            raise ValueError(
                f"output={output!r} is not available: the explainer returned a single output."
            )
        label = f"class {classes[1]!r}" if binary and classes is not None else "the output"
        return values, f"{label} ({scale})"
    k = values.shape[2]

    def name(j: int) -> str:
        if classes is not None and len(classes) == k:
            return f"class {classes[j]!r}"
        return f"output {j}"

    if output == "auto":  # more than two: resolved by explain_batches (moved_output)
        output = 1 if k == 2 else "predicted"
    if output == "predicted":
        if preds.shape[1] != k:
            raise ValueError(
                f"output='predicted' needs one model output per explained output; the model gives "
                f"{preds.shape[1]}, the explainer {k}."
            )
        pick = preds.argmax(axis=1)
        return values[
            np.arange(len(values)), :, pick
        ], f"each row's predicted class, of {k} ({scale})"
    if isinstance(output, (int, np.integer)) and not isinstance(output, bool) and -k <= output < k:
        return values[:, :, int(output)], f"{name(int(output))} ({scale})"
    raise ValueError(
        f"output must be 'auto', 'predicted' or an output index in [0, {k}); got {output!r}."
    )


def moved_direction(reference_preds: np.ndarray, current_preds: np.ndarray) -> np.ndarray:
    """The default output to explain when a model has more than two: the sign of each
    output's mean change between the batches, float ``(k,)`` of -1, 0, +1.

    The explained output is then ``sum_c sign_c * output_c``: the outputs that went up
    minus those that went down. For a classifier's probabilities its mean shift is
    ``sum_c |mean change of p_c|``, the probability mass that moved between classes, and
    SHAP being linear in the output, each feature's SHAP value is the same signed sum of
    its per-class values, so exposure says which features moved that mass. Why not each
    row's predicted class: drift is about what changed, and the predicted class's SHAP
    values mix outputs of different signs and slopes that change when predictions flip
    (on wine with a logistic regression and two shifted features, their explanation drift
    was found in 0 of 6 runs that way). Why not the one class that moved most: a feature
    that moves probability between the two other classes is then invisible. The signs are
    chosen from the data; the no-drift rate with this choice is measured in
    ``benchmarks/bench_drift.py calibration`` (for a linear model it costs nothing: each
    SHAP column stays an affine map of its input, so its KS p-value is the input's).

    Parameters
    ----------
    reference_preds, current_preds : numpy.ndarray
        The model's outputs ``(n_reference, k)`` and ``(n_current, k)`` on every row.
    """
    delta = current_preds.mean(axis=0) - reference_preds.mean(axis=0)
    signs = np.sign(delta)
    if not signs.any():  # nothing moved: the first output
        signs[0] = 1.0
    return signs


def predict_batches(
    adapter: ModelAdapter, reference: np.ndarray, current: np.ndarray, random_state: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The model's outputs ``(n, k)`` on every row of both batches (the model's state and
    the RNG states left as they were)."""
    with _protected(adapter, random_state):
        check_model_runs(adapter, reference)
        return adapter.predict(reference), adapter.predict(current)


def check_explainer(explainer: Any, background: Any) -> None:
    """One ValueError sentence for an unknown ``explainer`` or a ``background`` that is not
    a positive number of rows (shared by :func:`explain_batches` and ``drift``)."""
    if explainer not in EXPLAINERS:
        raise ValueError(f"explainer must be one of {EXPLAINERS}; got {explainer!r}.")
    if (
        isinstance(background, bool)
        or not isinstance(background, (int, np.integer))
        or background < 1
    ):
        raise ValueError(
            f"background must be a positive number of reference rows; got {background!r}."
        )


def explain_batches(
    model: Any,
    reference: np.ndarray,
    current: np.ndarray,
    *,
    explainer: str = "auto",
    background: int = 100,
    output: Any = "auto",
    random_state: int = 0,
    progress: bool = True,
    adapter: ModelAdapter | None = None,
    predictions: tuple[np.ndarray, np.ndarray] | None = None,
) -> ShapValues:
    """SHAP values of both batches, for one output of ``model``.

    Parameters
    ----------
    model : scikit-learn estimator, torch.nn.Module or callable
        See :func:`adapt_model`.
    reference, current : numpy.ndarray
        float64, shapes ``(n_reference, d)``, ``(n_current, d)``. Not modified.
    explainer : {"auto", "tree", "linear", "deep", "gradient", "kernel", "permutation"}
    background : int
        Reference rows (sampled with ``random_state``) that stand for "feature absent".
    output : "auto", "predicted" or int
        The model output explained when there are several: ``"auto"`` is class 1 for two
        classes and, for more, the signed sum of the outputs by the sign of each one's
        mean change between the batches (:func:`moved_direction`); ``"predicted"``: each
        row's predicted class.
    progress : bool
        Show a ``tqdm`` bar (only when the stage takes longer than a second).
    adapter : ModelAdapter, optional
        ``adapt_model(model, d)`` when the caller already built it.
    predictions : (numpy.ndarray, numpy.ndarray), optional
        The model's outputs on every row of the two whole batches when ``reference`` and
        ``current`` are subsamples of them: ``"auto"`` then picks the output from these.

    Returns
    -------
    ShapValues
    """
    from tqdm.auto import tqdm

    check_explainer(explainer, background)
    d = reference.shape[1]
    if adapter is None:
        adapter = adapt_model(model, d)
    notes: list[str] = []
    with _protected(adapter, random_state):
        check_model_runs(adapter, reference)
        rng = np.random.default_rng(random_state)
        nb = min(int(background), len(reference))
        bg = reference[np.sort(rng.choice(len(reference), size=nb, replace=False))]
        kind = _choose(adapter, explainer)
        scale_adapter = adapter
        try:
            piped = (
                _build_pipeline(explainer, adapter, bg, d, random_state, notes)
                if adapter.kind == "sklearn" and explainer in ("auto", "tree", "linear")
                else None
            )
            if piped is not None:
                built, scale_adapter = piped
                kind = "linear" if built.name.startswith("Linear") else "tree"
            else:
                built = _build(kind, adapter, bg, d, random_state)
        except _WrongKind as e:
            # the user sees a ValueError: the private class only routes around the fallback
            raise ValueError(str(e)) from None
        except Exception as e:
            if explainer != "auto":
                raise ValueError(
                    f"explainer={kind!r} cannot explain {_kind(adapter.model)}; shap says: "
                    f"{type(e).__name__}: {str(e)[:200]}"
                ) from e
            notes.append(
                f"{kind} explainer not applicable ({type(e).__name__}); used KernelExplainer"
            )
            kind = "kernel"
            built = _build(kind, adapter, bg, d, random_state)
        if kind == "deep" and explainer == "auto":
            why = _deep_works(built, reference)
            if why is not None:
                notes.append(
                    f"DeepExplainer does not fit this module ({why}); used GradientExplainer"
                )
                kind = "gradient"
                built = _build(kind, adapter, bg, d, random_state)

        total = len(reference) + len(current)
        parts: dict[str, list[np.ndarray]] = {"reference": [], "current": []}
        with tqdm(
            total=total,
            desc=f"SHAP ({built.name.split(' ')[0]})",
            unit="row",
            delay=1.0,
            disable=not progress,
            leave=False,
        ) as bar:
            for which, x in (("reference", reference), ("current", current)):
                for s in range(0, len(x), built.chunk):
                    chunk = x[s : s + built.chunk]
                    try:
                        with warnings.catch_warnings():
                            # shap's own NumPy-2 deprecation notices are not the user's business
                            warnings.simplefilter("ignore", DeprecationWarning)
                            parts[which].append(built.values(chunk))
                    except Exception as e:
                        raise RuntimeError(
                            f"{built.name} failed on rows {s}-{s + len(chunk) - 1} of "
                            f"the {which} batch: "
                            f"{type(e).__name__}: {str(e)[:300]}"
                        ) from e
                    bar.update(len(chunk))
        vr = np.concatenate(parts["reference"], axis=0)
        vc = np.concatenate(parts["current"], axis=0)
        need_preds = (vr.ndim == 3 and vr.shape[2] > 2) or output == "predicted"
        pr = adapter.predict(reference) if need_preds else np.zeros((len(reference), 1))
        pc = adapter.predict(current) if need_preds else np.zeros((len(current), 1))
    if vr.shape[1] != d:
        raise RuntimeError(f"{built.name} returned {vr.shape[1]} columns for {d} features.")
    scale = _scale(kind, scale_adapter)
    if output == "auto" and vr.ndim == 3 and vr.shape[2] > 2 and pr.shape[1] == vr.shape[2]:
        full_r, full_c = predictions if predictions is not None else (pr, pc)
        signs = moved_direction(full_r, full_c)
        sr, sc = vr @ signs, vc @ signs
        k = vr.shape[2]
        names = [f"class {c!r}" for c in adapter.classes or []]
        if len(names) != k:
            names = [f"output {j}" for j in range(k)]
        up = [names[j] for j in range(k) if signs[j] > 0]
        down = [names[j] for j in range(k) if signs[j] < 0]
        desc = (
            f"the moved {adapter.output_name} mass: {' + '.join(up)}"
            + (f" - ({' + '.join(down)})" if down else "")
            + f", by the sign of each one's mean change ({scale})"
        )
        return ShapValues(sr, sc, built.name, desc, built.background, notes)
    sr, desc = _pick_output(vr, pr, output, adapter, scale)
    sc, _ = _pick_output(vc, pc, output, adapter, scale)
    return ShapValues(sr, sc, built.name, desc, built.background, notes)
