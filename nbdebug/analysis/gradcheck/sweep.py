"""The module sweep: :func:`gradcheck_modules` checks every leaf module (and every module
with its own parameters) on the activations that reach it for the first batch rows."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

from ...core.batch import batch_size, call_model, check_inputs, check_model
from ...core.options import options_from
from ...core.state import RngState, preserved
from ...core.stats import count_nonfinite
from ...core.text import first_line
from ...core.trace.capture import clone_structure
from ...core.trace.hooks import HookSet, hookable_named_modules
from .inputs import GradcheckOptions
from .problem import leaf_tensors
from .result import GradcheckResult
from .run import run_gradcheck
from .verdicts import SKIPPED

if TYPE_CHECKING:
    import pandas as pd


#: ``progress(done, total, module_name)``, called after each module.
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class SweepOptions:
    """The keyword arguments of :func:`gradcheck_modules` (see there).

    Attributes
    ----------
    rows : int
        Batch rows of each module's recorded input that are checked.
    eps, atol, rtol : float
        Finite-difference step and tolerances.
    max_elements : int
        Elements per input checked.
    fast : bool
        ``torch.autograd.gradcheck``'s fast mode.
    random_state : int
    progress : callable, optional
        ``progress(done, total, module_name)``.
    """

    rows: int = 2
    eps: float = 1e-6
    atol: float = 1e-5
    rtol: float = 1e-3
    max_elements: int = 32
    fast: bool = False
    random_state: int = 0
    progress: Progress | None = None

    def gradcheck_options(self) -> GradcheckOptions:
        """The options one module is checked with (validated)."""
        if isinstance(self.rows, bool) or not isinstance(self.rows, int) or self.rows < 1:
            raise ValueError(f"rows must be a positive int; got {self.rows!r}.")
        options = GradcheckOptions(
            self.eps,
            self.atol,
            self.rtol,
            max_elements=self.max_elements,
            fast=self.fast,
            random_state=self.random_state,
        )
        return options.for_module_sweep().validate()


def gradcheck_modules(model: torch.nn.Module, inputs: object, **options: Any) -> pd.DataFrame:
    """Gradient-check every leaf module (and every module with its own parameters) on the
    activations that reach it for the first ``rows`` batch rows.

    Each module runs as a float64 copy with respect to its floating-point inputs and its own
    parameters; random operations (dropout) see the same seed on every evaluation, so a
    module in train mode is checked for one fixed dropout mask.

    Parameters
    ----------
    model : torch.nn.Module
    inputs : tensor, tuple/list or dict
        The batch (``model(x)``, ``model(*inputs)``, ``model(**inputs)``).
    rows : int
        Batch rows used (the first ``rows``, default 2).
    eps, atol, rtol, max_elements, fast, random_state
        As in :func:`gradcheck` (``max_elements`` is smaller here, 32: many modules).
    progress : callable, optional
        ``progress(done, total, module_name)``, called after each module.

    Returns
    -------
    pandas.DataFrame
        One row per module: ``module``, ``type``, ``passed`` (``None`` when skipped),
        ``verdict``, ``max_error``, ``seconds``, ``reason`` (why skipped, or the verdict in
        words). ``df.attrs["results"]`` maps module names to their :class:`GradcheckResult`.

    Raises
    ------
    TypeError
        An unknown keyword argument, a model that is not a module, a malformed batch.
    ValueError
        A bad option, in one sentence.
    """
    import pandas as pd

    opts = options_from(SweepOptions, options, where="gradcheck_modules()")
    check_model(model)
    check_inputs(inputs)
    checked = opts.gradcheck_options()
    records = []
    results: dict[str, GradcheckResult] = {}
    sweep = iter_module_checks(model, inputs, checked, rows=opts.rows, progress=opts.progress)
    for rec, res in sweep:
        records.append(rec)
        if res is not None:
            results[rec["module"]] = res
    columns = ["module", "type", "passed", "verdict", "max_error", "seconds", "reason"]
    df = pd.DataFrame(records, columns=columns)
    df["passed"] = df["passed"].astype(object)
    df.attrs["results"] = results
    return df


def iter_module_checks(
    model: torch.nn.Module,
    inputs: object,
    options: GradcheckOptions,
    *,
    rows: int = 2,
    progress: Progress | None = None,
) -> Iterator[tuple[dict[str, Any], GradcheckResult | None]]:
    """The module sweep of :func:`gradcheck_modules`, one ``(row, result)`` at a time, each
    module checked with ``options`` (see :meth:`GradcheckOptions.for_module_sweep`)."""
    check_model(model)
    check_inputs(inputs)
    names, captured = capture_module_inputs(model, inputs, rows)
    modules = dict(model.named_modules())
    total = len(names)
    rng_state = RngState.capture()
    try:
        for done, name in enumerate(names, 1):
            module = modules[name]
            row: dict[str, Any] = {
                "module": name,
                "type": type(module).__name__,
                "passed": None,
                "verdict": SKIPPED,
                "max_error": math.nan,
                "seconds": 0.0,
                "reason": "",
            }
            result = None
            t0 = time.perf_counter()
            call = captured.get(name)
            if call is None:
                row["reason"] = "not called in the forward pass"
            else:
                (args, kwargs), n_calls = call
                floats = [t for t in leaf_tensors((args, kwargs)) if t.is_floating_point()]
                own = [
                    p
                    for p in module.parameters(recurse=False)
                    if p.is_floating_point() and p.requires_grad
                ]
                # (NaN only: an -inf attention mask is a constant input, and is checked)
                bad_in = sum(count_nonfinite(t)[0] for t in floats)
                if not floats and not own:
                    row["reason"] = "no floating-point input or parameter to differentiate"
                elif bad_in:
                    # the NaN/Inf was made before this module: checking it says nothing
                    row["reason"] = (
                        f"not checked: its inputs already hold {bad_in} NaN (made before "
                        "it, by an earlier module or the batch)"
                    )
                else:
                    try:
                        result = run_gradcheck(
                            module,
                            module,
                            (args, kwargs),
                            options,
                            fn_name=f"module {name} ({type(module).__name__})"
                            if name
                            else type(module).__name__,
                        )
                    except (TypeError, ValueError) as e:
                        row["reason"] = f"could not be checked: {e}"
                    else:
                        result.seconds = time.perf_counter() - t0
                        row.update(
                            passed=result.ok,
                            verdict=result.verdict,
                            max_error=result.max_abs_error,
                            reason=result.message,
                        )
                        if n_calls > 1:
                            row["reason"] += f" (called {n_calls} times; checked the first call)"
            row["seconds"] = time.perf_counter() - t0
            if progress is not None:
                progress(done, total, name)
            yield row, result
    finally:
        rng_state.restore()


def capture_module_inputs(
    model: torch.nn.Module, inputs: object, rows: int
) -> tuple[list[str], dict[str, tuple[tuple[tuple[Any, ...], dict[str, Any]], int]]]:
    """Run ``model`` on the first ``rows`` batch rows and keep a copy of the arguments of the
    first call of every module to check."""
    n = batch_size(inputs)
    keep = min(rows, n) if n is not None else rows

    def head(t: object) -> object:
        if isinstance(t, torch.Tensor) and n is not None and t.ndim >= 1 and t.shape[0] == n:
            return t[:keep]
        return t

    sliced = tree_map(head, inputs) if not isinstance(inputs, torch.Tensor) else head(inputs)
    names = []
    for name, m in hookable_named_modules(model):
        if not any(True for _ in m.children()) or any(True for _ in m.parameters(recurse=False)):
            names.append(name)
    modules = dict(model.named_modules())
    captured: dict[str, tuple[tuple[tuple[Any, ...], dict[str, Any]], int]] = {}
    last = [""]

    def make_hook(name: str) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            last[0] = name
            if name in captured:
                call, count = captured[name]
                captured[name] = (call, count + 1)
                return
            captured[name] = (clone_structure((args, kwargs)), 1)

        return hook

    with preserved(model), HookSet() as hooks:
        for name in names:
            hooks.add(modules[name].register_forward_pre_hook(make_hook(name), with_kwargs=True))
        try:
            # grad mode keeps PyTorch's fused inference fast paths (which skip submodules) off
            with torch.enable_grad():
                call_model(model, sliced)
        except Exception as e:
            where = (
                f" Executed modules up to: {last[0] or '(none)'}." if last[0] or captured else ""
            )
            raise ValueError(
                f"the model raised {type(e).__name__} on the first {keep} batch rows: "
                f"{first_line(e, with_type=False)}.{where}"
            ) from e
    return names, captured
