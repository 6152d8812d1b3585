"""Gradient checks that say *which* input, *which* output and *which* elements disagree.

:func:`gradcheck` compares the backward (the analytic Jacobian, from autograd) with central
finite differences (the numerical Jacobian) for every (output, input) pair, in float64, on
copies: the user's module and tensors are never touched. When they disagree it re-checks the
worst elements with a smaller and a larger step and with one-sided differences to tell apart

* ``"backward is wrong"``: the finite differences are stable across steps (the function is
  smooth there) and the backward disagrees with them;
* ``"non-differentiable point"``: the point sits on (or within ``eps`` of) a kink, e.g. a
  ReLU or ``abs`` at exactly 0: the one-sided slopes differ, or a smaller step agrees;
* ``"float32 precision"``: the check passes in float64 but fails in the inputs' own
  float32 dtype, or the finite-difference error shrinks as the step grows (rounding noise
  inside the function).

:func:`gradcheck_modules` runs the same check on every leaf module (and every module with
its own parameters) of a model, on the activations that reach it for the first batch rows.

This module runs the check; the jobs it composes have their own modules:
:mod:`~nbdebug.analysis.gradcheck.inputs` (options, function and inputs, validated),
:mod:`~nbdebug.analysis.gradcheck.problem` (``fn`` on copies),
:mod:`~nbdebug.analysis.gradcheck.layout` (which Jacobian elements, measured how),
:mod:`~nbdebug.analysis.gradcheck.verdicts` (the tolerance, the verdicts and their text),
:mod:`~nbdebug.analysis.gradcheck.result` (the result types) and
:mod:`~nbdebug.analysis.gradcheck.sweep` (:func:`~nbdebug.gradcheck_modules`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ...core.options import options_from, refuse_unknown
from ...core.state import RngState
from ...core.stats import count_nonfinite
from ...core.text import count_text, dtype_name, first_line
from .inputs import (
    GRADCHECK_KEYWORDS,
    GradcheckOptions,
    Template,
    check_gradcheck_inputs,
    resolve_fn,
)
from .layout import Layout
from .problem import (
    FnRaised,
    Problem,
    make_problem,
    native_dtype,
    second_order_problem,
    sentence,
)
from .result import GradcheckResult, PairCheck
from .verdicts import (
    BACKWARD_WRONG,
    FLOAT32_PRECISION,
    explain,
    native_precision_message,
    score,
)

__all__ = ["check_pairs", "gradcheck", "run_gradcheck"]


def gradcheck(fn: object, *inputs: object, **options: Any) -> GradcheckResult:
    """Check ``fn``'s backward against finite differences, pair by pair, element by element.

    Parameters
    ----------
    fn : callable or torch.nn.Module
        A function of tensors, an ``autograd.Function.apply`` or a module. A module runs as a
        float64 deep copy; the module itself is not touched.
    *inputs : tensors or other objects
        Passed to ``fn`` positionally. With ``wrt="inputs"`` the floating-point tensors with
        ``requires_grad=True`` are checked; other arguments are constants.
    eps : float
        Finite-difference step (default ``1e-6``).
    atol, rtol : float
        An element passes when ``|analytic - numerical| <= atol + rtol * |numerical|``
        (defaults ``1e-5``, ``1e-3``).
    wrt : {"inputs", "params", "both"}
        Differentiate with respect to the inputs (default), the module's parameters
        (through ``torch.func.functional_call``), or both.
    second_order : bool
        Also check the backward itself (like ``torch.autograd.gradgradcheck``): the
        gradients for a fixed random ``grad_output`` against the inputs and ``grad_output``.
    max_elements : int
        An input (or output) with more elements (default 512) has a seeded random subset of
        ``max_elements`` of them checked; the result says so.
    fast : bool
        Check 4 random projections ``u^T J v`` per pair instead of elements.
    random_state : int
        Seed of the element subsets, projections and second-order ``grad_output`` (0).
    native_check : bool
        When the inputs are float32 (or lower), also run the check in that dtype, to tell a
        precision failure from a wrong backward (default ``True``).

    Returns
    -------
    GradcheckResult

    Raises
    ------
    TypeError, ValueError
        In one sentence: an unknown keyword argument, a bad option (see
        :meth:`GradcheckOptions.validate`), no input to differentiate, integer/boolean
        inputs, an output that is not a tensor, a function that is not deterministic, a
        backward that raises.
    """
    refuse_unknown(options, GRADCHECK_KEYWORDS, where="gradcheck()")
    opts = options_from(GradcheckOptions, options, where="gradcheck()").validate()
    module, target, fn_name = resolve_fn(fn)
    template: Template = (tuple(inputs), {})
    check_gradcheck_inputs(template, module=module, wrt=opts.wrt, fn_name=fn_name)
    rng_state = RngState.capture()
    t0 = time.perf_counter()
    try:
        result = run_gradcheck(target, module, template, opts, fn_name=fn_name)
    finally:
        rng_state.restore()
    result.seconds = time.perf_counter() - t0
    return result


def run_gradcheck(
    target: Callable[..., object],
    module: torch.nn.Module | None,
    template: Template,
    options: GradcheckOptions,
    *,
    fn_name: str,
) -> GradcheckResult:
    """The check of ``target`` at ``template = (args, kwargs)`` (``module``: the module it
    is, or ``None``), with validated ``options``. The caller restores the RNG state.

    Raises
    ------
    ValueError
        ``fn`` (or its backward) raised, is not deterministic, or is not finite at the point.
    """
    native = native_dtype(template, module)
    notes: list[str] = []

    def make(dtype: torch.dtype | None) -> Problem:
        return make_problem(target, module, template, options, dtype=dtype, fn_name=fn_name)

    problem, dtype_used = _runnable_problem(make, native, fn_name, notes)
    if not problem.diff:
        raise ValueError(f"{fn_name} has nothing to differentiate with wrt={options.wrt!r}.")
    try:
        pairs, sample_notes = check_pairs(problem, options, analyze=True, check_determinism=True)
    except FnRaised as e:
        raise ValueError(sentence(e)) from e.__cause__
    notes.extend(sample_notes)
    second_error = _second_order(problem, options, pairs, notes) if options.second_order else None
    if (
        options.native_check
        and dtype_used == "float64"
        and native is not None
        and native != torch.float64
    ):
        _native_recheck(pairs, lambda: make(None), options, native, notes)
    return GradcheckResult(
        pairs=pairs,
        fn_name=fn_name,
        wrt=options.wrt,
        eps=options.eps,
        atol=options.atol,
        rtol=options.rtol,
        dtype=dtype_used,
        fast=options.fast,
        second_order=options.second_order,
        sampled=any(p.sampled for p in pairs),
        notes=notes,
        second_order_error=second_error,
    )


def _runnable_problem(
    make: Callable[[torch.dtype | None], Problem],
    native: torch.dtype | None,
    fn_name: str,
    notes: list[str],
) -> tuple[Problem, str]:
    """The problem on float64 copies, or in the inputs' own dtype when ``fn`` does not run
    in float64 (with a note); and the dtype's name."""
    problem = make(torch.float64)
    try:
        problem.outputs(problem.diff)
    except FnRaised as e64:
        if native == torch.float64:
            raise ValueError(sentence(e64)) from e64.__cause__
        problem = make(None)
        try:
            problem.outputs(problem.diff)
        except FnRaised as e:
            raise ValueError(sentence(e)) from e.__cause__
        dtype_used = _dtype_name(native)
        notes.append(
            f"{fn_name} does not run on float64 copies ({e64}); the check ran in {dtype_used}, "
            "so finite differences are limited by its precision (pass the module itself, not a "
            "function that closes over it, to check in float64)."
        )
        return problem, dtype_used
    return problem, "float64"


def _second_order(
    problem: Problem, options: GradcheckOptions, pairs: list[PairCheck], notes: list[str]
) -> str | None:
    """Check the backward itself; its pairs join ``pairs``. Returns why it could not run."""
    try:
        q = second_order_problem(problem, options.random_state)
        pairs2, notes2 = check_pairs(q, options, analyze=True, check_determinism=False)
    except FnRaised as e:
        return (
            f"{BACKWARD_WRONG}: second order cannot be checked: {e}, so its own gradient "
            "is missing."
        )
    for p in pairs2:
        p.order = 2
    pairs.extend(pairs2)
    notes.extend(f"second order: {n}" for n in notes2)
    return None


def _native_recheck(
    pairs: list[PairCheck],
    make_native: Callable[[], Problem],
    options: GradcheckOptions,
    native: torch.dtype,
    notes: list[str],
) -> None:
    """Run the first-order check again in the inputs' own dtype; a pair that passes in float64
    and fails there gets the verdict "float32 precision"."""
    first = [p for p in pairs if p.order == 1]
    if not any(p.close for p in first):
        return
    name = _dtype_name(native)
    try:
        native_pairs, _ = check_pairs(
            make_native(), options, analyze=False, check_determinism=False
        )
    except (FnRaised, TypeError, ValueError, RuntimeError) as e:
        notes.append(f"the check in {name} could not run ({first_line(e, with_type=False)}).")
        return
    by_key = {(p.output, p.input): p for p in native_pairs}
    for p in first:
        q = by_key.get((p.output, p.input))
        if q is None:
            continue
        p.native_dtype = name
        p.native_max_abs_error = q.max_abs_error
        if p.close and not q.close:
            p.verdict = FLOAT32_PRECISION
            p.message = native_precision_message(p, name, q.max_abs_error, options.eps)
        elif p.close:
            p.message += f" It also passes in {name} (max abs error {q.max_abs_error:.2g})."


def check_pairs(
    problem: Problem,
    options: GradcheckOptions,
    *,
    analyze: bool,
    check_determinism: bool,
) -> tuple[list[PairCheck], list[str]]:
    """Measure and score every (output, input) pair of ``problem``; with ``analyze``, give
    failing pairs their final verdict. Returns the pairs and the sampling notes."""
    eps, fast = options.eps, options.fast
    rng = np.random.default_rng(options.random_state)
    xs0 = [x.detach().clone(memory_format=torch.contiguous_format) for x in problem.diff]
    f0 = problem.flat(xs0)
    if check_determinism:
        f1 = problem.flat(xs0)
        for name, a, b in zip(problem.out_names or [], f0, f1):
            gap = float((a - b).abs().nan_to_num(0.0).max()) if a.numel() else 0.0
            scale = float(a.abs().nan_to_num(0.0).max()) if a.numel() else 0.0
            if gap > 1e-9 * (1.0 + scale) or not torch.equal(a.isnan(), b.isnan()):
                raise ValueError(
                    f"{problem.fn_name} is not deterministic: two calls on the same inputs gave "
                    f"{name} values differing by up to {gap:.3g} (dropout or another random op "
                    "in train mode?); call model.eval() or remove the randomness before checking "
                    "gradients."
                )
    for name, a in zip(problem.out_names or [], f0):
        bad = sum(count_nonfinite(a))
        if bad:
            raise ValueError(
                f"{problem.fn_name} returned {count_text(bad, 'non-finite value')} in {name} "
                "at the given "
                "inputs; gradients cannot be checked at a point where the function is not finite."
            )
    layout = Layout.build(
        problem, xs0, f0, eps=eps, max_elements=options.max_elements, fast=fast, rng=rng
    )
    numerical = layout.numerical(eps)
    analytic, no_graph = layout.analytic()
    pairs = []
    for k, oname in enumerate(problem.out_names or []):
        for i, iname in enumerate(problem.names):
            p = PairCheck(
                output=oname,
                input=iname,
                analytic=analytic[k][i],
                numerical=numerical[k][i],
                rows=layout.rows[k] if not fast else np.zeros(1, dtype=np.int64),
                cols=layout.cols[i] if not fast else np.arange(layout.n_proj, dtype=np.int64),
                output_shape=tuple(problem.out_shapes[k]),
                input_shape=tuple(xs0[i].shape),
                mode="projections" if fast else "elements",
                atol=options.atol,
                rtol=options.rtol,
                sampled=(not fast) and (layout.sampled_in[i] or layout.sampled_out[k]),
            )
            score(p)
            pairs.append(p)
    if analyze:
        explain(pairs, layout, problem, xs0, eps=eps, no_graph=no_graph)
    return pairs, layout.notes


def _dtype_name(d: torch.dtype | None) -> str:
    return dtype_name(d) if d is not None else "unknown"
