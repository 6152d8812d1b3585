"""shap's explainers, one builder per kind (never a home-made SHAP), and the choice of kind.

``explainer="auto"`` picks by model kind: tree ensembles get ``shap.TreeExplainer``
(path-dependent, exact), linear models ``shap.LinearExplainer``, torch modules
``shap.DeepExplainer`` (or ``shap.GradientExplainer`` when DeepLIFT does not fit), a
``Pipeline`` its final estimator's exact explainer (:mod:`nbdebug.analysis.drift.pipeline`),
anything else ``shap.KernelExplainer``. See :mod:`nbdebug.analysis.drift.explain`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..tabular import type_name
from .models import ModelAdapter, adapt_model, tabular_output
from .pipeline import plan_pipeline

TREE_MODULES = ("sklearn.ensemble", "sklearn.tree", "xgboost", "lightgbm", "catboost")
LINEAR_MODULES = ("sklearn.linear_model", "sklearn.svm")


class WrongKind(ValueError):
    """The explainer asked for does not apply to this kind of model."""


@dataclass
class Built:
    """A ready explainer: ``values`` maps ``(m, d)`` rows to ``(m, d)`` or ``(m, d, k)``
    SHAP values, ``chunk`` rows at a time, over ``background`` background rows."""

    name: str
    values: Callable[[np.ndarray], np.ndarray]
    chunk: int
    background: int


@dataclass(frozen=True)
class Setting:
    """What every builder reads: the model, the background rows, the seed."""

    adapter: ModelAdapter
    bg: np.ndarray
    d: int
    random_state: int


def exact_kind(model: object) -> str | None:
    """``"tree"`` or ``"linear"`` when shap has an exact explainer for this estimator."""
    mod = type(model).__module__
    if mod.startswith(TREE_MODULES):
        return "tree"
    if mod.startswith(LINEAR_MODULES) and hasattr(model, "coef_"):
        return "linear"
    return None


def choose_kind(adapter: ModelAdapter, explainer: str) -> str:
    if explainer != "auto":
        return explainer
    if adapter.kind == "torch":
        return "deep"
    if adapter.kind == "sklearn":
        exact = exact_kind(adapter.model)
        if exact is not None:
            return exact
    # KernelExplainer rather than PermutationExplainer: the latter spends 8-18 s compiling
    # shap's numba kernels in every new process
    return "kernel"


def stack_outputs(v: object) -> np.ndarray:
    """shap returns ``(n, d)``, ``(n, d, k)`` or (older versions) a list of ``(n, d)``."""
    if isinstance(v, list):
        v = np.stack([np.asarray(a) for a in v], axis=-1)
    return np.asarray(v, dtype=np.float64)


def _tree(s: Setting) -> Built:
    import shap

    if s.adapter.kind != "sklearn":
        raise WrongKind(
            f"explainer='tree' needs a tree-based estimator; got {type_name(s.adapter.model)}."
        )
    ex = shap.TreeExplainer(s.adapter.model)
    return Built(
        "TreeExplainer (path-dependent)",
        lambda x: stack_outputs(ex.shap_values(x, check_additivity=False)),
        2000,
        0,
    )


def _linear(s: Setting) -> Built:
    import shap

    if s.adapter.kind != "sklearn" or not hasattr(s.adapter.model, "coef_"):
        raise WrongKind(
            f"explainer='linear' needs a linear estimator with coef_; got "
            f"{type_name(s.adapter.model)}."
        )
    masker = shap.maskers.Independent(s.bg, max_samples=len(s.bg))
    lin = shap.LinearExplainer(s.adapter.model, masker)
    return Built("LinearExplainer", lambda x: stack_outputs(lin.shap_values(x)), 100_000, len(s.bg))


def _torch_target(s: Setting, kind: str) -> object:
    """The module shap's torch explainers work on: the adapter's copy when there is one."""
    a = s.adapter
    if a.kind != "torch":
        raise WrongKind(f"explainer={kind!r} needs a torch.nn.Module; got {type_name(a.model)}.")
    if a.torch_copy is not None:
        return a.torch_copy
    if kind == "deep":
        raise WrongKind(
            "explainer='deep' adds hooks and attributes to the module, so it runs on a copy; "
            "this model could not be copied with copy.deepcopy."
        )
    import torch

    assert isinstance(a.model, torch.nn.Module)
    return tabular_output(a.model)


def _deep(s: Setting) -> Built:
    import shap

    deep = shap.DeepExplainer(_torch_target(s, "deep"), s.adapter.to_tensor(s.bg))
    return Built(
        "DeepExplainer (DeepLIFT)",
        lambda x: stack_outputs(deep.shap_values(s.adapter.to_tensor(x), check_additivity=True)),
        64,
        len(s.bg),
    )


def _gradient(s: Setting) -> Built:
    import shap

    grad = shap.GradientExplainer(_torch_target(s, "gradient"), s.adapter.to_tensor(s.bg))
    return Built(
        "GradientExplainer (expected gradients)",
        lambda x: stack_outputs(grad.shap_values(s.adapter.to_tensor(x), rseed=s.random_state)),
        32,
        len(s.bg),
    )


def _kernel(s: Setting) -> Built:
    import shap

    kex = shap.KernelExplainer(s.adapter.predict, s.bg)
    return Built(
        "KernelExplainer (sampled)",
        lambda x: stack_outputs(kex.shap_values(x, nsamples="auto", silent=True)),
        16,
        len(s.bg),
    )


def _permutation(s: Setting) -> Built:
    import shap

    masker = shap.maskers.Independent(s.bg, max_samples=len(s.bg))
    pex = shap.PermutationExplainer(s.adapter.predict, masker, seed=s.random_state)
    evals = max(500, 2 * s.d + 1)
    return Built(
        "PermutationExplainer",
        lambda x: stack_outputs(pex(x, max_evals=evals, silent=True).values),
        16,
        len(s.bg),
    )


BUILDERS: dict[str, Callable[[Setting], Built]] = {
    "tree": _tree,
    "linear": _linear,
    "deep": _deep,
    "gradient": _gradient,
    "kernel": _kernel,
    "permutation": _permutation,
}


def build_explainer(kind: str, s: Setting) -> Built:
    """The explainer of ``kind`` for the model of ``s``.

    Raises
    ------
    WrongKind
        ``kind`` does not apply to this kind of model.
    """
    return BUILDERS[kind](s)


def build_pipeline_explainer(
    kind: str, s: Setting, notes: list[str]
) -> tuple[Built, ModelAdapter] | None:
    """The final estimator's exact explainer, mapped back to the input columns; None (and
    a note) when the pipeline cannot be explained that way."""
    plan, why = plan_pipeline(s.adapter.model, s.d, s.adapter.categories)
    if plan is None:
        if why != "not a pipeline":
            notes.append(f"pipeline explained as a whole by KernelExplainer: {why}")
        return None
    exact = exact_kind(plan.final)
    if exact is None or kind not in ("auto", exact):
        if kind == "auto":
            notes.append(
                f"pipeline explained as a whole by KernelExplainer: its final "
                f"{type(plan.final).__name__} has no exact shap explainer"
            )
        return None
    bg_z = plan.transform(s.bg)
    final = adapt_model(plan.final, bg_z.shape[1])
    inner = build_explainer(exact, Setting(final, bg_z, bg_z.shape[1], s.random_state))

    def values(x: np.ndarray) -> np.ndarray:
        return plan.to_inputs(inner.values(plan.transform(x)))

    name = (
        f"{inner.name} of the pipeline's final {type(plan.final).__name__} "
        f"({bg_z.shape[1]} transformed columns summed into {s.d} inputs)"
    )
    return Built(name, values, inner.chunk, inner.background), final


def deep_fails(built: Built, x: np.ndarray) -> str | None:
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


def output_scale(kind: str, adapter: ModelAdapter) -> str:
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
