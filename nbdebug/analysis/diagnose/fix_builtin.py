"""The built-in a hand-written op chain reimplements, as an ``epsilon`` fix: a softmax
written as ``exp -> sum -> div`` becomes ``F.softmax``, followed by ``log`` it becomes
``F.log_softmax``, ``log(sum(exp(x)))`` becomes ``torch.logsumexp``, ``log(1 + exp(x))``
becomes ``F.softplus`` and a standardisation ``(x - mean) / std`` becomes ``F.layer_norm``
over the last dimension, or the same standardisation with an epsilon over any other (the
dimension the step used: the snippet shows the code replayed).

:class:`BuiltinMode` follows the step's tensors by identity: it remembers which tensor is
the ``exp`` of which, the ``sum`` of which ``exp``, and so on, and where the chain closes
it returns the built-in's result, computed from the chain's own input (so the backward
runs through the built-in only). With ``dry=True`` it only records what it recognises
(the menu's look at the step); it also records the explicit casts to half precision it
sees (``.half()``, ``.to(torch.float16)``, ``.bfloat16()``), the dimension each chain
closed over, whether its line is a ``return``, and for each ``exp`` line whether it feeds a
softmax or a log-sum-exp (where ``exp(x - max)`` is the same result) or a softplus (where it
is not).
"""

from __future__ import annotations

import linecache
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, resolve_name

from ...core.trace.frames import source_text
from ...core.vocab import FixKind
from .fix import LOCALITY, Fix, Replay
from .rewrite import caller_line

__all__ = ["BUILTINS", "SHIFT_SAFE", "BuiltinFix", "BuiltinMode", "half_cast", "step_scope"]

#: What each recognised chain is replaced by, and the chain in words.
BUILTINS: dict[str, str] = {
    "F.softmax": "exp / exp.sum",
    "F.log_softmax": "log of a softmax",
    "torch.logsumexp": "log(exp(x).sum)",
    "F.layer_norm": "(x - mean) / std",
    "F.softplus": "log(1 + exp(x))",
}

#: The chains where ``exp(x - max)`` gives the same result (the shift cancels out).
SHIFT_SAFE = ("F.softmax", "F.log_softmax", "torch.logsumexp")

_HALF = (torch.float16, torch.bfloat16)
_LN_EPS = 1e-5  # F.layer_norm's default


def _short(func: Callable[..., Any]) -> str:
    try:
        name = resolve_name(func) or getattr(func, "__name__", "")
    except Exception:  # pragma: no cover - exotic callables
        name = getattr(func, "__name__", "")
    return name.rsplit(".", 1)[-1].strip("_")


def _dim(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return args[1] if len(args) > 1 else kwargs.get("dim")


def half_cast(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call (``name`` as :func:`_short` gives it) casts a float32 tensor to half
    precision: ``x.half()``, ``x.bfloat16()``, ``x.to(torch.float16)``, ``x.type(...)``."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dtype in _HALF or not x.is_floating_point():
        return False
    if name in ("half", "bfloat16"):
        return True
    if name in ("to", "type"):
        wanted = [w for w in (*args[1:], kwargs.get("dtype")) if isinstance(w, (torch.dtype, str))]
        return any(w in _HALF or w in ("torch.HalfTensor", "torch.BFloat16Tensor") for w in wanted)
    return False


class BuiltinMode(TorchFunctionMode):
    """Replaces the recognised hand-written chains by their built-ins (``dry``: records
    them only). ``found`` lists the built-ins recognised, ``lines`` their ``file:line``,
    ``casts`` the lines of explicit casts to half precision; ``calls`` counts the
    replacements made."""

    def __init__(self, *, dry: bool = False) -> None:
        super().__init__()
        self.dry = dry
        self.found: list[str] = []
        self.lines: list[str] = []
        self.casts: list[str] = []
        self.calls = 0
        self.dims: dict[str, Any] = {}  # built-in -> the dimension its chain closed over
        self.returns: set[str] = set()  # built-ins whose chain closes on a `return` line
        self.exp_lines: dict[str, bool] = {}  # "file.py:line" of an exp -> shift-safe
        self._exp_at: dict[int, str] = {}  # id(exp result, its sum) -> the exp's line
        # id(result) -> (result, chain input, dim, keepdim, what): the result is kept so
        # that its id is not reused while it is remembered
        self._of: dict[int, tuple[torch.Tensor, torch.Tensor, Any, bool, str]] = {}

    def _remember(self, out: Any, x: torch.Tensor, dim: Any, keep: bool, what: str) -> None:
        if isinstance(out, torch.Tensor):
            self._of[id(out)] = (out, x, dim, keep, what)

    def _lookup(self, t: Any, what: str) -> tuple[torch.Tensor, Any, bool] | None:
        got = self._of.get(id(t)) if isinstance(t, torch.Tensor) else None
        if got is None or got[0] is not t or got[4] != what:
            return None
        return got[1], got[2], got[3]

    def _hit(
        self,
        builtin: str,
        real: Callable[[], Any],
        made: Callable[[], Any],
        dim: Any = None,
        exp: Any = None,
    ) -> Any:
        """A chain closed: record it (its dimension, its line, the line of its ``exp``);
        the real result when dry, else the built-in's."""
        where = caller_line()
        line = source_text(*where) if where is not None else ""
        self.dims.setdefault(builtin, dim)
        if where is not None and linecache.getline(*where).strip().startswith("return "):
            self.returns.add(builtin)
        at = self._exp_at.get(id(exp)) if exp is not None else None
        if at is not None:
            self.exp_lines[at] = self.exp_lines.get(at, True) and builtin in SHIFT_SAFE
        if builtin == "F.log_softmax" and "F.softmax" in self.found:
            self.found.remove("F.softmax")  # the softmax was the first half of it
        if builtin not in self.found and not (
            builtin == "F.softmax" and "F.log_softmax" in self.found
        ):
            self.found.append(builtin)
        if line and line not in self.lines:
            self.lines.append(line)
        if self.dry:
            return real()
        self.calls += 1
        return made()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = _short(func)
        if half_cast(name, args, kwargs):
            where = caller_line()
            if where is not None:
                self.casts.append(source_text(*where))
        handler = self._HANDLERS.get(name)
        if handler is None:
            return func(*args, **kwargs)
        return handler(self, func, args, kwargs)

    # ------------------------------------------------------------------ the chains
    def _exp(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        if args and isinstance(args[0], torch.Tensor):
            self._remember(out, args[0], None, False, "exp")
            where = caller_line()
            if where is not None and isinstance(out, torch.Tensor):
                self._exp_at[id(out)] = source_text(*where)
        return out

    def _sum(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        src = self._lookup(args[0], "exp") if args else None
        dim = _dim(args, kwargs)
        if src is not None and dim is not None:
            self._remember(out, src[0], dim, bool(kwargs.get("keepdim", False)), "sum")
            self._follow(args[0], out)
        return out

    def _follow(self, exp: Any, out: Any) -> None:
        """``out`` is made from the ``exp`` result ``exp``: it carries its line."""
        at = self._exp_at.get(id(exp))
        if at is not None and isinstance(out, torch.Tensor):
            self._exp_at[id(out)] = at

    def _mean(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        dim = _dim(args, kwargs)
        if args and isinstance(args[0], torch.Tensor) and dim is not None:
            self._remember(out, args[0], dim, bool(kwargs.get("keepdim", False)), "mean")
        return out

    def _spread(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        dim = _dim(args, kwargs)
        if args and isinstance(args[0], torch.Tensor) and dim is not None:
            what = "std" if _short(func) == "std" else "var"
            self._remember(out, args[0], dim, bool(kwargs.get("keepdim", False)), what)
        return out

    def _sqrt(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        src = self._lookup(args[0], "var") if args else None
        if src is not None:
            self._remember(out, src[0], src[1], src[2], "std")
        return out

    def _sub(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        if len(args) > 1 and isinstance(args[0], torch.Tensor):
            src = self._lookup(args[1], "mean")
            if src is not None and src[0] is args[0]:
                self._remember(out, args[0], src[1], True, "centred")
        return out

    def _add(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        # std + eps (an epsilon too small for the step) keeps the chain; 1 + exp(x) starts
        # a softplus
        out = func(*args, **kwargs)
        if len(args) > 1 and isinstance(args[1], (int, float)):
            src = self._lookup(args[0], "std")
            if src is not None:
                self._remember(out, src[0], src[1], src[2], "std")
        pair = [a for a in args[:2] if isinstance(a, torch.Tensor)]
        ones = [a for a in args[:2] if isinstance(a, (int, float)) and a == 1]
        if len(pair) == 1 and ones and not kwargs.get("alpha"):
            exp = self._lookup(pair[0], "exp")
            if exp is not None:
                self._remember(out, exp[0], None, False, "1+exp")
                self._follow(pair[0], out)
        return out

    def _div(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        if len(args) < 2 or kwargs.get("rounding_mode") is not None:
            return func(*args, **kwargs)
        num, den = args[0], args[1]
        e, s = self._lookup(num, "exp"), self._lookup(den, "sum")
        if e is not None and s is not None and e[0] is s[0]:
            x, dim = s[0], s[1]
            out = self._hit(
                "F.softmax",
                lambda: func(*args, **kwargs),
                lambda: F.softmax(x, dim=dim),
                dim=dim,
                exp=num,
            )
            self._remember(out, x, dim, True, "softmax")
            self._follow(num, out)
            return out
        c, sd = self._lookup(num, "centred"), self._lookup(den, "std")
        if c is not None and sd is not None and c[0] is sd[0] and c[1] == sd[1]:
            x, dim = c[0], c[1]
            real = lambda: func(*args, **kwargs)  # noqa: E731
            return self._hit("F.layer_norm", real, lambda: _norm(x, dim), dim=dim)
        return func(*args, **kwargs)

    def _softmax(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        dim = _dim(args, kwargs)
        if args and isinstance(args[0], torch.Tensor) and dim is not None:
            self._remember(out, args[0], dim, True, "softmax")
        return out

    def _log(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        p = args[0] if args else None
        real = lambda: func(*args, **kwargs)  # noqa: E731
        soft, total = self._lookup(p, "softmax"), self._lookup(p, "sum")
        if soft is not None:
            x, dim = soft[0], soft[1]
            made = lambda: F.log_softmax(x, dim=dim)  # noqa: E731
            return self._hit("F.log_softmax", real, made, dim=dim, exp=p)
        if total is not None:
            x, dim, keep = total
            made = lambda: torch.logsumexp(x, dim=dim, keepdim=keep)  # noqa: E731
            return self._hit("torch.logsumexp", real, made, dim=dim, exp=p)
        onep = self._lookup(p, "1+exp")
        if onep is not None:  # log(1 + exp(x))
            x = onep[0]
            return self._hit("F.softplus", real, lambda: F.softplus(x), exp=p)
        return real()

    def _log1p(self, func: Callable[..., Any], args: Any, kwargs: dict[str, Any]) -> Any:
        p = args[0] if args else None
        e = self._lookup(p, "exp")
        if e is None:  # log1p(exp(x)) is a softplus
            return func(*args, **kwargs)
        x = e[0]
        return self._hit("F.softplus", lambda: func(*args, **kwargs), lambda: F.softplus(x), exp=p)

    _HANDLERS: ClassVar[dict[str, Callable[..., Any]]] = {
        "exp": _exp,
        "sum": _sum,
        "mean": _mean,
        "std": _spread,
        "var": _spread,
        "sqrt": _sqrt,
        "sub": _sub,
        "add": _add,
        "radd": _add,
        "log1p": _log1p,
        "div": _div,
        "truediv": _div,
        "true_divide": _div,
        "softmax": _softmax,
        "log": _log,
    }


def _norm(x: torch.Tensor, dim: Any) -> torch.Tensor:
    """The standardisation of ``x`` over ``dim`` as ``F.layer_norm`` computes it (biased
    variance, epsilon 1e-5), over the last dimension through ``F.layer_norm`` itself."""
    last = dim in (-1, x.dim() - 1) or (isinstance(dim, (tuple, list)) and list(dim) == [-1])
    if last:
        return F.layer_norm(x, x.shape[-1:], eps=_LN_EPS)
    mu = x.mean(dim=dim, keepdim=True)
    return (x - mu) / torch.sqrt(x.var(dim=dim, keepdim=True, unbiased=False) + _LN_EPS)


@contextmanager
def step_scope(replay: Replay, make: Callable[[], Any]) -> Iterator[None]:
    """For the block, the model's forward and the loss each run inside ``make()``."""
    with ExitStack() as stack:
        stack.enter_context(replay.around_forward("", make))
        if replay.loss_fn is not None:
            stack.enter_context(replay.around_loss(make))
        yield


def _last(dim: Any) -> bool:
    """Whether ``dim`` is the last dimension (``-1``, ``[-1]``; ``None``: not known)."""
    return dim is None or dim == -1 or (isinstance(dim, (tuple, list)) and list(dim) == [-1])


def _code(builtin: str, dim: Any) -> str:
    """The code a built-in's replay ran, over the dimension the step's chain used."""
    d = -1 if dim is None else dim
    if builtin == "F.softmax":
        return (
            f"p = F.softmax(z, dim={d})  # was: e = torch.exp(z); p = e / e.sum({d}, keepdim=True)"
        )
    if builtin == "F.log_softmax":
        return (
            f"logp = F.log_softmax(z, dim={d})  # was: torch.log(softmax(z)); "
            "or F.cross_entropy(z, y) on the logits"
        )
    if builtin == "torch.logsumexp":
        return (
            f"lse = torch.logsumexp(z, dim={d}, keepdim=True)  "
            f"# was: torch.log(torch.exp(z).sum({d}, keepdim=True))"
        )
    if builtin == "F.softplus":
        return (
            "y = F.softplus(x)  # was: torch.log(1 + torch.exp(x)); "
            "or torch.logaddexp(torch.zeros_like(x), x)"
        )
    if _last(dim):
        return f"x = F.layer_norm(x, x.shape[-1:], eps={_LN_EPS:g})  # was: (x - mean) / std"
    return (
        f"x = (x - x.mean({d}, keepdim=True)) / torch.sqrt(x.var({d}, keepdim=True, "
        f"unbiased=False) + {_LN_EPS:g})  # was: (x - x.mean({d})) / x.std({d})"
    )


def _returned(code: str) -> str:
    """``"x = expr  # ..."`` as ``"return expr  # ..."``: the chain closed on a return."""
    return "return " + code.split(" = ", 1)[1]


class BuiltinFix(Fix):
    """The torch built-in that a hand-written chain of the step reimplements (``exp / sum``
    -> ``F.softmax``, ``log`` of it -> ``F.log_softmax``, ``log(sum(exp))`` ->
    ``torch.logsumexp``, ``log(1 + exp(x))`` -> ``F.softplus``, ``(x - mean) / std`` ->
    ``F.layer_norm`` over the last dimension, over another the same standardisation with
    an epsilon), in the replay only.

    Parameters
    ----------
    builtins : list of str
        The built-ins recognised (keys of :data:`BUILTINS`).
    module : str or None
        The origin's module (``None``: the loss), for the text; the replacement is made
        wherever the chain runs in the step.
    lines : list of str
        The ``"file.py:line"`` where each chain closes.
    dims : dict, optional
        The dimension each built-in's chain closed over (the replay updates it).
    returns : collection of str, optional
        The built-ins whose chain closes on a ``return`` line (the snippet keeps it).

    Examples
    --------
    >>> nbdebug.diagnose(snap, fixes=[BuiltinFix(["F.log_softmax"], "head")])
    """

    kind = FixKind.EPSILON

    def __init__(
        self,
        builtins: list[str],
        module: str | None = None,
        *,
        lines: list[str] | None = None,
        dims: dict[str, Any] | None = None,
        returns: set[str] | None = None,
    ):
        super().__init__()
        self.builtins = list(builtins)
        self.module = module
        self.lines = list(lines or [])
        self.dims = dict(dims or {})
        self.returns = set(returns or ())
        self.op = "builtin"
        self.replaced = 0

    @property
    def rank_locality(self) -> float:
        # after the single epsilons (one op), before several at once and the rows
        return self.locality if self.locality is not None else LOCALITY[FixKind.EPSILON] + 0.55

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        # one mode for the forward and the loss: a softmax in the model and the log of it
        # in the loss are one chain
        mode = BuiltinMode()
        try:
            with step_scope(replay, lambda: mode):
                yield
        finally:
            self.replaced = mode.calls
            self.dims.update(mode.dims)  # what the replay ran
            self.returns |= mode.returns

    def _name(self, b: str) -> str:
        """The built-in's name; a standardisation over another dimension than the last is
        written out (``F.layer_norm`` normalises the last)."""
        if b == "F.layer_norm" and not _last(self.dims.get(b)):
            return f"(x - mean) / sqrt(var + {_LN_EPS:g}) over dim {self.dims.get(b)}"
        return b

    def _what(self) -> str:
        return " and ".join(
            f"{self._name(b)} instead of the hand-written {BUILTINS[b]}" for b in self.builtins
        )

    def describe(self) -> str:
        at = f" at {', '.join(self.lines[:2])}" if self.lines else ""
        return f"{self._what()}{at}"

    def action(self) -> str:
        return f"using {' and '.join(self._name(b) for b in self.builtins)}"

    def snippet(self) -> str:
        where = f"# {', '.join(self.lines)}\n" if self.lines else ""
        codes = [_code(b, self.dims.get(b)) for b in self.builtins]
        codes = [_returned(c) if b in self.returns else c for b, c in zip(self.builtins, codes)]
        return where + "\n".join(codes)
