"""What a gradient check is asked to do, checked before anything runs: the options
(:class:`GradcheckOptions`), the function (:func:`resolve_fn`) and its inputs
(:func:`check_gradcheck_inputs`). Every bad value gets one sentence that says what was
expected and what was given."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Final, TypeVar

import torch
from torch.utils._pytree import MappingKey, SequenceKey, tree_flatten_with_path

from ...core.batch import describe
from ...core.stats import is_finite_number

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

#: What ``fn`` is called with: ``(args, kwargs)``.
Template = tuple[tuple[Any, ...], dict[str, Any]]

#: what ``wrt`` may be: the inputs, the module's parameters, or both
WRT: Final = ("inputs", "params", "both")


@dataclass(frozen=True)
class GradcheckOptions:
    """How :func:`~nbdebug.gradcheck` and :func:`~nbdebug.gradcheck_modules` check.

    Attributes
    ----------
    eps : float
        Finite-difference step, > 0.
    atol, rtol : float
        An element passes when ``|analytic - numerical| <= atol + rtol * |numerical|``.
    wrt : {"inputs", "params", "both"}
    second_order : bool
        Also check the backward itself (like ``torch.autograd.gradgradcheck``).
    max_elements : int
        An input or output with more elements has a seeded random subset checked.
    fast : bool
        Random projections ``u^T J v`` instead of elements.
    random_state : int
        Seed of the subsets, projections and second-order ``grad_output``.
    native_check : bool
        Also run the check in the inputs' own dtype when it is below float64.
    all_float : bool
        Differentiate every finite floating-point input, whether or not it requires grad
        (the module sweep: an additive ``-inf`` mask stays a constant).
    param_recurse : bool
        With ``wrt`` "params"/"both": the parameters of submodules too (``False``: the
        module's own parameters, as in the sweep).
    fixed_seed : int or None
        Re-seed torch's generators before every evaluation, so random operations (dropout)
        see one fixed mask.

    Examples
    --------
    >>> GradcheckOptions(eps=1e-7, wrt="both").validate().eps
    1e-07
    """

    eps: float = 1e-6
    atol: float = 1e-5
    rtol: float = 1e-3
    wrt: str = "inputs"
    second_order: bool = False
    max_elements: int = 512
    fast: bool = False
    random_state: int = 0
    native_check: bool = True
    all_float: bool = False
    param_recurse: bool = True
    fixed_seed: int | None = None

    def for_module_sweep(self) -> GradcheckOptions:
        """These options as one module of :func:`~nbdebug.gradcheck_modules` checks with
        them: inputs and own parameters, every finite float input, one fixed dropout mask
        (seeded with ``random_state``), no native re-check."""
        return replace(
            self,
            wrt="both",
            native_check=False,
            all_float=True,
            param_recurse=False,
            fixed_seed=self.random_state,
        )

    def validate(self) -> GradcheckOptions:
        """Check every option; returns ``self``.

        Raises
        ------
        ValueError
            In one sentence, for the first bad option: what was expected and what was given.
        """
        if not is_finite_number(self.eps) or self.eps <= 0:
            raise ValueError(f"eps must be > 0 and finite; got {self.eps!r}.")
        for name in ("atol", "rtol"):
            v = getattr(self, name)
            if not is_finite_number(v) or v < 0:
                raise ValueError(f"{name} must be a finite number >= 0; got {v!r}.")
        if self.wrt not in WRT:
            raise ValueError(f"wrt must be one of {WRT}; got {self.wrt!r}.")
        if not _is_int(self.max_elements) or self.max_elements < 1:
            raise ValueError(f"max_elements must be a positive int; got {self.max_elements!r}.")
        for name in ("random_state", "fixed_seed"):
            v = getattr(self, name)
            if (v is not None or name == "random_state") and (not _is_int(v) or v < 0):
                allowed = "an int >= 0" + (" or None" if name == "fixed_seed" else "")
                raise ValueError(f"{name} must be {allowed}; got {v!r}.")
        for name in ("second_order", "fast", "native_check", "all_float", "param_recurse"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be True or False; got {v!r}.")
        return self


#: The keyword arguments of :func:`~nbdebug.gradcheck`: the first fields of
#: :class:`GradcheckOptions` (the others are the module sweep's).
GRADCHECK_KEYWORDS: Final = (
    "eps",
    "atol",
    "rtol",
    "wrt",
    "second_order",
    "max_elements",
    "fast",
    "random_state",
    "native_check",
)


def _is_int(v: object) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def resolve_fn(fn: object) -> tuple[torch.nn.Module | None, Callable[..., object], str]:
    """``(module or None, what to call, name)`` for a function, an
    ``autograd.Function.apply``, a module or a module's bound ``forward``."""
    if isinstance(fn, type) and issubclass(fn, torch.autograd.Function):
        raise TypeError(
            f"fn must be callable on tensors; got the autograd.Function class {fn.__name__}: "
            f"pass {fn.__name__}.apply."
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
            "fn must be a function, an autograd.Function.apply or an nn.Module; got "
            f"{type(fn).__qualname__}."
        )
    owner_name = getattr(owner, "__name__", None)
    name = getattr(fn, "__name__", None) or type(fn).__name__
    if name == "apply" and owner_name:
        name = f"{owner_name}.apply"
    return None, fn, str(name)


def check_gradcheck_inputs(
    template: Template, *, module: torch.nn.Module | None, wrt: str, fn_name: str
) -> None:
    """Something to differentiate with ``wrt``, and no complex, integer-only or
    ``requires_grad=False``-only inputs. ``template`` is ``(args, kwargs)``."""
    leaves = [(leaf_name(path), leaf) for path, leaf in tree_flatten_with_path(template)[0]]
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
                    "requires_grad=True."
                )
            return
        if has_params:
            return
    diff = [(n, t) for n, t in tensors if t.is_floating_point() and t.requires_grad]
    if diff and all(t.numel() == 0 for _, t in diff):
        shapes = ", ".join(f"{n}: {tuple(t.shape)}" for n, t in diff)
        raise ValueError(
            "gradcheck needs an input with elements to differentiate; every input with "
            f"requires_grad=True is empty ({shapes}), so nothing would be checked."
        )
    if diff:
        return
    hint = " (or wrt='params' to check the module's parameters)" if module is not None else ""
    if not tensors:
        given = describe(template[0]) if template[0] else "no inputs"
        raise ValueError(
            "gradcheck needs at least one floating-point input tensor with requires_grad=True; "
            f"got {given}{hint}."
        )
    floats = [(n, t) for n, t in tensors if t.is_floating_point()]
    if not floats:
        kinds = ", ".join(f"{n}: {str(t.dtype).replace('torch.', '')}" for n, t in tensors)
        raise TypeError(
            "gradcheck differentiates floating-point tensors, but the inputs are integer or "
            f"boolean ({kinds}), which have no gradient; pass float inputs with "
            f"requires_grad=True, e.g. x.double().requires_grad_(){hint}."
        )
    names = ", ".join(n for n, _ in floats)
    raise ValueError(
        "no input requires grad: gradcheck checks the gradient with respect to inputs with "
        f"requires_grad=True, and {names} {'has' if len(floats) == 1 else 'have'} "
        f"requires_grad=False; call .requires_grad_() on the inputs to check{hint}."
    )


def leaf_name(path: Sequence[object]) -> str:
    """A pytree path into ``(args, kwargs)`` as a name: ``(0, 1, ...)`` -> ``"input[1]..."``;
    a keyword argument -> ``"key..."``."""
    if not path:
        return "input"
    rest = "".join(_key_text(p) for p in path[2:])
    head, second = path[0], path[1] if len(path) > 1 else None
    if isinstance(head, SequenceKey) and head.idx == 1 and isinstance(second, MappingKey):
        return f"{second.key}{rest}"
    return f"input{_key_text(second) if second is not None else ''}{rest}"


def _key_text(k: object) -> str:
    if isinstance(k, SequenceKey):
        return f"[{k.idx}]"
    if isinstance(k, MappingKey):
        return f"[{k.key!r}]"
    return str(k)
