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
  (:mod:`nbdebug.analysis.drift.pipeline`); a pipeline whose steps mix columns (PCA,
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

import warnings
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import numpy as np

from ...core.state import RngState, preserved
from ..tabular import type_name
from .explainers import (
    Built,
    Setting,
    WrongKind,
    build_explainer,
    build_pipeline_explainer,
    choose_kind,
    deep_fails,
    output_scale,
)
from .models import ModelAdapter, adapt_model, check_model_runs, is_torch_module
from .options import DriftOptions, Output, resolve


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


@contextmanager
def protected(adapter: ModelAdapter, random_state: int) -> Iterator[None]:
    """Restore the global RNG states (and, for torch, the module's state and the thread
    count) on exit; one BLAS / torch thread inside."""
    from threadpoolctl import threadpool_limits

    with ExitStack() as stack:
        if adapter.kind == "torch":
            import torch

            assert is_torch_module(adapter.model)
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


def _pick_output(
    values: np.ndarray, preds: np.ndarray, output: Output, adapter: ModelAdapter, scale: str
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
    with protected(adapter, random_state):
        check_model_runs(adapter, reference)
        return adapter.predict(reference), adapter.predict(current)


def _explainer(
    explainer: str, s: Setting, reference: np.ndarray, notes: list[str]
) -> tuple[Built, str, ModelAdapter]:
    """The explainer built for ``explainer`` (falling back where ``"auto"`` allows), its
    kind, and the adapter whose output it explains (a pipeline's final estimator)."""
    adapter = s.adapter
    kind = choose_kind(adapter, explainer)
    try:
        piped = (
            build_pipeline_explainer(explainer, s, notes)
            if adapter.kind == "sklearn" and explainer in ("auto", "tree", "linear")
            else None
        )
        if piped is not None:
            built, final = piped
            return built, "linear" if built.name.startswith("Linear") else "tree", final
        built = build_explainer(kind, s)
    except WrongKind as e:
        # the user sees a ValueError: the subclass only routes around the fallback
        raise ValueError(str(e)) from None
    except Exception as e:
        if explainer != "auto":
            raise ValueError(
                f"explainer={kind!r} cannot explain {type_name(adapter.model)}; shap says: "
                f"{type(e).__name__}: {str(e)[:200]}"
            ) from e
        notes.append(f"{kind} explainer not applicable ({type(e).__name__}); used KernelExplainer")
        kind = "kernel"
        built = build_explainer(kind, s)
    if kind == "deep" and explainer == "auto":
        why = deep_fails(built, reference)
        if why is not None:
            notes.append(f"DeepExplainer does not fit this module ({why}); used GradientExplainer")
            kind = "gradient"
            built = build_explainer(kind, s)
    return built, kind, adapter


def _shap_rows(
    built: Built, reference: np.ndarray, current: np.ndarray, progress: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The explainer's values on both batches, ``built.chunk`` rows at a time."""
    from tqdm.auto import tqdm

    parts: dict[str, list[np.ndarray]] = {"reference": [], "current": []}
    with tqdm(
        total=len(reference) + len(current),
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
    return np.concatenate(parts["reference"], axis=0), np.concatenate(parts["current"], axis=0)


def _moved_mass(
    values: tuple[np.ndarray, np.ndarray],
    signs: np.ndarray,
    adapter: ModelAdapter,
    scale: str,
) -> tuple[np.ndarray, np.ndarray, str]:
    """The SHAP values of the signed sum of the outputs (:func:`moved_direction`) and its
    description."""
    vr, vc = values
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
    return vr @ signs, vc @ signs, desc


def explain_batches(
    model: object,
    reference: np.ndarray,
    current: np.ndarray,
    *,
    options: DriftOptions | None = None,
    adapter: ModelAdapter | None = None,
    predictions: tuple[np.ndarray, np.ndarray] | None = None,
    **kw: object,
) -> ShapValues:
    """SHAP values of both batches, for one output of ``model``.

    Parameters
    ----------
    model : scikit-learn estimator, torch.nn.Module or callable
        See :func:`~nbdebug.analysis.drift.models.adapt_model`.
    reference, current : numpy.ndarray
        float64, shapes ``(n_reference, d)``, ``(n_current, d)``. Not modified.
    options : DriftOptions, optional
        Of these only ``explainer``, ``background``, ``output``, ``random_state`` and
        ``progress`` are read; each may also be given as a keyword (``output=1``):
    explainer : {"auto", "tree", "linear", "deep", "gradient", "kernel", "permutation"}
    background : int
        Reference rows (sampled with ``random_state``) that stand for "feature absent".
    output : "auto", "predicted" or int
        The model output explained when there are several: ``"auto"`` is class 1 for two
        classes and, for more, the signed sum of the outputs by the sign of each one's
        mean change between the batches (:func:`moved_direction`); ``"predicted"``: each
        row's predicted class.
    random_state : int
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
    opts = resolve(options, kw, "explain_batches()")
    explainer, output = opts.explain.explainer, opts.explain.output
    d = reference.shape[1]
    if adapter is None:
        adapter = adapt_model(model, d)
    notes: list[str] = []
    with protected(adapter, opts.random_state):
        check_model_runs(adapter, reference)
        rng = np.random.default_rng(opts.random_state)
        nb = min(int(opts.explain.background), len(reference))
        bg = reference[np.sort(rng.choice(len(reference), size=nb, replace=False))]
        setting = Setting(adapter, bg, d, opts.random_state)
        built, kind, scale_adapter = _explainer(explainer, setting, reference, notes)
        vr, vc = _shap_rows(built, reference, current, opts.progress)
        need_preds = (vr.ndim == 3 and vr.shape[2] > 2) or output == "predicted"
        pr = adapter.predict(reference) if need_preds else np.zeros((len(reference), 1))
        pc = adapter.predict(current) if need_preds else np.zeros((len(current), 1))
    if vr.shape[1] != d:
        raise RuntimeError(f"{built.name} returned {vr.shape[1]} columns for {d} features.")
    scale = output_scale(kind, scale_adapter)
    if output == "auto" and vr.ndim == 3 and vr.shape[2] > 2 and pr.shape[1] == vr.shape[2]:
        full_r, full_c = predictions if predictions is not None else (pr, pc)
        sr, sc, desc = _moved_mass((vr, vc), moved_direction(full_r, full_c), adapter, scale)
        return ShapValues(sr, sc, built.name, desc, built.background, notes)
    sr, desc = _pick_output(vr, pr, output, adapter, scale)
    sc, _ = _pick_output(vc, pc, output, adapter, scale)
    return ShapValues(sr, sc, built.name, desc, built.background, notes)
