"""The fix menu of :func:`nbdebug.diagnose`: small objects that change one thing in a replay.

Each fix has a ``kind`` from :data:`KINDS`, the ``module`` it is aimed at (a qualified
name as in ``model.named_modules()``, ``""`` for the whole model, ``None`` when it is aimed
at the batch, the loss or the optimizer) and the batch ``rows`` it is aimed at, and three
methods:

``applies(trace) -> bool``
    Whether the fix makes sense for the traced failing step.
``apply(replay)``
    A context manager that changes the :class:`Replay` (the copies a replay runs on: model,
    optimizer, batch, loss function, scaler) and undoes its change on exit. Nothing outside
    the replay is touched.
``describe() -> str``
    What is changed, in words; :meth:`Fix.snippet` gives it as code to paste.

A user fix subclasses :class:`Fix` (or has the same attributes) and is passed in
``diagnose(..., fixes=[...])``.
"""

from __future__ import annotations

import ast
import linecache
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, resolve_name

from ..core.batch import named_tensors
from ..core.origin_ops import composite_body
from ..core.text import rows_text

#: The documented fix kinds.
KINDS = (
    "epsilon",  # an epsilon or clamp on the root operation
    "drop_rows",  # the batch rows that hold or produce the NaN dropped
    "float32",  # a module (or the model) run in float32, autocast off
    "clip_grad",  # gradient clipping at the recent gradient norm
    "lower_lr",  # the learning rate x0.1 for the update
    "scaler",  # a GradScaler with a lower scale
    "weights_corrupted",  # the weights were non-finite before the step
    "not_reproducible",  # a plain re-run of the same step
    "custom",  # a user's fix of no other kind
)

# lower is more local: one op, a few rows, one module, the model, the update
LOCALITY = {
    "epsilon": 0.0,
    "drop_rows": 1.0,
    "float32": 2.0,
    "custom": 2.5,
    "scaler": 4.0,
    "clip_grad": 4.0,
    "lower_lr": 4.0,
    "weights_corrupted": 9.0,
    "not_reproducible": 9.0,
}

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TORCH_DIR = os.path.dirname(torch.__file__)
_STDLIB_DIR = os.path.dirname(os.__file__)


@contextmanager
def forward_replaced(m: torch.nn.Module, wrap: Callable[..., Any]) -> Iterator[None]:
    """For the block, module ``m`` runs ``wrap(m.forward)`` instead of its ``forward`` (an
    instance attribute); the module's own attribute state is put back afterwards."""
    had = "forward" in m.__dict__
    old = m.__dict__.get("forward")
    m.forward = wrap(m.forward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if had:
            m.forward = old  # type: ignore[method-assign, assignment]
        else:
            del m.forward


# ---------------------------------------------------------------------- the replay
@dataclass
class Replay:
    """What one replay of the failing step runs on: copies, never the user's objects.

    Attributes
    ----------
    model : torch.nn.Module
        A copy of the model holding the weights of the failing step.
    optimizer : torch.optim.Optimizer or None
        A copy of the optimizer over ``model``'s parameters, with the step's state.
    inputs, target
        The batch (the replay's own references; a fix may replace them).
    loss_fn : callable or None
    scaler : torch.amp.GradScaler or None
        A fresh scaler with the step's state.
    lr_factor : float
        The learning rate of every group is multiplied by this for the update.
    clip_norm : float or None
        Clip the total gradient norm to this before the update.
    batch_size : int or None
    autocast : bool
        Run the step under its recorded autocast state (``False``: the whole step in the
        model's own dtypes).
    """

    model: torch.nn.Module
    optimizer: Any = None
    inputs: Any = None
    target: Any = None
    loss_fn: Callable[..., Any] | None = None
    scaler: Any = None
    lr_factor: float = 1.0
    clip_norm: float | None = None
    batch_size: int | None = None
    autocast: bool = True

    def module(self, name: str) -> torch.nn.Module:
        """The module of the replay's model with qualified name ``name`` (``""``: the model)."""
        modules = dict(self.model.named_modules())
        if name not in modules:
            raise ValueError(f"the model has no module named {name!r}.")
        return modules[name]

    @contextmanager
    def around_forward(self, name: str, make: Callable[[], Any]) -> Iterator[None]:
        """Run the ``forward`` of module ``name`` inside the context manager ``make()``
        for the duration of the block (an instance attribute on the replay's copy)."""

        def wrap(inner: Callable[..., Any]) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                with make():
                    return inner(*args, **kwargs)

            return forward

        with forward_replaced(self.module(name), wrap):
            yield

    @contextmanager
    def around_loss(self, make: Callable[[], Any]) -> Iterator[None]:
        """Run the loss computation inside ``make()`` for the duration of the block."""
        inner = self.loss_fn
        if inner is None:
            # the loss is part of the model's output: the model's own code computes it
            with self.around_forward("", make):
                yield
            return

        def loss_fn(*args: Any, **kwargs: Any) -> Any:
            with make():
                return inner(*args, **kwargs)

        self.loss_fn = loss_fn
        try:
            yield
        finally:
            self.loss_fn = inner


# ---------------------------------------------------------------------- base class
class Fix:
    """A candidate fix. Subclass it and override :meth:`apply` (and :meth:`applies`,
    :meth:`describe`, :meth:`snippet`) for a fix of your own.

    Attributes
    ----------
    kind : str
        One of :data:`KINDS`.
    module : str or None
        The module it changes (``""``: the model; ``None``: the batch, loss or optimizer).
    rows : list of int
        The batch rows it is aimed at (empty: all).
    op : str or None
        For an epsilon: the operation rewritten (``"div"``, ``"log"``, ...).
    locality : float
        Lower is more local (one op < rows < a module < the model < the update): the
        ranking prefers the most local fix that makes the step finite.
    """

    kind: str = "custom"
    module: str | None = None
    rows: list[int]
    op: str | None = None
    locality: float | None = None

    def __init__(self) -> None:
        self.rows = []

    def applies(self, trace: Any) -> bool:
        """Whether this fix makes sense for ``trace`` (the failing step)."""
        return True

    def why_not(self, trace: Any) -> str:
        """One sentence saying why :meth:`applies` is false."""
        return f"the fix {self.describe()} does not apply to this step."

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        """Change ``replay`` for the duration of the block (and undo it on exit)."""
        yield

    def describe(self) -> str:
        """What the fix changes, in words."""
        return type(self).__name__

    def snippet(self) -> str:
        """The change as code the user can paste."""
        return ""

    @property
    def rank_locality(self) -> float:
        if self.locality is not None:
            return float(self.locality)
        return LOCALITY.get(self.kind, 2.5)

    def __repr__(self) -> str:
        where = "" if self.module is None else f" in {self.module or '<model>'}"
        rows = f" rows {self.rows}" if self.rows else ""
        return f"{type(self).__name__}({self.kind}{where}{rows}: {self.describe()})"


def _where(module: str | None) -> str:
    return "the model" if module == "" else (module or "")


# ---------------------------------------------------------------------- op rewriting
_FAMILIES = {
    "div": "div",
    "truediv": "div",
    "rtruediv": "div",
    "rdiv": "div",
    "true_divide": "div",
    "divide": "div",
    "div_": "div",
    "truediv_": "div",
    "idiv": "div",
    "itruediv": "div",
    "reciprocal": "div",
    "log": "log",
    "log2": "log",
    "log10": "log",
    "log_": "log",
    "sqrt": "sqrt",
    "rsqrt": "sqrt",
    "sqrt_": "sqrt",
    "exp": "exp",
    "exp_": "exp",
    "exp2": "exp",
    "softmax": "softmax",
    "log_softmax": "softmax",
    "scaled_dot_product_attention": "softmax",
}


def op_family(op: str | None) -> str | None:
    """The fixable family of an operation name (``"Tensor.__truediv__"`` -> ``"div"``,
    ``"torch.log"`` -> ``"log"``, ``"torch.nn.functional.softmax"`` -> ``"softmax"``), or
    ``None`` when an epsilon or clamp cannot fix it."""
    if not op:
        return None
    name = op.split("(")[0].strip().rsplit(".", 1)[-1]
    if name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return _FAMILIES.get(name) or _FAMILIES.get(name.lstrip("_"))


def func_family(func: Any) -> str | None:
    try:
        name = resolve_name(func) or getattr(func, "__name__", "")
    except Exception:  # pragma: no cover - exotic callables
        name = getattr(func, "__name__", "")
    return op_family(name)


def default_eps(dtype: torch.dtype) -> float:
    """The epsilon used for ``dtype``: 1e-6, or 1e-3 in half precision (1e-6 is below
    float16's normal range and its reciprocal above its maximum)."""
    return 1e-3 if dtype in (torch.float16, torch.bfloat16) else 1e-6


def _bad(t: Any) -> bool:
    return (
        isinstance(t, torch.Tensor)
        and (t.is_floating_point() or t.is_complex())
        and t.numel() > 0
        and not bool(torch.isfinite(t).all())
    )


def caller_line() -> tuple[str, int] | None:
    """(filename, line) of the innermost frame outside torch, the standard library and
    nbdebug: the user's code that called the current torch operation."""
    f: Any = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not fn.startswith((_PKG_DIR, _TORCH_DIR, _STDLIB_DIR)) and not fn.startswith("<frozen"):
            return fn, f.f_lineno
        f = f.f_back
    return None


class RewriteMode(TorchFunctionMode):
    """Rewrites the arguments of one family of torch operations:

    * ``div``: a tensor denominator ``d`` becomes ``d + eps`` (``d - eps`` where ``d < 0``);
    * ``log``, ``sqrt``: the input becomes ``x.clamp_min(eps)``;
    * ``exp``: where the result overflows, ``exp(x - max(x))`` over the last dimension;
    * ``softmax``: rows that come out NaN (every entry masked) become zeros.

    ``calls`` counts the rewritten calls; ``lines`` collects the callers' ``(file, line)``.
    """

    def __init__(self, family: str, eps: float | None = None):
        super().__init__()
        self.family = family
        self.eps = eps
        self.calls = 0
        self.lines: list[tuple[str, int]] = []

    def _eps(self, t: torch.Tensor) -> float:
        return self.eps if self.eps is not None else default_eps(t.dtype)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        fam = func_family(func)
        if fam != self.family:
            body = composite_body(func)
            if body is None:
                return func(*args, **kwargs)
            # a composite (F.normalize, attention): its own ops, where the trace's root is
            with self:
                return body(*args, **kwargs)
        out = self._rewrite(func, fam, list(args), dict(kwargs))
        return out

    def _note(self) -> None:
        self.calls += 1
        where = caller_line()
        if where is not None and where not in self.lines:
            self.lines.append(where)

    def _rewrite(self, func: Any, fam: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        name = getattr(func, "__name__", "")
        if fam == "div":
            if kwargs.get("rounding_mode") is not None:
                return func(*args, **kwargs)
            pos = 0 if name in ("__rtruediv__", "__rdiv__", "reciprocal", "reciprocal_") else 1
            if name in ("reciprocal", "reciprocal_"):
                d = args[0]
                if isinstance(d, torch.Tensor) and d.is_floating_point():
                    self._note()
                    return 1.0 / _away_from_zero(d, self._eps(d))
                return func(*args, **kwargs)
            key = "other" if "other" in kwargs else None
            d = kwargs[key] if key else (args[pos] if len(args) > pos else None)
            if isinstance(d, torch.Tensor) and d.is_floating_point():
                new = _away_from_zero(d, self._eps(d))
                if key:
                    kwargs[key] = new
                else:
                    args[pos] = new
                self._note()
            return func(*args, **kwargs)
        if fam in ("log", "sqrt"):
            key = "input" if "input" in kwargs else None
            x = kwargs[key] if key else args[0]
            if isinstance(x, torch.Tensor) and x.is_floating_point():
                new = x.clamp_min(self._eps(x))
                if key:
                    kwargs[key] = new
                else:
                    args[0] = new
                self._note()
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if fam == "exp":
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, torch.Tensor) and not _bad(x) and (_bad(out) or underflows(out)):
                self._note()
                if x.dim() == 0:
                    return torch.exp(x.clamp_max(math.log(torch.finfo(x.dtype).max)))
                return torch.exp(x - x.detach().amax(dim=-1, keepdim=True))
            return out
        # softmax: NaN where no input was NaN = a fully masked row
        x = args[0] if args else kwargs.get("input", kwargs.get("query"))
        outs = [t for _, t in named_tensors(out)]
        if outs and isinstance(outs[0], torch.Tensor) and bool(torch.isnan(outs[0]).any()):
            o = outs[0]
            made = torch.isnan(o)
            if isinstance(x, torch.Tensor) and x.shape == o.shape:
                made = made & ~torch.isnan(x)
            if bool(made.any()):
                self._note()
                if isinstance(x, torch.Tensor) and x.shape == o.shape:
                    # the masked rows' scores made finite first, so that the backward
                    # through them is 0, not NaN (softmax's backward reads its output)
                    a = list(args)
                    safe = torch.where(made, torch.zeros_like(x), x)
                    if a:
                        a[0] = safe
                    else:
                        kwargs = {**kwargs, "input": safe}
                    o = func(*a, **kwargs)
                    o = o if isinstance(o, torch.Tensor) else next(t for _, t in named_tensors(o))
                fixed = torch.where(made, torch.zeros_like(o), o)
                return fixed if isinstance(out, torch.Tensor) else (fixed, *out[1:])
        return out


def underflows(out: Any) -> bool:
    """Whether a row (the last dimension) of an ``exp`` result is all zeros: a softmax
    written by hand then divides 0 by 0."""
    if not isinstance(out, torch.Tensor) or out.dim() == 0 or out.numel() == 0:
        return False
    return bool((out == 0).all(dim=-1).any())


def _away_from_zero(d: torch.Tensor, eps: float) -> torch.Tensor:
    """``d + eps`` where ``d >= 0`` and ``d - eps`` where ``d < 0``."""
    return d + torch.where(d < 0, -eps, eps).to(d.dtype)


# ---------------------------------------------------------------------- snippets
_TEMPLATES = {
    "div": "x / (d + eps)",
    "log": "torch.log(x.clamp_min(eps))",
    "sqrt": "torch.sqrt(x.clamp_min(eps))",
    "exp": "torch.exp(x - x.amax(dim=-1, keepdim=True))  # or torch.logsumexp / F.softmax",
    "softmax": "p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0",
}
_METHODS = {"log": "log", "sqrt": "sqrt", "exp": "exp"}


def rewrite_line(line: str, family: str, eps: float) -> str | None:
    """The source ``line`` with every operation of ``family`` on it rewritten (the epsilon
    in place), or ``None`` when the line cannot be parsed or holds no such operation.
    Every one, as the replay patches them all: which of two ``log`` calls on a line got
    the 0 is not known from the line, and a pasted fix must make the step finite."""
    text = line.strip()
    indent = line[: len(line) - len(line.lstrip())]
    if text.endswith(":"):
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    e = ast.Constant(eps)
    done = False

    class T(ast.NodeTransformer):
        def visit_BinOp(self, node: ast.BinOp) -> Any:
            nonlocal done
            self.generic_visit(node)
            div = family == "div" and isinstance(node.op, ast.Div)
            if div and not isinstance(node.right, ast.Constant):
                node.right = ast.BinOp(node.right, ast.Add(), e)
                done = True
            return node

        def visit_Call(self, node: ast.Call) -> Any:
            nonlocal done
            self.generic_visit(node)
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if family == "div" and name == "normalize":  # F.normalize(x, eps=0): its eps
                node.keywords = [k for k in node.keywords if k.arg != "eps"]
                node.args = node.args[:3]  # input, p, dim (eps is the fourth)
                node.keywords.append(ast.keyword("eps", e))
                done = True
                return node
            if family not in _METHODS or name not in (family, family + "_", "rsqrt"):
                return node
            if family == "exp":
                base = node.args[0] if node.args else getattr(f, "value", None)
                if base is None:
                    return node
                amax = ast.parse("_.amax(dim=-1, keepdim=True)").body[0].value  # type: ignore[attr-defined]
                amax.func.value = base
                shifted: ast.expr = ast.BinOp(base, ast.Sub(), amax)
            else:
                base = node.args[0] if node.args else getattr(f, "value", None)
                if base is None:
                    return node
                shifted = ast.Call(ast.Attribute(base, "clamp_min"), [e], [])
            if node.args:
                node.args[0] = shifted
            elif isinstance(f, ast.Attribute):
                f.value = shifted
            done = True
            return node

    new = T().visit(tree)
    if not done:
        return None
    return indent + ast.unparse(ast.fix_missing_locations(new))


# ---------------------------------------------------------------------- the menu
class EpsilonFix(Fix):
    """An epsilon or clamp on the root operation, inside one module (or the loss).

    Parameters
    ----------
    module : str or None
        The module whose forward is run under :class:`RewriteMode`; ``None``: the loss.
    family : {"div", "log", "sqrt", "exp", "softmax"}
    source : str, optional
        ``"file.py:line"`` of the operation (for the text and the snippet).
    eps : float, optional
        Default: :func:`default_eps` of each tensor's dtype.
    """

    kind = "epsilon"

    def __init__(
        self,
        module: str | None,
        family: str,
        *,
        source: str | None = None,
        filename: str | None = None,
        eps: float | None = None,
        module_type: str = "",
    ):
        super().__init__()
        if family not in _TEMPLATES:
            raise ValueError(f"family must be one of {sorted(_TEMPLATES)}; got {family!r}.")
        self.module = module
        self.op = family
        self.source = source
        self.filename = filename
        self.eps = eps
        self.module_type = module_type
        self.rewritten = 0
        self.order = 0  # among the epsilons of one step: the root (first executed) is 0

    @property
    def rank_locality(self) -> float:
        if self.locality is not None:
            return float(self.locality)
        return LOCALITY["epsilon"] + 0.01 * min(self.order, 50)

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        mode_holder: list[RewriteMode] = []

        def make() -> RewriteMode:
            m = RewriteMode(str(self.op), self.eps)
            mode_holder.append(m)
            return m

        ctx = (
            replay.around_loss(make)
            if self.module is None
            else replay.around_forward(self.module, make)
        )
        with ctx:
            try:
                yield
            finally:
                self.rewritten = sum(m.calls for m in mode_holder)

    def _place(self) -> str:
        if self.module is None:
            where = "the loss function"
        else:
            where = f"{self.module or '<model>'}" + (
                f" ({self.module_type})" if self.module_type else ""
            )
        return where + (f" at {self.source}" if self.source else "")

    def describe(self) -> str:
        what = {
            "div": "an epsilon in the denominator of the division",
            "log": "log(x.clamp_min(eps))",
            "sqrt": "sqrt(x.clamp_min(eps))",
            "exp": "exp(x - max) (the overflow-safe softmax)",
            "softmax": "softmax with fully masked rows zeroed",
        }[str(self.op)]
        return f"{what} in {self._place()}"

    def snippet(self) -> str:
        eps = self.eps if self.eps is not None else 1e-6
        where = f"# {self.source}" if self.source else f"# in {self._place()}"
        line = self._line()
        if line:
            new = rewrite_line(line, str(self.op), eps) if self.op != "softmax" else None
            if new:
                return f"{where}\n# was: {line.strip()}\n{new.strip()}"
            return f"{where}: {line.strip()}\n{_TEMPLATES[str(self.op)].replace('eps', repr(eps))}"
        return f"{where}\n{_TEMPLATES[str(self.op)].replace('eps', repr(eps))}"

    def _line(self) -> str:
        if not self.filename or not self.source or ":" not in self.source:
            return ""
        try:
            n = int(self.source.rsplit(":", 1)[1])
        except ValueError:
            return ""
        return linecache.getline(self.filename, n)


class DropRowsFix(Fix):
    """The batch without the given rows (every tensor of the batch and the target whose
    first dimension is the batch size)."""

    kind = "drop_rows"

    def __init__(self, rows: list[int]):
        super().__init__()
        self.rows = sorted({int(r) for r in rows})
        # the batch's form, for the snippet: inputs "tensor", "dict" or "seq", whether a
        # target tensor goes with them, the batch size
        self._form: tuple[str, bool, int | None] = ("tensor", True, None)

    def applies(self, trace: Any) -> bool:
        bs = getattr(trace, "batch_size", None)
        return bool(self.rows) and bs is not None and len(self.rows) < bs

    def why_not(self, trace: Any) -> str:
        bs = getattr(trace, "batch_size", None)
        return f"dropping rows {self.rows} leaves no batch (batch size {bs})."

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        bs = replay.batch_size
        if bs is None:
            raise ValueError("the batch has no batch dimension: no rows to drop.")
        keep = torch.tensor([i for i in range(bs) if i not in set(self.rows)], dtype=torch.long)
        old = replay.inputs, replay.target
        form = (
            "dict"
            if isinstance(old[0], dict)
            else "seq"
            if isinstance(old[0], (tuple, list))
            else "tensor"
        )
        self._form = (form, isinstance(old[1], torch.Tensor), bs)
        replay.inputs = _select(replay.inputs, keep, bs)
        replay.target = _select(replay.target, keep, bs)
        try:
            yield
        finally:
            replay.inputs, replay.target = old

    def describe(self) -> str:
        return f"drop batch {rows_text(self.rows, None)}"

    def snippet(self) -> str:
        """The code for the batch as the step had it: a tensor ``x`` (and ``y``), a dict
        ``batch`` (a Hugging Face batch, labels in it) or a tuple ``inputs``."""
        form, target, bs = self._form
        row = "isinstance(v, torch.Tensor) and len(v) == len(keep)"
        take = {
            "tensor": "x = x[keep]",
            "dict": f"batch = {{k: v[keep] if {row} else v for k, v in batch.items()}}",
            "seq": f"inputs = [v[keep] if {row} else v for v in inputs]",
        }[form]
        if target:
            take = "x, y = x[keep], y[keep]" if form == "tensor" else f"{take}\ny = y[keep]"
        size = "x.shape[0]" if form == "tensor" or bs is None else str(bs)
        return (
            f"bad = torch.tensor({self.rows})\n"
            f"keep = torch.ones({size}, dtype=torch.bool); keep[bad] = False\n"
            f"{take}  # and find out why these rows are bad"
        )


def _select(obj: Any, keep: torch.Tensor, bs: int) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.dim() >= 1 and obj.shape[0] == bs:
            return obj.index_select(0, keep.to(obj.device))
        return obj
    if isinstance(obj, dict):
        return {k: _select(v, keep, bs) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        items = [_select(v, keep, bs) for v in obj]
        if hasattr(obj, "_fields"):
            return type(obj)(*items)
        return type(obj)(items)
    return obj


class Float32Fix(Fix):
    """Run one module (``""``: the whole model) in float32 with autocast off: its
    parameters, buffers and floating inputs are cast to float32, its output back to the
    dtype it had (the model's output stays float32)."""

    kind = "float32"

    def __init__(self, module: str = "", *, depth: int = 0, module_type: str = ""):
        super().__init__()
        self.module = module
        self.depth = depth
        self.module_type = module_type

    @property
    def rank_locality(self) -> float:
        if self.locality is not None:
            return float(self.locality)
        # a deeper module is more local; the whole model least
        return 3.0 if self.module == "" else 2.0 + 1.0 / (2.0 + self.depth)

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        m = replay.module(str(self.module))
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t in [*m.parameters(), *m.buffers()]:
            if t.is_floating_point() and t.dtype != torch.float32:
                saved.append((t, t.data))
                t.data = t.data.float()
        opt_saved: list[tuple[dict[str, Any], str, Any]] = []
        if replay.optimizer is not None:
            changed = {id(t) for t, _ in saved}
            for p, st in replay.optimizer.state.items():
                if id(p) in changed:
                    for k, v in list(st.items()):
                        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0:
                            opt_saved.append((st, k, v))
                            st[k] = v.float()
        dev = next((t.device.type for t in [*m.parameters(), *m.buffers()]), "cpu")
        whole = self.module == ""

        def cast_in(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                return obj.float() if obj.is_floating_point() else obj
            if isinstance(obj, dict):
                return {k: cast_in(v) for k, v in obj.items()}
            if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
                return type(obj)(cast_in(v) for v in obj)
            return obj

        def cast_out(obj: Any, like: torch.dtype | None) -> Any:
            if like is None or whole:
                return obj
            if isinstance(obj, torch.Tensor):
                return obj.to(like) if obj.is_floating_point() else obj
            if isinstance(obj, dict):
                return {k: cast_out(v, like) for k, v in obj.items()}
            if isinstance(obj, (tuple, list)) and not hasattr(obj, "_fields"):
                return type(obj)(cast_out(v, like) for v in obj)
            return obj

        inner = m.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            like = next(
                (t.dtype for _, t in named_tensors((args, kwargs)) if t.is_floating_point()),
                None,
            )
            with torch.autocast(dev, enabled=False):
                out = inner(*cast_in(args), **cast_in(kwargs))
            return cast_out(out, like)

        # the whole model: autocast off for the whole step (forward, loss, backward),
        # whatever the caller has around it
        off = torch.autocast(dev, enabled=False) if whole else nullcontext()
        if whole:
            replay.autocast = False
        try:
            with forward_replaced(m, lambda _inner: forward), off:
                yield
        finally:
            for t, data in saved:
                t.data = data
            for st, k, v in opt_saved:
                st[k] = v

    def describe(self) -> str:
        where = (
            "the whole model"
            if self.module == ""
            else f"{self.module}" + (f" ({self.module_type})" if self.module_type else "")
        )
        return f"run {where} in float32 (autocast off)"

    def snippet(self) -> str:
        if self.module == "":
            return "model = model.float()  # and drop torch.autocast / .half() around the step"
        return (
            f"model.get_submodule({self.module!r}).float()  # keep it out of half precision\n"
            "# and in its forward: with torch.autocast(device_type, enabled=False): "
            "x = x.float(); ..."
        )


class ClipGradFix(Fix):
    """Clip the total gradient norm before the update."""

    kind = "clip_grad"

    def __init__(self, max_norm: float, *, why: str = "the recent gradient norm"):
        super().__init__()
        if not (isinstance(max_norm, (int, float)) and math.isfinite(max_norm) and max_norm > 0):
            raise ValueError(f"max_norm must be a positive finite number; got {max_norm!r}.")
        self.max_norm = float(max_norm)
        self.why = why

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        if replay.optimizer is None:
            raise ValueError("no optimizer to step: gradient clipping changes nothing here.")
        old = replay.clip_norm
        replay.clip_norm = self.max_norm
        try:
            yield
        finally:
            replay.clip_norm = old

    def describe(self) -> str:
        return f"clip the gradient norm to {self.max_norm:.4g} ({self.why})"

    def snippet(self) -> str:
        return (
            "loss.backward()\n"
            f"torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm={self.max_norm:.4g})\n"
            "optimizer.step()"
        )


class LowerLRFix(Fix):
    """The learning rate of every parameter group times ``factor`` for the update."""

    kind = "lower_lr"

    def __init__(self, factor: float = 0.1, *, lr: float | None = None):
        super().__init__()
        self.factor = float(factor)
        self.lr = lr

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        if replay.optimizer is None:
            raise ValueError("no optimizer to step: the learning rate changes nothing here.")
        old = replay.lr_factor
        replay.lr_factor = old * self.factor
        try:
            yield
        finally:
            replay.lr_factor = old

    def describe(self) -> str:
        lr = f" ({self.lr:.3g} -> {self.lr * self.factor:.3g})" if self.lr else ""
        return f"learning rate x{self.factor:g} for the update{lr}"

    def snippet(self) -> str:
        return (
            "for g in optimizer.param_groups:\n"
            f"    g['lr'] *= {self.factor:g}  # or a warm-up / a lower peak in the scheduler"
        )


class ScalerFix(Fix):
    """A GradScaler whose scale is lowered to ``scale`` for the step."""

    kind = "scaler"

    def __init__(self, scale: float):
        super().__init__()
        self.scale = float(scale)

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        s = replay.scaler
        if s is None:
            raise ValueError("the step has no GradScaler: there is no scale to lower.")
        old = s.state_dict()
        s.load_state_dict({**old, "scale": self.scale})
        try:
            yield
        finally:
            s.load_state_dict(old)

    def describe(self) -> str:
        return f"GradScaler with a lower scale ({self.scale:.4g})"

    def snippet(self) -> str:
        return (
            f"scaler = torch.amp.GradScaler(init_scale={self.scale:.4g}, growth_interval=2000)"
            "  # or keep the overflowing op in float32"
        )


class WeightsCorrupted(Fix):
    """A finding rather than a fix: the weights were already non-finite when the step
    started, so no change to this step can repair it. The replay runs the step as is."""

    kind = "weights_corrupted"

    def __init__(self, params: list[str], *, earlier: str = ""):
        super().__init__()
        self.params = list(params)
        self.module = _owner(self.params[0]) if self.params else None
        self.earlier = earlier

    def describe(self) -> str:
        names = ", ".join(self.params[:4]) + (" ..." if len(self.params) > 4 else "")
        return f"none possible: {names} already held NaN/Inf before this step"

    def snippet(self) -> str:
        look = f"  # {self.earlier}" if self.earlier else ""
        return (
            "snaps = nbdebug.list_snapshots('nbdebug-snapshots')  # an earlier step's snapshot"
            f"{look}\nguard = nbdebug.NaNGuard(model, optimizer, param_norm_every=1)"
        )


def _owner(qual: str) -> str:
    return qual.rsplit(".", 1)[0] if "." in qual else ""


class NotReproducible(Fix):
    """A plain, bit-identical re-run of the step (same weights, batch, RNG): when it is
    finite, the recorded failure is not reproducible (non-determinism, a stateful module,
    or hardware)."""

    kind = "not_reproducible"

    def describe(self) -> str:
        return "nothing: the same step replayed as it was"

    def snippet(self) -> str:
        return (
            "torch.use_deterministic_algorithms(True)  # then re-run; check modules that keep "
            "state between calls, and the hardware"
        )


@dataclass
class MenuContext:
    """What the menu is chosen from besides the trace."""

    has_optimizer: bool = False
    scaler_scale: float | None = None
    lr: float | None = None
    grad_norm_ref: float | None = None
    probed: list[tuple[str | None, str, str | None, str | None]] = field(default_factory=list)
    # (module or None for the loss, family, "file.py:line", filename)
    sites: dict[str, str] = field(default_factory=dict)  # "file.py:line" -> its filename
    corrupted: list[str] = field(default_factory=list)
    earlier: str = ""
    module_depths: dict[str, int] = field(default_factory=dict)


def menu(trace: Any, ctx: MenuContext) -> list[Fix]:
    """The candidate fixes for a traced failing step, one per kind, module and rows."""
    fixes: list[Fix] = []
    origin = getattr(trace, "origin", None)
    types = getattr(trace, "module_types", {}) or {}
    if ctx.corrupted:
        fixes.append(WeightsCorrupted(ctx.corrupted, earlier=ctx.earlier))
    if origin is not None:
        module = None if origin.phase == "loss" else origin.module
        seen: set[tuple[str | None, str]] = set()
        cands: list[tuple[str | None, str, str | None, str | None]] = []
        fam = op_family(origin.op)
        if fam and origin.phase != "input":
            cands.append((module, fam, origin.source, None))
        for name in _chain_ops(origin):
            f = op_family(name)
            if f and origin.phase != "input":
                cands.append((module, f, None, None))
        cands += ctx.probed
        for mod, f, src, filename in cands:
            if (mod, f) in seen:
                # keep the first source, add the filename a probe found
                for fx in fixes:
                    if isinstance(fx, EpsilonFix) and (fx.module, fx.op) == (mod, f):
                        fx.source = fx.source or src
                        fx.filename = fx.filename or filename
                continue
            seen.add((mod, f))
            filename = filename or (ctx.sites.get(src) if src else None)
            fixes.append(
                EpsilonFix(
                    mod, f, source=src, filename=filename, module_type=types.get(mod or "", "")
                )
            )
        probed = [(m, f) for m, f, _, _ in ctx.probed]
        eps = [fx for fx in fixes if isinstance(fx, EpsilonFix)]
        for i, fx in enumerate(eps):
            key = (fx.module, str(fx.op))
            fx.order = probed.index(key) if key in probed else len(probed) + i
        if origin.samples:
            fixes.append(DropRowsFix(list(origin.samples)))
    if _half(trace):
        mods: list[str] = []
        if origin is not None and origin.phase in ("forward", "backward") and origin.module:
            parts = origin.module.split(".")
            mods = [".".join(parts[:i]) for i in range(len(parts), 0, -1)][:3]
        for m in mods:
            fixes.append(Float32Fix(m, depth=m.count(".") + 1, module_type=types.get(m, "")))
        fixes.append(Float32Fix("", depth=0, module_type=types.get("", "")))
    grads_finite = not any(
        (p.grad_n_nan or p.grad_n_inf) for p in getattr(trace, "params", [])
    ) and not any(e.phase == "backward" and not e.finite for e in getattr(trace, "events", []))
    if ctx.has_optimizer and grads_finite and not ctx.corrupted:
        if ctx.grad_norm_ref is not None and ctx.grad_norm_ref > 0:
            fixes.append(ClipGradFix(ctx.grad_norm_ref))
        fixes.append(LowerLRFix(0.1, lr=ctx.lr))
    if ctx.scaler_scale is not None and ctx.scaler_scale > 1.0:
        fixes.append(ScalerFix(max(1.0, ctx.scaler_scale / 2**8)))
    return fixes


def _chain_ops(origin: Any) -> list[str]:
    chain = getattr(origin, "chain", None)
    out: list[str] = []
    if isinstance(chain, str):
        out = [part.strip().split(" ")[0] for part in chain.split("->")]
    elif isinstance(chain, (list, tuple)):
        for item in chain:
            if isinstance(item, str):
                out.append(item.strip().split(" ")[0])
            else:
                out.append(str(getattr(item, "op", item)))
    note = getattr(origin, "note", "") or ""
    marker = "the Inf was made by "
    if marker in note:
        out.append(note.split(marker, 1)[1].split(" ")[0].rstrip("."))
    return out


def _half(trace: Any) -> bool:
    half = ("float16", "bfloat16")
    if any(p.dtype in half for p in getattr(trace, "params", [])):
        return True
    return any(e.dtype in half for e in getattr(trace, "events", []) if e.phase == "forward")


__all__ = [
    "KINDS",
    "ClipGradFix",
    "DropRowsFix",
    "EpsilonFix",
    "Fix",
    "Float32Fix",
    "LowerLRFix",
    "MenuContext",
    "NotReproducible",
    "Replay",
    "RewriteMode",
    "ScalerFix",
    "WeightsCorrupted",
    "menu",
    "op_family",
]
