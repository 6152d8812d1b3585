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

Jacobians are stored as ``(rows, cols)`` numpy arrays with ``J[r, c] = d out[rows[r]] /
d in[cols[c]]`` (flat indices into the output and the input).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import (
    MappingKey,
    SequenceKey,
    tree_flatten_with_path,
    tree_unflatten,
)

from ..core.batch import describe, named_tensors
from ..core.display import show as show_result
from ..core.state import RngState
from ..core.text import dtype_name

VERDICTS = ("ok", "backward is wrong", "non-differentiable point", "float32 precision")
_SEVERITY = {"ok": 0, "float32 precision": 1, "non-differentiable point": 2, "backward is wrong": 3}
_WRT = ("inputs", "params", "both")
# how many of a failing pair's worst columns are re-checked with other steps
_ANALYZED_COLUMNS = 8
# elements of gradient rows materialised at once by the batched backward
_GRAD_CHUNK_ELEMENTS = 1 << 24


# --------------------------------------------------------------------------- results


@dataclass(repr=False)
class PairCheck:
    """The check of one (output, input) pair.

    Attributes
    ----------
    output, input : str
        Names: ``"output"``, ``"output[0]"``; ``"input[1]"`` or a parameter name.
    analytic, numerical : numpy.ndarray, float64, shape (R, C)
        ``J[r, c] = d output.flat[rows[r]] / d input.flat[cols[c]]`` from the backward and
        from central finite differences. In ``fast`` mode ``R == 1`` and column ``c`` is the
        random projection ``u_c^T J v_c``.
    rows, cols : numpy.ndarray, int64, shapes (R,) and (C,)
        Flat indices into the output and the input that were checked.
    output_shape, input_shape : tuple of int
    order : int
        1, or 2 for the check of the backward itself (``second_order=True``).
    mode : str
        ``"elements"`` or ``"projections"`` (``fast=True``).
    max_abs_error, max_rel_error : float
        ``max |a - n|`` and ``max |a - n| / max(|n|, atol)``.
    worst : tuple of int
        ``(r, c)`` position in the arrays of the element furthest out of tolerance.
    close : bool
        Every checked element satisfies ``|a - n| <= atol + rtol * |n|``.
    verdict : str
        One of :data:`VERDICTS`.
    message : str
        The verdict in words.
    sampled : bool
        Only a random subset of the input's (or output's) elements was checked.
    native_dtype : str or None
        The inputs' own dtype when it is not float64.
    native_max_abs_error : float or None
        The same check run in that dtype.
    """

    output: str
    input: str
    analytic: np.ndarray
    numerical: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    output_shape: tuple[int, ...]
    input_shape: tuple[int, ...]
    order: int = 1
    mode: str = "elements"
    atol: float = 1e-5
    rtol: float = 1e-3
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    worst: tuple[int, int] = (0, 0)
    close: bool = True
    verdict: str = "ok"
    message: str = ""
    sampled: bool = False
    native_dtype: str | None = None
    native_max_abs_error: float | None = None

    @property
    def label(self) -> str:
        """``"d output / d input[1]"`` (``"2nd order: ..."`` for ``order == 2``)."""
        text = f"d {self.output} / d {self.input}"
        return f"2nd order: {text}" if self.order == 2 else text

    @property
    def difference(self) -> np.ndarray:
        """``|analytic - numerical|``, shape (R, C)."""
        return np.abs(self.analytic - self.numerical)

    @property
    def worst_output_index(self) -> tuple[int, ...] | None:
        """Index into the output of the worst element (``None`` in fast mode)."""
        if self.mode != "elements" or self.analytic.size == 0:
            return None
        return _unravel(int(self.rows[self.worst[0]]), self.output_shape)

    @property
    def worst_input_index(self) -> tuple[int, ...] | None:
        """Index into the input of the worst element (``None`` in fast mode)."""
        if self.mode != "elements" or self.analytic.size == 0:
            return None
        return _unravel(int(self.cols[self.worst[1]]), self.input_shape)

    @property
    def ok(self) -> bool:
        """No evidence that the backward is wrong."""
        return self.verdict != "backward is wrong"

    def __repr__(self) -> str:
        return (
            f"PairCheck({self.label!r}, verdict={self.verdict!r}, "
            f"max_abs_error={self.max_abs_error:.3g}, checked={self.analytic.shape})"
        )


@dataclass(repr=False)
class GradcheckResult:
    """What :func:`gradcheck` found.

    Attributes
    ----------
    pairs : list of PairCheck
        One per (output, input) pair; second-order pairs (``order == 2``) after them.
    fn_name : str
    wrt : str
        ``"inputs"``, ``"params"`` or ``"both"``.
    eps, atol, rtol : float
    dtype : str
        The dtype the check ran in (``"float64"`` unless ``fn`` does not run in it).
    fast : bool
        Random projections instead of elements.
    second_order : bool
    sampled : bool
        Some input or output had more than ``max_elements`` elements and only a seeded
        random subset was checked (see :attr:`notes`).
    notes : list of str
    seconds : float
    second_order_error : str or None
        Why the second-order check could not run (a backward that is not differentiable).
    """

    pairs: list[PairCheck]
    fn_name: str = "fn"
    wrt: str = "inputs"
    eps: float = 1e-6
    atol: float = 1e-5
    rtol: float = 1e-3
    dtype: str = "float64"
    fast: bool = False
    second_order: bool = False
    sampled: bool = False
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    second_order_error: str | None = None

    @property
    def ok(self) -> bool:
        """True when no backward was found wrong: every pair agrees, or disagrees only at a
        non-differentiable point or by float precision (see each pair's verdict)."""
        return self.second_order_error is None and all(p.ok for p in self.pairs)

    @property
    def verdict(self) -> str:
        """The most serious verdict over all pairs."""
        if self.second_order_error is not None:
            return "backward is wrong"
        return max((p.verdict for p in self.pairs), key=_SEVERITY.__getitem__, default="ok")

    @property
    def worst(self) -> PairCheck | None:
        """The pair with the most serious verdict (ties: the largest error)."""
        if not self.pairs:
            return None
        return max(self.pairs, key=lambda p: (_SEVERITY[p.verdict], _nan_big(p.max_abs_error)))

    @property
    def failures(self) -> list[PairCheck]:
        """Pairs whose backward is wrong."""
        return [p for p in self.pairs if p.verdict == "backward is wrong"]

    @property
    def max_abs_error(self) -> float:
        return max((p.max_abs_error for p in self.pairs), key=_nan_big, default=0.0)

    @property
    def message(self) -> str:
        """The verdict in words (of the worst pair)."""
        if self.second_order_error is not None:
            return self.second_order_error
        w = self.worst
        return w.message if w is not None else "ok: nothing to check."

    def pair(
        self, output: str | None = None, input: str | None = None, *, order: int = 1
    ) -> PairCheck:
        """The pair with these names (``None`` matches any)."""
        for p in self.pairs:
            if p.order == order and output in (None, p.output) and input in (None, p.input):
                return p
        have = [p.label for p in self.pairs]
        raise KeyError(
            f"no pair with output={output!r}, input={input!r}, order={order}; pairs: {have}."
        )

    def to_frame(self) -> Any:
        """One row per pair: order, output, input, verdict, close, errors, the worst element's
        indices and values, what was checked, and the message."""
        import pandas as pd

        rows = []
        for p in self.pairs:
            r, c = p.worst
            has = p.analytic.size > 0
            rows.append(
                {
                    "order": p.order,
                    "output": p.output,
                    "input": p.input,
                    "verdict": p.verdict,
                    "close": p.close,
                    "max_abs_error": p.max_abs_error,
                    "max_rel_error": p.max_rel_error,
                    "worst_output": p.worst_output_index
                    if p.mode == "elements"
                    else f"projection {c}",
                    "worst_input": p.worst_input_index
                    if p.mode == "elements"
                    else f"projection {c}",
                    "analytic": float(p.analytic[r, c]) if has else math.nan,
                    "numerical": float(p.numerical[r, c]) if has else math.nan,
                    "checked": _checked_text(p),
                    "native_max_abs_error": p.native_max_abs_error,
                    "message": p.message,
                }
            )
        return pd.DataFrame(rows)

    def show(self, *, backend: str | None = None) -> Any:
        """The gradcheck panel for this result (an ``ipywidgets`` widget)."""
        return show_result(self, backend=backend)

    def __repr__(self) -> str:
        n1 = sum(p.order == 1 for p in self.pairs)
        n2 = len(self.pairs) - n1
        head = f"GradcheckResult(ok={self.ok}, verdict={self.verdict!r}, {n1} pairs"
        if n2:
            head += f" + {n2} second-order"
        w = self.worst
        if w is not None and w.verdict != "ok":
            head += f", worst: {w.label!r} (max abs error {w.max_abs_error:.3g})"
        return head + (", sampled" if self.sampled else "") + f", {self.seconds:.2f}s)"

    def _repr_html_(self) -> str:
        head = f"<p><b>gradcheck of {_esc(self.fn_name)}</b>: {_esc(self.message)}</p>"
        frame = self.to_frame().drop(columns=["message"])
        return head + frame.to_html(index=False)

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        # in a kernel, displaying the result shows the panel; elsewhere text and a table
        bundle: dict[str, Any] = {"text/plain": repr(self), "text/html": self._repr_html_()}
        if _in_kernel():
            try:
                widget = self.show()
                bundle.update(widget._repr_mimebundle_())
                bundle["text/plain"] = repr(self)
            except ImportError:
                pass
        return bundle


# --------------------------------------------------------------------------- public API


def gradcheck(
    fn: Any,
    *inputs: Any,
    eps: float = 1e-6,
    atol: float = 1e-5,
    rtol: float = 1e-3,
    wrt: str = "inputs",
    second_order: bool = False,
    max_elements: int = 512,
    fast: bool = False,
    random_state: int = 0,
    native_check: bool = True,
) -> GradcheckResult:
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
        Finite-difference step.
    atol, rtol : float
        An element passes when ``|analytic - numerical| <= atol + rtol * |numerical|``.
    wrt : {"inputs", "params", "both"}
        Differentiate with respect to the inputs, the module's parameters (through
        ``torch.func.functional_call``), or both.
    second_order : bool
        Also check the backward itself (like ``torch.autograd.gradgradcheck``): the
        gradients for a fixed random ``grad_output`` against the inputs and ``grad_output``.
    max_elements : int
        An input (or output) with more elements has a seeded random subset of
        ``max_elements`` of them checked; the result says so.
    fast : bool
        Check 4 random projections ``u^T J v`` per pair instead of elements.
    random_state : int
        Seed of the element subsets, projections and second-order ``grad_output``.
    native_check : bool
        When the inputs are float32 (or lower), also run the check in that dtype, to tell a
        precision failure from a wrong backward.

    Returns
    -------
    GradcheckResult

    Raises
    ------
    TypeError, ValueError
        In one sentence: no input to differentiate, integer/boolean inputs, an output that is
        not a tensor, a function that is not deterministic, a backward that raises.
    """
    _check_options(eps=eps, atol=atol, rtol=rtol, wrt=wrt, max_elements=max_elements)
    module, target, fn_name = _resolve_fn(fn)
    template: tuple[Any, dict[str, Any]] = (tuple(inputs), {})
    _check_gradcheck_inputs(template, module=module, wrt=wrt, fn_name=fn_name)
    rng_state = RngState.capture()
    t0 = time.perf_counter()
    try:
        result = _run_gradcheck(
            target,
            module,
            template,
            fn_name=fn_name,
            wrt=wrt,
            eps=eps,
            atol=atol,
            rtol=rtol,
            second_order=second_order,
            max_elements=max_elements,
            fast=fast,
            random_state=random_state,
            native_check=native_check,
            all_float=False,
            param_recurse=True,
            fixed_seed=None,
        )
    finally:
        rng_state.restore()
    result.seconds = time.perf_counter() - t0
    return result


# --------------------------------------------------------------------------- input checks


def _check_options(*, eps: float, atol: float, rtol: float, wrt: str, max_elements: int) -> None:
    for name, v in (("eps", eps), ("atol", atol), ("rtol", rtol)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{name} must be a finite number >= 0; got {v!r}.")
    if eps <= 0:
        raise ValueError(f"eps must be > 0; got {eps!r}.")
    if wrt not in _WRT:
        raise ValueError(f"wrt must be one of {_WRT}; got {wrt!r}.")
    if isinstance(max_elements, bool) or not isinstance(max_elements, int) or max_elements < 1:
        raise ValueError(f"max_elements must be a positive int; got {max_elements!r}.")


def _resolve_fn(fn: Any) -> tuple[torch.nn.Module | None, Any, str]:
    if isinstance(fn, type) and issubclass(fn, torch.autograd.Function):
        raise TypeError(
            f"fn must be callable on tensors; got the autograd.Function class "
            f"{fn.__name__}: pass {fn.__name__}.apply."
        )
    if isinstance(fn, torch.nn.Module):
        return fn, fn, type(fn).__name__
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module) and getattr(fn, "__name__", None) in (
        "forward",
        "__call__",
    ):
        return owner, owner, type(owner).__name__
    if not callable(fn):
        raise TypeError(
            f"fn must be a function, an autograd.Function.apply or an nn.Module; got "
            f"{type(fn).__qualname__}."
        )
    owner_name = getattr(owner, "__name__", None)
    name = getattr(fn, "__name__", None) or type(fn).__name__
    if name == "apply" and owner_name:
        name = f"{owner_name}.apply"
    return None, fn, str(name)


def _check_gradcheck_inputs(
    template: tuple[Any, dict[str, Any]], *, module: torch.nn.Module | None, wrt: str, fn_name: str
) -> None:
    leaves = [(_leaf_name(path), leaf) for path, leaf in tree_flatten_with_path(template)[0]]
    tensors = [(n, t) for n, t in leaves if isinstance(t, torch.Tensor)]
    for n, t in tensors:
        if t.is_complex():
            raise TypeError(f"gradcheck supports real floating-point tensors; {n} is {t.dtype}.")
    if wrt in ("params", "both"):
        if module is None:
            raise TypeError(
                f"wrt={wrt!r} needs fn to be an nn.Module (to reach its parameters); got {fn_name}."
            )
        has_params = any(p.is_floating_point() and p.requires_grad for p in module.parameters())
        if wrt == "params":
            if not has_params:
                raise ValueError(
                    f"wrt='params' but {fn_name} has no floating-point parameter with "
                    f"requires_grad=True."
                )
            return
        if has_params:
            return
    if any(t.is_floating_point() and t.requires_grad for _, t in tensors):
        return
    hint = " (or wrt='params' to check the module's parameters)" if module is not None else ""
    if not tensors:
        given = describe(template[0]) if template[0] else "no inputs"
        raise ValueError(
            f"gradcheck needs at least one floating-point input tensor with "
            f"requires_grad=True; got {given}{hint}."
        )
    floats = [(n, t) for n, t in tensors if t.is_floating_point()]
    if not floats:
        kinds = ", ".join(f"{n}: {dtype_name(t.dtype)}" for n, t in tensors)
        raise TypeError(
            f"gradcheck differentiates floating-point tensors, but the inputs are "
            f"integer or boolean ({kinds}), "
            f"which have no gradient; pass float inputs with requires_grad=True, e.g. "
            f"x.double().requires_grad_(){hint}."
        )
    names = ", ".join(n for n, _ in floats)
    raise ValueError(
        f"no input requires grad: gradcheck checks the gradient with respect to inputs "
        f"with requires_grad=True, "
        f"and {names} {'has' if len(floats) == 1 else 'have'} requires_grad=False; "
        f"call .requires_grad_() on the "
        f"inputs to check{hint}."
    )


# --------------------------------------------------------------------------- the problem


class _FnRaised(Exception):
    """fn (or its backward) raised; carries the sentence to show."""


class _Problem:
    """``fn`` as a function of a list of differentiable tensors (float64 copies)."""

    def __init__(
        self,
        call: Callable[[list[torch.Tensor]], Any],
        diff: list[torch.Tensor],
        names: list[str],
        *,
        fn_name: str,
        fixed_seed: int | None,
        needs_grad: bool = False,
    ) -> None:
        self.call = call
        self.diff = diff
        self.names = names
        self.fn_name = fn_name
        self.fixed_seed = fixed_seed
        self.needs_grad = needs_grad
        self.out_names: list[str] | None = None
        self.out_shapes: list[tuple[int, ...]] = []
        self.cuda_devices = sorted({t.device.index or 0 for t in diff if t.is_cuda})

    @contextlib.contextmanager
    def _seeded(self) -> Iterator[None]:
        # every evaluation sees the same random numbers (one fixed dropout mask); the caller
        # restores the user's RNG state once at the end
        if self.fixed_seed is not None:
            torch.default_generator.manual_seed(self.fixed_seed)
            for d in self.cuda_devices:
                torch.cuda.default_generators[d].manual_seed(self.fixed_seed)
        yield

    def outputs(self, xs: Sequence[torch.Tensor], *, grad: bool = False) -> list[torch.Tensor]:
        """The floating-point tensors of ``fn``'s output, in a fixed order."""
        mode = torch.enable_grad() if (grad or self.needs_grad) else torch.no_grad()
        try:
            with mode, self._seeded():
                raw = self.call(list(xs))
        except _FnRaised:
            raise
        except Exception as e:
            raise _FnRaised(f"{self.fn_name} raised {type(e).__name__}: {_first_line(e)}") from e
        named = list(named_tensors(raw, "output"))
        if self.out_names is None:
            if not named:
                raise TypeError(
                    f"{self.fn_name} must return a tensor or a tuple/list/dict of "
                    f"tensors; it returned {describe(raw)}."
                )
            floats = [(n, t) for n, t in named if t.is_floating_point()]
            if not floats:
                raise TypeError(
                    f"{self.fn_name} returned no floating-point tensor to "
                    f"differentiate: {describe(raw)}."
                )
            self.out_names = [n for n, _ in floats]
            self.out_shapes = [tuple(t.shape) for _, t in floats]
        got = {n: t for n, t in named}
        outs = []
        for n, shape in zip(self.out_names, self.out_shapes):
            t = got.get(n)
            if t is None or tuple(t.shape) != shape:
                raise ValueError(
                    f"{self.fn_name} returned a different structure on a perturbed input: {n} is "
                    f"{describe(t) if t is not None else 'missing'}, expected shape {shape}."
                )
            outs.append(t)
        return outs

    def flat(self, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [o.detach().reshape(-1).to(torch.float64) for o in self.outputs(xs)]


def _make_problem(
    target: Any,
    module: torch.nn.Module | None,
    template: tuple[Any, dict[str, Any]],
    *,
    wrt: str,
    dtype: torch.dtype | None,
    all_float: bool,
    param_recurse: bool,
    fixed_seed: int | None,
    fn_name: str,
) -> _Problem:
    with_path, spec = tree_flatten_with_path(template)
    leaves = [_copy_leaf(leaf, dtype) for _, leaf in with_path]
    specs: list[tuple[str, Any]] = []
    names: list[str] = []
    diff: list[torch.Tensor] = []
    if wrt in ("inputs", "both"):
        for idx, (path, leaf) in enumerate(with_path):
            if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
                continue
            # the sweep differentiates every finite float input (an additive -inf mask is a
            # constant)
            if leaf.requires_grad if not all_float else bool(torch.isfinite(leaf).all()):
                specs.append(("leaf", idx))
                names.append(_leaf_name(path))
                diff.append(leaves[idx])
    mod = None
    if module is not None:
        try:
            mod = copy.deepcopy(module)
        except Exception as e:
            raise ValueError(
                f"{fn_name} cannot be copied to check it without touching it "
                f"({type(e).__name__}: {_first_line(e)})."
            ) from e
        if dtype is not None:
            mod.to(dtype)
        if wrt in ("params", "both"):
            for pname, p in mod.named_parameters(recurse=param_recurse):
                if p.is_floating_point() and p.requires_grad:
                    specs.append(("param", pname))
                    names.append(pname)
                    diff.append(p.detach().clone())
    fn = mod if mod is not None else target

    def call(xs: list[torch.Tensor]) -> Any:
        # fresh copies on every call: an in-place op in fn (ReLU(inplace=True)) must neither
        # move the point of the check nor hit a leaf that requires grad
        vals = [v.clone() if isinstance(v, torch.Tensor) else v for v in leaves]
        params: dict[str, torch.Tensor] = {}
        for (kind, key), x in zip(specs, xs):
            if kind == "leaf":
                vals[key] = x.clone()
            else:
                params[key] = x
        args, kwargs = tree_unflatten(vals, spec)
        if params:
            assert mod is not None
            return torch.func.functional_call(mod, params, tuple(args), kwargs, strict=False)
        return fn(*args, **kwargs)

    return _Problem(call, [d.detach() for d in diff], names, fn_name=fn_name, fixed_seed=fixed_seed)


def _second_order_problem(p: _Problem, seed: int) -> _Problem:
    """The backward as a function of (inputs, grad_output), like ``gradgradcheck``."""
    outs = p.outputs(p.diff)
    gen = torch.Generator().manual_seed(seed)
    vs = [
        torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype) for o in outs
    ]
    n = len(p.diff)
    out_names = p.out_names or []

    def call(xs: list[torch.Tensor]) -> Any:
        x_in = [x if x.requires_grad else x.detach().requires_grad_(True) for x in xs[:n]]
        v = xs[n:]
        with torch.enable_grad():
            ys = p.outputs(x_in, grad=True)
            live = [(y, g) for y, g in zip(ys, v) if y.requires_grad]
            if not live:
                return [torch.zeros_like(x) for x in x_in]
            grads = torch.autograd.grad(
                [y for y, _ in live],
                x_in,
                [g for _, g in live],
                create_graph=True,
                allow_unused=True,
            )
        if any(
            g is not None and type(g.grad_fn).__name__ in ("Error", "DelayedError") for g in grads
        ):
            raise _FnRaised(f"the backward of {p.fn_name} is marked @once_differentiable")
        return [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, x_in)]

    v_names = [f"grad_output {o}" if len(out_names) > 1 else "grad_output" for o in out_names]
    q = _GradProblem(
        call, [*p.diff, *vs], [*p.names, *v_names], fn_name=p.fn_name, fixed_seed=p.fixed_seed
    )
    q.out_names = [f"grad {nm}" for nm in p.names]
    q.out_shapes = [tuple(x.shape) for x in p.diff]
    return q


class _GradProblem(_Problem):
    """A second-order problem: its outputs are the list of gradients, one per input."""

    def outputs(self, xs: Sequence[torch.Tensor], *, grad: bool = False) -> list[torch.Tensor]:
        try:
            with torch.enable_grad(), self._seeded():
                return list(self.call(list(xs)))
        except _FnRaised:
            raise
        except Exception as e:
            raise _FnRaised(
                f"the backward of {self.fn_name} raised {type(e).__name__}: {_first_line(e)}"
            ) from e


# --------------------------------------------------------------------------- running


def _run_gradcheck(
    target: Any,
    module: torch.nn.Module | None,
    template: tuple[Any, dict[str, Any]],
    *,
    fn_name: str,
    wrt: str,
    eps: float,
    atol: float,
    rtol: float,
    second_order: bool,
    max_elements: int,
    fast: bool,
    random_state: int,
    native_check: bool,
    all_float: bool,
    param_recurse: bool,
    fixed_seed: int | None,
) -> GradcheckResult:
    make = functools.partial(
        _make_problem,
        target,
        module,
        template,
        wrt=wrt,
        all_float=all_float,
        param_recurse=param_recurse,
        fixed_seed=fixed_seed,
        fn_name=fn_name,
    )
    native = _native_dtype(template, module)
    notes: list[str] = []
    problem = make(dtype=torch.float64)
    dtype_used = "float64"
    try:
        problem.outputs(problem.diff)
    except _FnRaised as e64:
        if native == torch.float64:
            raise ValueError(_sentence(e64)) from e64.__cause__
        problem = make(dtype=None)
        try:
            problem.outputs(problem.diff)
        except _FnRaised as e:
            raise ValueError(_sentence(e)) from e.__cause__
        dtype_used = _dtype_name(native)
        notes.append(
            f"{fn_name} does not run on float64 copies ({e64}); the check ran in {dtype_used}, so "
            "finite differences are limited by its precision (pass the module itself, "
            "not a function "
            "that closes over it, to check in float64)."
        )
    if not problem.diff:
        raise ValueError(f"{fn_name} has nothing to differentiate with wrt={wrt!r}.")
    check = functools.partial(
        _check,
        eps=eps,
        atol=atol,
        rtol=rtol,
        max_elements=max_elements,
        fast=fast,
        seed=random_state,
    )
    try:
        pairs, sample_notes = check(problem, analyze=True, check_determinism=True)
    except _FnRaised as e:
        raise ValueError(_sentence(e)) from e.__cause__
    notes.extend(sample_notes)
    second_error = None
    if second_order:
        try:
            q = _second_order_problem(problem, random_state)
            pairs2, notes2 = check(q, analyze=True, check_determinism=False)
        except _FnRaised as e:
            second_error = (
                f"backward is wrong: second order cannot be checked: {e}, so its own "
                f"gradient is missing."
            )
        else:
            for p in pairs2:
                p.order = 2
            pairs.extend(pairs2)
            notes.extend(f"second order: {n}" for n in notes2)
    if native_check and dtype_used == "float64" and native is not None and native != torch.float64:
        _native_recheck(pairs, make, check, native, notes, eps=eps)
    return GradcheckResult(
        pairs=pairs,
        fn_name=fn_name,
        wrt=wrt,
        eps=eps,
        atol=atol,
        rtol=rtol,
        dtype=dtype_used,
        fast=fast,
        second_order=second_order,
        sampled=any(p.sampled for p in pairs),
        notes=notes,
        second_order_error=second_error,
    )


def _native_recheck(
    pairs: list[PairCheck],
    make: Callable[..., _Problem],
    check: Callable[..., tuple[list[PairCheck], list[str]]],
    native: torch.dtype,
    notes: list[str],
    *,
    eps: float,
) -> None:
    """Run the first-order check again in the inputs' own dtype; a pair that passes in float64
    and fails there gets the verdict "float32 precision"."""
    first = [p for p in pairs if p.order == 1]
    if not any(p.close for p in first):
        return
    name = _dtype_name(native)
    try:
        native_pairs, _ = check(make(dtype=None), analyze=False, check_determinism=False)
    except (_FnRaised, TypeError, ValueError, RuntimeError) as e:
        notes.append(f"the check in {name} could not run ({_first_line(e)}).")
        return
    by_key = {(p.output, p.input): p for p in native_pairs}
    for p in first:
        q = by_key.get((p.output, p.input))
        if q is None:
            continue
        p.native_dtype = name
        p.native_max_abs_error = q.max_abs_error
        if p.close and not q.close:
            p.verdict = "float32 precision"
            p.message = (
                f"float32 precision: {p.label} passes in float64 (max abs error "
                f"{p.max_abs_error:.2g}) but "
                f"fails in {name} (max abs error {q.max_abs_error:.2g}, eps={eps:g}): "
                f"rounding in the "
                f"{name} finite differences, not the backward."
            )
        elif p.close:
            p.message += f" It also passes in {name} (max abs error {q.max_abs_error:.2g})."


def _check(
    problem: _Problem,
    *,
    eps: float,
    atol: float,
    rtol: float,
    max_elements: int,
    fast: bool,
    seed: int,
    analyze: bool,
    check_determinism: bool,
) -> tuple[list[PairCheck], list[str]]:
    rng = np.random.default_rng(seed)
    xs0 = [x.detach().clone(memory_format=torch.contiguous_format) for x in problem.diff]
    f0 = problem.flat(xs0)
    if check_determinism:
        f1 = problem.flat(xs0)
        for name, a, b in zip(problem.out_names or [], f0, f1):
            gap = float((a - b).abs().nan_to_num(0.0).max()) if a.numel() else 0.0
            scale = float(a.abs().nan_to_num(0.0).max()) if a.numel() else 0.0
            if gap > 1e-9 * (1.0 + scale) or not torch.equal(a.isnan(), b.isnan()):
                raise ValueError(
                    f"{problem.fn_name} is not deterministic: two calls on the same "
                    f"inputs gave {name} values "
                    f"differing by up to {gap:.3g} (dropout or another random op in "
                    f"train mode?); call "
                    "model.eval() or remove the randomness before checking gradients."
                )
    for name, a in zip(problem.out_names or [], f0):
        bad = int((~torch.isfinite(a)).sum())
        if bad:
            raise ValueError(
                f"{problem.fn_name} returned {bad} non-finite value(s) in {name} at "
                f"the given inputs; gradients "
                "cannot be checked at a point where the function is not finite."
            )
    layout = _Layout.build(problem, xs0, f0, eps=eps, max_elements=max_elements, fast=fast, rng=rng)
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
                atol=atol,
                rtol=rtol,
                sampled=(not fast) and (layout.sampled_in[i] or layout.sampled_out[k]),
            )
            _score(p)
            pairs.append(p)
    if analyze:
        _explain(pairs, layout, problem, xs0, eps=eps, no_graph=no_graph)
    return pairs, layout.notes


# --------------------------------------------------------------------------- layout


@dataclass
class _Layout:
    """Which elements (or projections) are checked, and how to measure them."""

    problem: _Problem
    xs0: list[torch.Tensor]
    f0: list[torch.Tensor]
    fast: bool
    cols: list[np.ndarray] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)
    sampled_in: list[bool] = field(default_factory=list)
    sampled_out: list[bool] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    n_proj: int = 4
    v: list[list[torch.Tensor]] = field(default_factory=list)  # [input][proj] direction
    u: list[list[torch.Tensor]] = field(default_factory=list)  # [output][proj] flat

    @classmethod
    def build(
        cls,
        problem: _Problem,
        xs0: list[torch.Tensor],
        f0: list[torch.Tensor],
        *,
        eps: float,
        max_elements: int,
        fast: bool,
        rng: np.random.Generator,
    ) -> _Layout:
        lay = cls(problem, xs0, f0, fast)
        if fast:
            lay.v = [[_unit(rng, tuple(x.shape), x) for _ in range(lay.n_proj)] for x in xs0]
            lay.u = [[_unit(rng, (f.numel(),), f) for _ in range(lay.n_proj)] for f in f0]
            return lay
        for name, x in zip(problem.names, xs0):
            n = x.numel()
            if n > max_elements:
                lay.cols.append(
                    np.sort(rng.choice(n, size=max_elements, replace=False)).astype(np.int64)
                )
                lay.sampled_in.append(True)
                lay.notes.append(
                    f"{name} has {n} elements: checked a random subset of {max_elements}."
                )
            else:
                lay.cols.append(np.arange(n, dtype=np.int64))
                lay.sampled_in.append(False)
        big = [k for k, f in enumerate(f0) if f.numel() > max_elements]
        influenced: dict[int, list[np.ndarray]] = {k: [] for k in big}
        if big:
            # one probe per input: which output elements do the checked input elements move?
            for i, x in enumerate(xs0):
                s = torch.zeros(x.numel(), dtype=torch.float64)
                picked = lay.cols[i]
                s[torch.from_numpy(picked)] = torch.from_numpy(
                    rng.uniform(0.5, 1.0, picked.size) * rng.choice([-1.0, 1.0], picked.size)
                )
                direction = s.reshape(x.shape).to(x.device, x.dtype)
                plus = lay.shifted(i, direction, eps)
                minus = lay.shifted(i, direction, -eps)
                for k in big:
                    moved = (plus[k] - minus[k]).abs().cpu().numpy()
                    influenced[k].append(np.flatnonzero(moved > 0))
        for k, f in enumerate(f0):
            n = f.numel()
            name = (problem.out_names or [])[k]
            if k not in big:
                lay.rows.append(np.arange(n, dtype=np.int64))
                lay.sampled_out.append(False)
                continue
            chosen: set[int] = set()
            sets = [hit for hit in influenced[k] if hit.size]
            n_hit = np.unique(np.concatenate(sets)).size if sets else 0
            # all moved elements when they fit, else 3/4 of the budget (the rest: random ones)
            quota = max_elements if n_hit <= max_elements else (3 * max_elements) // 4
            for j, hit in enumerate(sets):
                share = (quota - len(chosen)) // (len(sets) - j)
                if share > 0:
                    fresh = np.setdiff1d(
                        hit, np.fromiter(chosen, dtype=np.int64, count=len(chosen))
                    )
                    if fresh.size:
                        take = rng.choice(fresh, size=min(share, fresh.size), replace=False)
                        chosen.update(int(t) for t in take)
            rest = np.setdiff1d(
                np.arange(n), np.fromiter(chosen, dtype=np.int64, count=len(chosen))
            )
            extra = rng.choice(rest, size=min(max_elements - len(chosen), rest.size), replace=False)
            chosen.update(int(t) for t in extra)
            lay.rows.append(np.sort(np.fromiter(chosen, dtype=np.int64, count=len(chosen))))
            lay.sampled_out.append(True)
            lay.notes.append(
                f"{name} has {n} elements: checked {len(chosen)} of them (elements the "
                f"checked inputs move, plus random ones)."
            )
        return lay

    def direction(self, i: int, c: int) -> torch.Tensor | int:
        return self.v[i][c] if self.fast else int(self.cols[i][c])

    def shifted(self, i: int, d: torch.Tensor | int, h: float) -> list[torch.Tensor]:
        """Flat float64 outputs with input ``i`` moved by ``h`` along ``d`` (an element index
        or a direction tensor)."""
        x = self.xs0[i].clone()
        if isinstance(d, int):
            x.view(-1)[d] += h
        else:
            x.add_(d, alpha=h)
        xs = list(self.xs0)
        xs[i] = x
        return self.problem.flat(xs)

    def measure(self, k: int, c: int, flat: torch.Tensor) -> np.ndarray:
        """The checked rows of output ``k`` (fast: its projection ``u_c``), shape (R,)."""
        if self.fast:
            return np.array([float(torch.dot(self.u[k][c], flat))])
        return flat[torch.from_numpy(self.rows[k]).to(flat.device)].cpu().numpy()

    def numerical(self, h: float) -> list[list[np.ndarray]]:
        K = len(self.f0)
        out = [[np.empty(0) for _ in self.xs0] for _ in range(K)]
        for i in range(len(self.xs0)):
            C = self.n_proj if self.fast else self.cols[i].size
            cols_k: list[list[np.ndarray]] = [[] for _ in range(K)]
            for c in range(C):
                d = self.direction(i, c)
                plus = self.shifted(i, d, h)
                minus = self.shifted(i, d, -h)
                for k in range(K):
                    cols_k[k].append(
                        (self.measure(k, c, plus[k]) - self.measure(k, c, minus[k])) / (2 * h)
                    )
            for k in range(K):
                R = 1 if self.fast else self.rows[k].size
                out[k][i] = np.stack(cols_k[k], axis=1) if C else np.zeros((R, 0))
        return out

    def analytic(self) -> tuple[list[list[np.ndarray]], bool]:
        """The backward's Jacobian entries at the checked rows/columns, and whether the
        output had no autograd graph at all."""
        xs = [x.detach().clone().requires_grad_(True) for x in self.xs0]
        outs = self.problem.outputs(xs, grad=True)
        K, n_in = len(outs), len(xs)
        if self.fast:
            ys = [o.reshape(-1) for o in outs]
            # grad_outputs: one row per (output k, projection p)
            vecs = []
            for k in range(K):
                for p in range(self.n_proj):
                    vecs.append(
                        torch.cat(
                            [
                                self.u[k][p].to(y.dtype) if j == k else torch.zeros_like(y)
                                for j, y in enumerate(ys)
                            ]
                        )
                    )
            y = torch.cat(ys)
            grads, no_graph = _batched_vjp(y, xs, torch.stack(vecs), self.problem.fn_name)
            out = [[np.zeros((1, self.n_proj)) for _ in range(n_in)] for _ in range(K)]
            for k in range(K):
                for i in range(n_in):
                    for p in range(self.n_proj):
                        g = grads[i][k * self.n_proj + p]
                        out[k][i][0, p] = float(
                            torch.dot(
                                g.to(torch.float64), self.v[i][p].reshape(-1).to(torch.float64)
                            )
                        )
            return out, no_graph
        sel = [
            o.reshape(-1)[torch.from_numpy(self.rows[k]).to(o.device)] for k, o in enumerate(outs)
        ]
        y = torch.cat(sel) if sel else torch.zeros(0)
        eye = torch.eye(y.numel(), dtype=y.dtype, device=y.device)
        cols = [torch.from_numpy(c).to(x.device) for c, x in zip(self.cols, xs)]
        grads, no_graph = _batched_vjp(y, xs, eye, self.problem.fn_name, cols=cols)
        out = []
        offset = 0
        for k in range(K):
            R = self.rows[k].size
            out.append(
                [grads[i][offset : offset + R].to(torch.float64).cpu().numpy() for i in range(n_in)]
            )
            offset += R
        return out, no_graph


def _batched_vjp(
    y: torch.Tensor,
    xs: list[torch.Tensor],
    vecs: torch.Tensor,
    fn_name: str,
    *,
    cols: list[torch.Tensor] | None = None,
) -> tuple[list[torch.Tensor], bool]:
    """``vecs @ J`` for each input: one vector-Jacobian product per row of ``vecs``, batched
    with ``is_grads_batched`` (checked against one unbatched product, else a loop). Returns,
    per input, a (rows, cols-or-numel) tensor; and True when ``y`` has no graph at all."""
    B = vecs.shape[0]
    widths = [c.numel() for c in cols] if cols is not None else [x.numel() for x in xs]
    out = [torch.zeros(B, w, dtype=torch.float64, device=x.device) for w, x in zip(widths, xs)]
    if B == 0 or not y.requires_grad:
        return out, not y.requires_grad

    def take(g: torch.Tensor | None, i: int, lead: int) -> torch.Tensor:
        if g is None:
            return torch.zeros(lead, widths[i], dtype=torch.float64, device=xs[i].device)
        g = g.reshape(lead, -1)
        if cols is not None:
            g = g[:, cols[i]]
        return g.to(torch.float64)

    def single(r: int) -> list[torch.Tensor]:
        try:
            gs = torch.autograd.grad(y, xs, vecs[r], retain_graph=True, allow_unused=True)
        except Exception as e:
            raise _FnRaised(
                f"the backward of {fn_name} raised {type(e).__name__}: {_first_line(e)}"
            ) from e
        return [take(g, i, 1)[0] for i, g in enumerate(gs)]

    first = single(0)
    numel = sum(x.numel() for x in xs)
    chunk = max(1, min(B, _GRAD_CHUNK_ELEMENTS // max(numel, 1)))
    batched = B > 1
    start = 0
    while start < B:
        stop = min(B, start + chunk)
        rows_out = None
        if batched:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    gs = torch.autograd.grad(
                        y,
                        xs,
                        vecs[start:stop],
                        retain_graph=True,
                        allow_unused=True,
                        is_grads_batched=True,
                    )
                rows_out = [take(g, i, stop - start) for i, g in enumerate(gs)]
                if start == 0 and not all(
                    torch.allclose(r[0], f, rtol=1e-9, atol=1e-12, equal_nan=True)
                    for r, f in zip(rows_out, first)
                ):
                    rows_out, batched = None, False
            except Exception:
                rows_out, batched = None, False
        if rows_out is None:
            rows_out = [torch.stack(col) for col in zip(*(single(r) for r in range(start, stop)))]
        for i in range(len(xs)):
            out[i][start:stop] = rows_out[i]
        start = stop
    return out, False


# --------------------------------------------------------------------------- verdicts


def _score(p: PairCheck) -> None:
    a, n = p.analytic, p.numerical
    if a.size == 0:
        p.message = f"ok: {p.label} has no elements to check."
        return
    diff = np.abs(a - n)
    tol = p.atol + p.rtol * np.abs(n)
    bad = ~(diff <= tol)
    ratio = np.where(np.isfinite(diff), diff / np.maximum(tol, 1e-300), np.inf)
    p.worst = tuple(int(v) for v in np.unravel_index(int(np.argmax(ratio)), a.shape))  # type: ignore[assignment]
    p.max_abs_error = float(np.max(np.where(np.isnan(diff), np.inf, diff)))
    rel = diff / np.maximum(np.abs(n), max(p.atol, 1e-300))
    p.max_rel_error = float(np.max(np.where(np.isnan(rel), np.inf, rel)))
    p.close = not bool(bad.any())
    p.verdict = "ok" if p.close else "backward is wrong"
    p.message = (
        f"ok: {p.label}: backward and finite differences agree (max abs error "
        f"{p.max_abs_error:.2g})."
        if p.close
        else f"backward is wrong: {p.label} disagrees (max abs error {p.max_abs_error:.2g})."
    )


@dataclass
class _Column:
    """Re-measurements of one checked column with other steps."""

    n_small: list[np.ndarray]  # per output k, over rows
    n_large: list[np.ndarray]
    left: list[np.ndarray]
    right: list[np.ndarray]


def _explain(
    pairs: list[PairCheck],
    lay: _Layout,
    problem: _Problem,
    xs0: list[torch.Tensor],
    *,
    eps: float,
    no_graph: bool,
) -> None:
    failing = [p for p in pairs if not p.close]
    if not failing:
        return
    K = len(lay.f0)
    h_small, h_large = eps / 100, eps * 100
    index_of_input = {n: i for i, n in enumerate(problem.names)}
    index_of_output = {n: k for k, n in enumerate(problem.out_names or [])}
    wanted: dict[int, set[int]] = {}
    for p in failing:
        i = index_of_input[p.input]
        wanted.setdefault(i, set()).update(_worst_columns(p))
    measured: dict[tuple[int, int], _Column] = {}
    for i, cs in wanted.items():
        for c in sorted(cs):
            d = lay.direction(i, c)
            fs_p, fs_m = lay.shifted(i, d, h_small), lay.shifted(i, d, -h_small)
            fp, fm = lay.shifted(i, d, eps), lay.shifted(i, d, -eps)
            fl_p, fl_m = lay.shifted(i, d, h_large), lay.shifted(i, d, -h_large)
            col = _Column([], [], [], [])
            for k in range(K):
                m0 = lay.measure(k, c, lay.f0[k])
                col.n_small.append(
                    (lay.measure(k, c, fs_p[k]) - lay.measure(k, c, fs_m[k])) / (2 * h_small)
                )
                col.n_large.append(
                    (lay.measure(k, c, fl_p[k]) - lay.measure(k, c, fl_m[k])) / (2 * h_large)
                )
                col.right.append((lay.measure(k, c, fp[k]) - m0) / eps)
                col.left.append((m0 - lay.measure(k, c, fm[k])) / eps)
            measured[(i, c)] = col
    for p in failing:
        i, k = index_of_input[p.input], index_of_output[p.output]
        kinds: dict[int, tuple[str, dict[str, Any]]] = {}
        for c in _worst_columns(p):
            kinds[c] = _classify(
                p, c, measured[(i, c)], k, eps=eps, h_small=h_small, h_large=h_large
            )
        found = [kind for kind, _ in kinds.values()]
        if "wrong" in found:
            p.verdict = "backward is wrong"
        elif all(f == "precision" for f in found):
            p.verdict = "float32 precision"
        else:
            p.verdict = "non-differentiable point"
        # the worst column of the chosen kind speaks for the pair
        c = next(c for c in _worst_columns(p) if _KIND_VERDICT[kinds[c][0]] == p.verdict)
        kind, info = kinds[c]
        p.worst = (int(info["row"]), c)
        p.message = _message(
            p, kind, info, xs0[i], eps=eps, h_small=h_small, h_large=h_large, no_graph=no_graph
        )


_KIND_VERDICT = {
    "wrong": "backward is wrong",
    "precision": "float32 precision",
    "kink": "non-differentiable point",
    "near kink": "non-differentiable point",
    "not finite": "non-differentiable point",
}


def _ratio(p: PairCheck) -> np.ndarray:
    diff = np.abs(p.analytic - p.numerical)
    tol = p.atol + p.rtol * np.abs(p.numerical)
    return np.where(np.isfinite(diff), diff / np.maximum(tol, 1e-300), np.inf)


def _worst_columns(p: PairCheck) -> list[int]:
    r = _ratio(p)
    col_score = r.max(axis=0)
    order = np.argsort(-col_score, kind="stable")
    return [int(c) for c in order[:_ANALYZED_COLUMNS] if col_score[c] > 1]


def _classify(
    p: PairCheck, c: int, col: _Column, k: int, *, eps: float, h_small: float, h_large: float
) -> tuple[str, dict[str, Any]]:
    a_all, n_all = p.analytic[:, c], p.numerical[:, c]
    tol_all = p.atol + p.rtol * np.abs(n_all)
    bad = ~(np.abs(a_all - n_all) <= tol_all)
    a, n0, tol = a_all[bad], n_all[bad], tol_all[bad]
    ns, nl = col.n_small[k][bad], col.n_large[k][bad]
    left, right = col.left[k][bad], col.right[k][bad]
    r = int(np.argmax(_ratio(p)[:, c]))  # the element furthest out of tolerance in this column
    info: dict[str, Any] = {
        "row": r,
        "a": a_all[r],
        "n": n_all[r],
        "left": col.left[k][r],
        "right": col.right[k][r],
        "ns": col.n_small[k][r],
        "nl": col.n_large[k][r],
    }
    if not all(np.isfinite(v).all() for v in (a, n0, ns, nl, left, right)):
        return "not finite", info
    e_s, e_0, e_l = (float(np.max(np.abs(a - v))) for v in (ns, n0, nl))
    info.update(e_s=e_s, e_0=e_0, e_l=e_l)
    if (
        e_s > 3 * e_0
        and e_0 > 3 * e_l
        and bool(np.all(np.abs(a - nl) <= p.atol + p.rtol * np.abs(nl) + 0.1 * e_0))
    ):
        return "precision", info
    if bool(np.all(np.abs(a - ns) <= p.atol + p.rtol * np.abs(ns))):
        return "near kink", info
    jump = np.abs(right - left)
    lo, hi = np.minimum(left, right), np.maximum(left, right)
    between = (a >= lo - tol) & (a <= hi + tol)
    if bool(np.all((jump > tol) & (jump >= 0.25 * np.abs(a - n0)) & between)):
        return "kink", info
    return "wrong", info


def _message(
    p: PairCheck,
    kind: str,
    info: dict[str, Any],
    x: torch.Tensor,
    *,
    eps: float,
    h_small: float,
    h_large: float,
    no_graph: bool,
) -> str:
    c = p.worst[1]
    if p.mode == "elements":
        where = f"{p.output}{_idx(p.worst_output_index)} / d {p.input}{_idx(p.worst_input_index)}"
        xval = float(x.reshape(-1)[int(p.cols[c])])
        at = f"{p.input}{_idx(p.worst_input_index)} = {xval:.4g}"
    else:
        where = f"{p.label}, random projection {c}"
        at = f"{p.input} (along random direction {c})"
    a, n = float(info["a"]), float(info["n"])
    if kind == "wrong":
        hint = _wrong_hint(p, no_graph)
        return (
            f"backward is wrong: d {where} is {a:.4g} from the backward but {n:.4g} by "
            f"finite differences "
            f"(max abs error {p.max_abs_error:.2g} over the pair); the finite "
            f"differences are stable from "
            f"eps={h_small:g} to {h_large:g}, so the function is smooth there and the "
            f"backward is to blame" + (f" — {hint}" if hint else "") + "."
        )
    if kind == "precision":
        return (
            f"float32 precision: at {where} the finite-difference error shrinks as eps grows "
            f"({info['e_s']:.2g} at eps={h_small:g}, {info['e_0']:.2g} at {eps:g}, "
            f"{info['e_l']:.2g} at "
            f"{h_large:g}): rounding inside {p.output}'s computation, not the backward."
        )
    if kind == "near kink":
        return (
            f"non-differentiable point: a kink lies within eps={eps:g} of {at}: with "
            f"eps={h_small:g} the "
            f"finite difference ({float(info['ns']):.4g}) agrees with the backward "
            f"({a:.4g}); re-checked with "
            f"eps={h_small:g} and {h_large:g}."
        )
    if kind == "kink":
        return (
            f"non-differentiable point: at {at} the function has a kink (one-sided slopes "
            f"{float(info['left']):.4g} and {float(info['right']):.4g} for d {where}); "
            f"the backward's {a:.4g} "
            f"is one of the one-sided values, the central difference {n:.4g} averages "
            f"them; the same at "
            f"eps={h_small:g} and {h_large:g}."
        )
    return (
        f"non-differentiable point: the function or its derivative is not finite near {at} "
        f"(backward {a:.4g}, finite difference {n:.4g})."
    )


def _wrong_hint(p: PairCheck, no_graph: bool) -> str:
    if no_graph:
        return (
            "the output has no autograd graph at all (fn detaches it, or leaves torch via "
            ".item()/.numpy()/no_grad)"
        )
    a, n = p.analytic, p.numerical
    tol = p.atol + p.rtol * np.abs(n)
    bad = ~(np.abs(a - n) <= tol)
    if np.all(np.abs(a[bad]) <= p.atol):
        return f"the backward gives no gradient for {p.input} where it should (zero or None)"
    if np.all(np.abs(a + n) <= tol):
        return "the backward has the wrong sign"
    big = np.abs(n) > max(p.atol, 1e-8 * float(np.max(np.abs(n))))
    if big.sum() >= 1:
        q = a[big] / n[big]
        m = float(np.median(q))
        if (
            m != 0
            and np.all(np.abs(q - m) <= 1e-3 * abs(m) + 1e-9)
            and np.all(np.abs(a[~big]) <= tol[~big])
        ):
            return (
                f"the backward is {m:.4g} times the true gradient everywhere (a missing or "
                f"extra constant factor)"
            )
    return ""


# --------------------------------------------------------------------------- helpers


def _tensors(obj: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten_with_path(obj)
    return [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]


def _copy_leaf(leaf: Any, dtype: torch.dtype | None) -> Any:
    if not isinstance(leaf, torch.Tensor):
        return leaf
    t = leaf.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.clone(memory_format=torch.contiguous_format)


def _native_dtype(template: Any, module: torch.nn.Module | None) -> torch.dtype | None:
    dts = [t.dtype for t in _tensors(template) if t.is_floating_point()]
    if module is not None:
        dts += [p.dtype for p in module.parameters() if p.is_floating_point()]
    if not dts:
        return None
    return min(dts, key=lambda d: torch.finfo(d).bits)


def _leaf_name(path: Sequence[Any]) -> str:
    """``(0, 1, ...)`` of ``(args, kwargs)`` -> ``"input[1]..."``; kwargs -> ``"key..."``."""
    if not path:
        return "input"
    rest = "".join(_key_text(p) for p in path[2:])
    head, second = path[0], path[1] if len(path) > 1 else None
    if isinstance(head, SequenceKey) and head.idx == 1 and isinstance(second, MappingKey):
        return f"{second.key}{rest}"
    return f"input{_key_text(second) if second is not None else ''}{rest}"


def _key_text(k: Any) -> str:
    if isinstance(k, SequenceKey):
        return f"[{k.idx}]"
    if isinstance(k, MappingKey):
        return f"[{k.key!r}]"
    return str(k)


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    if not shape:
        return ()
    return tuple(int(v) for v in np.unravel_index(flat, shape))


def _idx(index: tuple[int, ...] | None) -> str:
    if not index:
        return ""
    return "[" + ", ".join(str(i) for i in index) + "]"


def _unit(rng: np.random.Generator, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    v = rng.standard_normal(int(np.prod(shape)) if shape else 1)
    v /= np.linalg.norm(v) or 1.0
    return torch.from_numpy(v.reshape(shape)).to(
        like.device, torch.float64 if not like.is_floating_point() else like.dtype
    )


def _checked_text(p: PairCheck) -> str:
    if p.mode == "projections":
        return f"{p.analytic.shape[1]} random projections"
    n_out = int(np.prod(p.output_shape)) if p.output_shape else 1
    n_in = int(np.prod(p.input_shape)) if p.input_shape else 1
    return f"{p.rows.size} of {n_out} outputs x {p.cols.size} of {n_in} inputs"


def _dtype_name(d: torch.dtype | None) -> str:
    return dtype_name(d) if d is not None else "unknown"


def _sentence(e: BaseException) -> str:
    text = str(e).rstrip()
    return text if text.endswith((".", "?", "!")) else text + "."


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _nan_big(v: float) -> float:
    return math.inf if math.isnan(v) else v


def _esc(s: str) -> str:
    import html

    return html.escape(s)


def _in_kernel() -> bool:
    ip_mod = sys.modules.get("IPython")
    if ip_mod is None:
        return False
    ip = ip_mod.get_ipython()  # type: ignore[attr-defined]
    return ip is not None and getattr(ip, "kernel", None) is not None
