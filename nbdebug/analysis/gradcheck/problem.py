"""The function under check as a :class:`Problem`: ``fn`` as a function of a list of
differentiable float64 (or native-dtype) copies, called on fresh copies every time, so the
user's module and tensors are never touched; and the second-order problem built from it
(the backward as a function of the inputs and ``grad_output``, like ``gradgradcheck``)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten_with_path, tree_unflatten

from ...core.batch import describe, named_tensors
from ...core.stats import has_nonfinite
from ...core.text import first_line
from .inputs import GradcheckOptions, Template, leaf_name


class FnRaised(Exception):
    """``fn`` (or its backward) raised; carries the sentence to show."""


def sentence(e: BaseException) -> str:
    """An exception's text ending in a full stop."""
    text = str(e).rstrip()
    return text if text.endswith((".", "?", "!")) else text + "."


def raised(what: str, e: BaseException) -> FnRaised:
    """``FnRaised("<what> raised KeyError: <first line>")``."""
    return FnRaised(f"{what} raised {first_line(e)}")


def leaf_tensors(obj: object) -> list[torch.Tensor]:
    """The tensor leaves of ``obj`` in pytree order (what a :class:`Problem` can
    differentiate)."""
    leaves, _ = tree_flatten_with_path(obj)
    return [leaf for _, leaf in leaves if isinstance(leaf, torch.Tensor)]


def native_dtype(template: Template, module: torch.nn.Module | None) -> torch.dtype | None:
    """The lowest-precision floating-point dtype among the inputs and parameters."""
    dts = [t.dtype for t in leaf_tensors(template) if t.is_floating_point()]
    if module is not None:
        dts += [p.dtype for p in module.parameters() if p.is_floating_point()]
    if not dts:
        return None
    return min(dts, key=lambda d: torch.finfo(d).bits)


@dataclass
class Problem:
    """``fn`` as a function of a list of differentiable tensors.

    Attributes
    ----------
    call : callable
        ``call(xs)`` runs ``fn`` with the differentiable tensors replaced by ``xs``.
    diff : list of torch.Tensor
        The point of the check (detached copies).
    names : list of str
        One per tensor of ``diff``: ``"input[0]"``, a keyword or a parameter name.
    out_names, out_shapes
        The floating-point outputs, fixed by the first call.
    """

    call: Callable[[list[torch.Tensor]], Any]
    diff: list[torch.Tensor]
    names: list[str]
    fn_name: str
    fixed_seed: int | None
    out_names: list[str] | None = None
    out_shapes: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def cuda_devices(self) -> list[int]:
        return sorted({t.device.index or 0 for t in self.diff if t.is_cuda})

    @contextlib.contextmanager
    def seeded(self) -> Iterator[None]:
        """Every evaluation sees the same random numbers (one fixed dropout mask); the
        caller restores the user's RNG state once at the end."""
        if self.fixed_seed is not None:
            torch.default_generator.manual_seed(self.fixed_seed)
            for d in self.cuda_devices:
                torch.cuda.default_generators[d].manual_seed(self.fixed_seed)
        yield

    def outputs(self, xs: Sequence[torch.Tensor], *, grad: bool = False) -> list[torch.Tensor]:
        """The floating-point tensors of ``fn``'s output, in a fixed order."""
        mode = torch.enable_grad() if grad else torch.no_grad()
        try:
            with mode, self.seeded():
                raw = self.call(list(xs))
        except FnRaised:
            raise
        except Exception as e:
            raise raised(self.fn_name, e) from e
        named = list(named_tensors(raw, "output"))
        if self.out_names is None:
            if not named:
                raise TypeError(
                    f"{self.fn_name} must return a tensor or a tuple/list/dict of tensors; it "
                    f"returned {describe(raw)}."
                )
            floats = [(n, t) for n, t in named if t.is_floating_point()]
            if not floats:
                raise TypeError(
                    f"{self.fn_name} returned no floating-point tensor to differentiate: "
                    f"{describe(raw)}."
                )
            self.out_names = [n for n, _ in floats]
            self.out_shapes = [tuple(t.shape) for _, t in floats]
        got = dict(named)
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
        """The outputs at ``xs``, flat, float64, detached."""
        return [o.detach().reshape(-1).to(torch.float64) for o in self.outputs(xs)]


class GradProblem(Problem):
    """A second-order problem: its outputs are the list of gradients, one per input."""

    def outputs(self, xs: Sequence[torch.Tensor], *, grad: bool = False) -> list[torch.Tensor]:
        try:
            with torch.enable_grad(), self.seeded():
                return list(self.call(list(xs)))
        except FnRaised:
            raise
        except Exception as e:
            raise raised(f"the backward of {self.fn_name}", e) from e


def make_problem(
    target: Callable[..., object],
    module: torch.nn.Module | None,
    template: Template,
    options: GradcheckOptions,
    *,
    dtype: torch.dtype | None,
    fn_name: str,
) -> Problem:
    """``target`` called on ``template = (args, kwargs)`` as a :class:`Problem` in ``dtype``
    (``None``: the inputs' own), differentiated as ``options`` say (``wrt``,
    ``all_float``, ``param_recurse``, ``fixed_seed``). A module runs as a deep copy."""
    with_path, spec = tree_flatten_with_path(template)
    leaves = [_copy_leaf(leaf, dtype) for _, leaf in with_path]
    specs: list[tuple[str, Any]] = []
    names: list[str] = []
    diff: list[torch.Tensor] = []
    if options.wrt in ("inputs", "both"):
        for idx, (path, leaf) in enumerate(with_path):
            if not (isinstance(leaf, torch.Tensor) and leaf.is_floating_point()):
                continue
            # the sweep differentiates every finite float input (an additive -inf mask is a
            # constant)
            if leaf.requires_grad if not options.all_float else not has_nonfinite(leaf):
                specs.append(("leaf", idx))
                names.append(leaf_name(path))
                diff.append(leaves[idx])  # type: ignore[arg-type]  # a tensor's copy
    mod = None
    if module is not None:
        try:
            mod = copy.deepcopy(module)
        except Exception as e:
            raise ValueError(
                f"{fn_name} cannot be copied to check it without touching it ({first_line(e)})."
            ) from e
        if dtype is not None:
            mod.to(dtype)
        if options.wrt in ("params", "both"):
            for pname, p in mod.named_parameters(recurse=options.param_recurse):
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

    return Problem(
        call, [d.detach() for d in diff], names, fn_name=fn_name, fixed_seed=options.fixed_seed
    )


def second_order_problem(p: Problem, seed: int) -> Problem:
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
            raise FnRaised(f"the backward of {p.fn_name} is marked @once_differentiable")
        return [g if g is not None else torch.zeros_like(x) for g, x in zip(grads, x_in)]

    v_names = [f"grad_output {o}" if len(out_names) > 1 else "grad_output" for o in out_names]
    return GradProblem(
        call,
        [*p.diff, *vs],
        [*p.names, *v_names],
        fn_name=p.fn_name,
        fixed_seed=p.fixed_seed,
        out_names=[f"grad {nm}" for nm in p.names],
        out_shapes=[tuple(x.shape) for x in p.diff],
    )


def _copy_leaf(leaf: object, dtype: torch.dtype | None) -> object:
    if not isinstance(leaf, torch.Tensor):
        return leaf
    t = leaf.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.clone(memory_format=torch.contiguous_format)
