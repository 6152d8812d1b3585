"""The op-level replay: which torch operation produced a NaN/Inf, and the chain to the NaN.

One module (or the loss function) is run again on its inputs as they were at the call,
under a :class:`torch.overrides.TorchFunctionMode` that follows non-finite values from
operation to operation:

* the **root** is the first operation whose inputs were finite and whose output is not
  (NaN or Inf);
* an **intended mask** is not a root: an operation that writes a constant ``-inf``
  (``masked_fill``, ``where``, ``full`` with an infinite value argument), an input marked
  as a mask (a ``-inf`` attention mask from the batch), and what only carries such
  values on (``scores + mask``) are tagged as masks; an operation that turns masks into
  NaN (the softmax of a fully masked row) is a root;
* the **chain** links every operation that consumed a non-finite value to the one that
  produced it, so the first NaN leads back to its root: ``Tensor.div (inf) -> linear (NaN)``;
* composite torch functions written in Python (``multi_head_attention_forward``,
  ``F.softmax``) and ``scaled_dot_product_attention`` (through its documented math path)
  are descended into when they are the root, so the op named is the elementary one;
* sources are the first frame outside torch's own files (for a module of torch's own,
  the user's line that called it, recorded when it was called).

For a backward origin the forward operations' autograd nodes are watched the same way:
the root is the first node whose incoming gradient was finite and whose outgoing one is
not; a custom ``autograd.Function`` is named ``ProdFn.backward``, with the line of its
backward that made the value.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import os
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, resolve_name

from .batch import compute_loss, named_tensors
from .capture import CallCapture, frame_kind, source_text
from .events import Chain, ChainLink
from .state import AutocastState
from .stats import row_dim
from .text import code_name

__all__ = [
    "OpFinding",
    "composite_body",
    "op_name",
    "replay_backward",
    "replay_forward",
    "replay_loss",
]

_TORCH_DIR = os.path.dirname(torch.__file__)
_MODULE_PY = os.path.join("nn", "modules", "module.py")
_REPLAY_FRAMES = ("replay_forward", "replay_backward", "replay_loss", "_run_backward_source")
_COMPOSITE_MODULES = ("torch.nn.functional", "torch.functional")
_MAX_DESCENT = 4


@dataclass
class OpFinding:
    """What a replay found: the root op and its source, the chain, rows and a note."""

    op: str | None = None
    source: str | None = None
    rows: list[int] = field(default_factory=list)
    note: str = ""
    reproduced: bool = False  # the replay made a non-finite value at all
    chain: Chain = field(default_factory=Chain)
    mask: bool = False  # forward: the module's non-finite outputs are only intended masks
    counts: tuple[int, int] = (0, 0)  # forward: NaN and Inf in the replayed outputs


# ---------------------------------------------------------------------- naming
def op_name(func: Any) -> str:
    """``torch.log``, ``Tensor.div``, ``torch.nn.functional.softmax``."""
    try:
        name = resolve_name(func)
    except Exception:  # pragma: no cover - exotic callables
        name = None
    if not name:
        name = code_name(func)
    if name.startswith("torch.Tensor."):
        name = name[len("torch.") :]
    return name


def _base(name: str) -> str:
    return name.rsplit(".", 1)[-1].strip("_")


def user_source(fallback: str | None = None) -> str | None:
    """``file.py:line`` of the code that called the current torch operation: the first
    frame outside torch, the standard library and nbdebug, inside the replayed code.
    When only torch's own code called it (a torch module replayed on its own), the
    user's line that called that module (``fallback``), else the torch module's line
    (``torch/nn/modules/linear.py:134``)."""
    f = sys._getframe(1)
    torch_frame = None
    while f is not None:
        fn = f.f_code.co_filename
        kind = frame_kind(fn)
        if kind == "nbdebug":
            if f.f_code.co_name in _REPLAY_FRAMES or f.f_code.co_name == "compute_loss":
                break  # left the replayed code
        elif kind == "torch":
            if (
                not fn.endswith(("overrides.py", "_tensor.py", _MODULE_PY))
                and os.sep + "utils" + os.sep not in fn
            ):
                torch_frame = f  # the outermost one wins
        elif kind == "user":
            return source_text(fn, f.f_lineno)
        f = f.f_back  # type: ignore[assignment]
    if fallback is not None:
        return fallback
    if torch_frame is not None:
        rel = os.path.relpath(torch_frame.f_code.co_filename, os.path.dirname(_TORCH_DIR))
        return f"{rel}:{torch_frame.f_lineno}"
    return None


# ---------------------------------------------------------------------- values
def _float(t: torch.Tensor) -> bool:
    return (t.is_floating_point() or t.is_complex()) and t.numel() > 0


def _nonfinite(t: Any) -> bool:
    if not isinstance(t, torch.Tensor) or not _float(t):
        return False
    with torch._C.DisableTorchFunction():
        return not bool(torch.isfinite(t).all())


def _has_nan(t: Any) -> bool:
    if not isinstance(t, torch.Tensor) or not _float(t):
        return False
    with torch._C.DisableTorchFunction():
        return bool(torch.isnan(t).any())


def _tensors(obj: Any) -> list[torch.Tensor]:
    return [t for _, t in named_tensors(obj)]


def _rows(t: torch.Tensor, batch_size: int | None) -> list[int]:
    d = row_dim(t.shape, batch_size)
    if d is None or t.layout != torch.strided:
        return []
    with torch._C.DisableTorchFunction():
        bad = ~torch.isfinite(t.detach())
        return torch.nonzero(bad.movedim(d, 0).reshape(t.shape[d], -1).any(1)).flatten().tolist()


def _inf_constant(obj: Any, depth: int = 0) -> bool:
    """Whether a non-tensor argument is an infinite constant (``float("-inf")``)."""
    if isinstance(obj, float):
        return math.isinf(obj)
    if isinstance(obj, (tuple, list)) and depth < 3:
        return any(_inf_constant(v, depth + 1) for v in obj)
    if isinstance(obj, dict) and depth < 3:
        return any(_inf_constant(v, depth + 1) for v in obj.values())
    return False


@dataclass
class _Node:
    """A tensor's non-finite values: the op that made them and where they came from."""

    op: str
    source: str | None
    value: str  # "inf" or "NaN"
    parent: _Node | None
    rows: list[int]

    def path(self) -> Chain:
        links = []
        n: _Node | None = self
        while n is not None:
            links.append(ChainLink(n.op, n.source, n.value, n.rows))
            n = n.parent
        return Chain(reversed(links))


# ---------------------------------------------------------------------- composites
_SHADOWS: dict[Any, Any] = {}


def _false(*_args: Any, **_kwargs: Any) -> bool:
    return False


def _descendable(func: Any) -> bool:
    if func is F.scaled_dot_product_attention:
        return True
    return (
        isinstance(func, types.FunctionType)
        and getattr(func, "__module__", "") in _COMPOSITE_MODULES
        and any(n.startswith("has_torch_function") for n in func.__code__.co_names)
    )


def composite_body(func: Any) -> Any:
    """For a composite torch function written in Python (``F.normalize``,
    ``F.multi_head_attention_forward``, ``scaled_dot_product_attention``'s math path): a
    function running its body with the operations inside it visible to a
    ``TorchFunctionMode`` (call it inside the mode); ``None`` for any other function."""
    return _shadow(func) if _descendable(func) else None


def _shadow(func: Any) -> Any:
    """``func`` with its own ``__torch_function__`` dispatch switched off, so that under
    the mode its body runs and the operations inside it are seen one by one."""
    if func is F.scaled_dot_product_attention:
        return _sdpa_math
    hit = _SHADOWS.get(func)
    if hit is None:
        g = dict(func.__globals__)
        for n in ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic"):
            g[n] = _false
        hit = types.FunctionType(
            func.__code__, g, func.__name__, func.__defaults__, func.__closure__
        )
        hit.__kwdefaults__ = func.__kwdefaults__
        _SHADOWS[func] = hit
    return hit


def _sdpa_math(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The math path of ``scaled_dot_product_attention`` as its documentation writes it
    (the fused kernels hide the softmax that a fully masked row turns into NaN)."""
    n_q, n_k = query.size(-2), key.size(-2)
    factor = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    bias = torch.zeros(n_q, n_k, dtype=query.dtype, device=query.device)
    if is_causal:
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=query.device).tril(diagonal=0)
        bias = bias.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            bias = bias.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            bias = attn_mask + bias
    if enable_gqa:
        key = key.repeat_interleave(query.size(-3) // key.size(-3), -3)
        value = value.repeat_interleave(query.size(-3) // value.size(-3), -3)
    weights = query @ key.transpose(-2, -1) * factor
    weights = weights + bias
    weights = torch.softmax(weights, dim=-1)
    if dropout_p > 0:
        weights = torch.dropout(weights, dropout_p, train=True)
    return weights @ value


# ---------------------------------------------------------------------- the spy
class _Spy(TorchFunctionMode):
    """Follows non-finite values through the torch calls of one replay (module docs)."""

    def __init__(
        self,
        batch_size: int | None,
        call_site: str | None = None,
        *,
        graph: bool = False,
        known: set[int] | None = None,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.call_site = call_site
        # ids of the tensors the replay starts from (its inputs, the module's weights): a
        # NaN in any other tensor the spy did not see made came out of code it cannot see
        # (a TorchScript module, a C++ extension); None: no such judgement
        self.known = known
        self.roots: list[_Node] = []
        self.first_nan: _Node | None = None
        self._nodes: dict[int, tuple[Any, _Node]] = {}
        self._masks: dict[int, Any] = {}
        self.depth = 0
        # backward replays: autograd node -> (op, source) of the call that made it
        self.graph: dict[Any, tuple[str, str | None]] | None = {} if graph else None

    # tags ---------------------------------------------------------------
    def node_of(self, t: torch.Tensor) -> _Node | None:
        hit = self._nodes.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def is_mask(self, t: torch.Tensor) -> bool:
        ref = self._masks.get(id(t))
        return ref is not None and ref() is t

    def tag_mask(self, t: torch.Tensor) -> None:
        self._nodes.pop(id(t), None)
        self._masks[id(t)] = weakref.ref(t)

    def _tag(self, t: torch.Tensor, node: _Node) -> None:
        self._masks.pop(id(t), None)
        self._nodes[id(t)] = (weakref.ref(t), node)

    def _forget(self, t: torch.Tensor) -> None:
        self._nodes.pop(id(t), None)
        self._masks.pop(id(t), None)

    # the mode -----------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        descend = self.depth < _MAX_DESCENT and _descendable(func)
        if self.graph is not None and descend and func is not F.scaled_dot_product_attention:
            # a backward replay: run composites with their body visible from the start,
            # so that their autograd nodes are named by the elementary operations
            self.depth += 1
            try:
                with self:
                    out = _shadow(func)(*args, **kwargs)
            finally:
                self.depth -= 1
            descend = False
        else:
            out = None
        rng = _rng_state() if descend else None
        if out is None:
            out = func(*args, **kwargs)
        outs = _tensors(out)
        if not outs and func is torch.Tensor.__setitem__ and isinstance(args[0], torch.Tensor):
            outs = [args[0]]  # ``t[rows] = value`` returns nothing: it writes ``t``
        if not outs:
            return out
        if self.graph is not None:
            name = op_name(func)
            for t in outs:
                seen = self.graph.get(t.grad_fn) if t.grad_fn is not None else None
                if t.grad_fn is not None and (seen is None or _base(seen[0]) == _base(name)):
                    self.graph[t.grad_fn] = (name, user_source(self.call_site))
        bad = [t for t in outs if _nonfinite(t)]
        if not bad:
            for t in outs:
                self._forget(t)
            return out
        same = {id(t) for t in outs}
        parent: _Node | None = None
        mask_in = in_nan = unseen = False
        for t in _tensors((args, kwargs)):
            node = self.node_of(t)
            if node is not None:
                parent = parent or node
                in_nan = in_nan or node.value == "NaN"
            elif self.is_mask(t):
                mask_in = True
            elif id(t) in same or isinstance(t, torch.nn.Parameter):
                continue  # written in place / a weight: finite before as far as we know
            elif _nonfinite(t):
                if _has_nan(t):
                    if self.known is not None and id(t) not in self.known:
                        unseen = True  # made by code the spy cannot see
                    continue  # a NaN from outside the replay (a buffer): this op is the root
                mask_in = True  # an -inf from outside (a mask buffer, a mask input)
        value = "NaN" if any(_has_nan(t) for t in bad) else "inf"
        if unseen and parent is None:
            parent = _Node(UNSEEN, None, "NaN", None, _rows(bad[0], self.batch_size))
            self._root(parent)
        if parent is not None:
            node = _Node(op_name(func), user_source(self.call_site), value, parent, [])
            if value == "NaN" and not in_nan and self.first_nan is None:
                node.rows = _rows(bad[0], self.batch_size)
                self.first_nan = node
            for t in bad:
                self._tag(t, node)
            return out
        if value == "inf" and (mask_in or _inf_constant((args, kwargs))):
            for t in bad:
                self.tag_mask(t)
            return out
        if descend and rng is not None:
            inner = self._descend(func, args, kwargs, rng)
            if inner is not None:
                return inner
        node = _Node(
            op_name(func), user_source(self.call_site), value, None, _rows(bad[0], self.batch_size)
        )
        self._root(node)
        for t in bad:
            self._tag(t, node)
        return out

    def _root(self, node: _Node) -> None:
        self.roots.append(node)
        if node.value == "NaN" and self.first_nan is None:
            self.first_nan = node

    def _descend(self, func: Any, args: Any, kwargs: Any, rng: Any) -> Any:
        """Run a composite again with its body visible; ``None`` when nothing inside it
        was seen making the value (then the composite itself is the root)."""
        n_roots, first_nan = len(self.roots), self.first_nan
        rng.restore()
        self.depth += 1
        try:
            with self:
                out = _shadow(func)(*args, **kwargs)
        except Exception:
            return None
        finally:
            self.depth -= 1
        bad = [t for t in _tensors(out) if _nonfinite(t)]
        if not bad or len(self.roots) == n_roots:
            del self.roots[n_roots:]
            self.first_nan = first_nan
            return None
        outer = op_name(func)
        for root in self.roots[n_roots:]:
            if _base(root.op) == _base(outer) and root.parent is None:
                root.op = outer  # a thin wrapper (F.softmax -> Tensor.softmax): its own name
        return out

    # results ------------------------------------------------------------
    def chain(self, prefer_nan: bool) -> Chain:
        end = _end(self.roots, self.first_nan, prefer_nan)
        return end.path() if end is not None else Chain()


def _end(roots: list[_Node], first_nan: _Node | None, prefer_nan: bool) -> _Node | None:
    """The last node of the chain: the first NaN when the value looked for is NaN or
    when that NaN descends from the first root; else the first root."""
    if first_nan is not None and (prefer_nan or not roots or _root(first_nan) is roots[0]):
        return first_nan
    return roots[0] if roots else None


def _root(node: _Node) -> _Node:
    while node.parent is not None:
        node = node.parent
    return node


def _rng_state() -> Any:
    from .state import RngState

    return RngState.capture()


#: the root of a chain whose first NaN came out of code the spy cannot see
UNSEEN = "<unseen code>"


def _finding(spy: _Spy, kind: str) -> OpFinding:
    chain = spy.chain(kind == "nan")
    f = OpFinding(chain=chain, reproduced=bool(chain))
    if chain and chain[0].op == UNSEEN:
        # no op, never a wrong one: the first NaN came out of a call the replay cannot see
        f.chain = Chain()
        f.note = (
            "the NaN first appears in a tensor made by code the op-level replay cannot see "
            "(a TorchScript module, a C++ extension, or an unregistered tensor attribute): "
            "no op is named."
        )
        return f
    if chain:
        root = chain[0]
        f.op, f.source, f.rows = root.op, root.source, list(root.rows)
        last = chain[-1]
        if len(chain) > 1 and last.value == "NaN" and root.value != "NaN":
            f.note = (
                f"{last.op} turned an Inf into NaN; the Inf was made by {root.op}"
                + (f" at {root.source}" if root.source else "")
                + "."
            )
            f.rows = list(last.rows) or f.rows
    return f


# ---------------------------------------------------------------------- replays
def _known(module: torch.nn.Module, arguments: Any) -> set[int]:
    """Ids of the tensors a replay of ``module`` starts from: its arguments, its
    parameters and its buffers."""
    known = {id(t) for t in _tensors(arguments)}
    known.update(id(p) for p in module.parameters())
    known.update(id(b) for b in module.buffers())
    return known


def replay_forward(
    module: torch.nn.Module,
    capture: CallCapture,
    kind: str,
    batch_size: int | None,
    masks: tuple[int, ...] = (),
) -> OpFinding:
    """Run ``module`` on its inputs as they were at the call, under the spy. ``masks``:
    positions (in ``named_tensors((args, kwargs))`` order) of inputs that are intended
    masks."""
    args, kwargs = capture.fresh()
    spy = _Spy(batch_size, capture.call_site, known=_known(module, (args, kwargs)))
    for i, t in enumerate(_tensors((args, kwargs))):
        if i in masks:
            spy.tag_mask(t)
    with torch.set_grad_enabled(capture.grad_enabled), capture.autocast.applied(), spy:
        out = module(*args, **kwargs)
    f = _finding(spy, kind)
    bad = [t for t in _tensors(out) if _nonfinite(t)]
    with torch._C.DisableTorchFunction():
        n_nan = sum(int(torch.isnan(t).sum()) for t in bad)
        n_inf = sum(int(torch.isinf(t).sum()) for t in bad)
    f.counts = (n_nan, n_inf)
    f.mask = bool(bad) and not f.chain and all(spy.is_mask(t) for t in bad)
    return f


def replay_loss(
    loss_fn: Any,
    output: Any,
    target: Any,
    kind: str,
    batch_size: int | None,
    autocast: AutocastState | None = None,
) -> OpFinding:
    """Run the loss computation again on the recorded model output, under the spy (and
    the autocast state the loss ran in)."""
    spy = _Spy(batch_size)
    amp = autocast.applied() if autocast is not None else contextlib.nullcontext()
    with torch.enable_grad(), amp, spy:
        compute_loss(output, target, loss_fn)
    return _finding(spy, kind)


def replay_backward(
    module: torch.nn.Module,
    capture: CallCapture,
    grad_outputs: dict[str, torch.Tensor],
    kind: str,
    batch_size: int | None,
) -> OpFinding:
    """Run ``module`` forward and backward on its recorded inputs and incoming gradient;
    name the forward op whose backward turned a finite gradient into a non-finite one
    (the root), and the chain to the first NaN. ``reproduced`` tells whether this
    module's backward made a non-finite value at all."""
    args, kwargs = capture.fresh()
    leaves = []
    for t in _tensors((args, kwargs)):
        if t.is_floating_point() or t.is_complex():
            t.requires_grad_(True)
            leaves.append(t)
    leaves += [p for p in module.parameters() if p.requires_grad]
    spy = _Spy(batch_size, capture.call_site, graph=True, known=_known(module, (args, kwargs)))
    with torch.enable_grad(), capture.autocast.applied(), spy:
        out = module(*args, **kwargs)
    outs, grads = [], []
    for name, t in named_tensors(out, "output"):
        g = grad_outputs.get(name)
        if g is not None and t.requires_grad:
            outs.append(t)
            grads.append(g)
    if not outs:
        return OpFinding()
    names = _graph_names(outs, spy.graph or {})
    watch = _BackwardWatch(names, batch_size, {id(p) for p in module.parameters()})
    handles = [node.register_hook(watch.hook(node)) for node in names]
    try:
        grads_in = torch.autograd.grad(outs, leaves, grads, allow_unused=True, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    finding = OpFinding(reproduced=any(g is not None and _nonfinite(g) for g in grads_in))
    end = _end(watch.roots, watch.first_nan, kind == "nan")
    if end is None:
        return finding
    chain, root = end.path(), _root(end)
    root_node = watch.records.get(id(root))
    if root_node is not None and hasattr(root_node, "_forward_cls"):
        src = _run_backward_source(root_node, watch.grad_outs.get(root_node), batch_size)
        if src:
            chain = Chain([ChainLink(chain[0].op, src, chain[0].value, chain[0].rows), *chain[1:]])
    hooked = _user_backward_hook(module) if chain[0].op == _HOOK_FUNCTION else None
    if hooked is not None:
        # torch's BackwardHookFunction carries the module's full backward hooks: the value
        # was made in the user's hook, not in torch's identity backward
        chain = Chain([ChainLink(hooked[0], hooked[1], chain[0].value, chain[0].rows), *chain[1:]])
    finding.chain = chain
    finding.op, finding.source, finding.rows = chain[0].op, chain[0].source, list(chain[0].rows)
    if hooked is not None:
        finding.note = (
            f"made by the module's full backward hook {hooked[0]} (register_full_backward_hook) "
            "from a finite gradient: the line is the hook's definition."
        )
    elif watch.hidden_nan is not None and watch.hidden_nan is root:
        finding.note = (
            f"the backward of {finding.op} multiplied a zero gradient by a non-finite local "
            "derivative (a hidden NaN, e.g. behind torch.where or a mask)."
        )
    elif len(chain) > 1 and chain[-1].value == "NaN" and chain[0].value != "NaN":
        finding.note = (
            f"the backward of {chain[-1].op} turned an Inf into NaN; the Inf was made by "
            f"{finding.op}'s backward."
        )
    return finding


def _graph_names(outs: list[torch.Tensor], graph: dict[Any, tuple[str, str | None]]) -> dict:
    """Every autograd node of the replayed forward, named by the torch call that made it
    (a node made inside a composite takes its consumer's name; a custom Function's node
    is ``ProdFn.backward``)."""
    names: dict[Any, tuple[str, str | None]] = {}
    stack: list[tuple[Any, tuple[str, str | None] | None]] = [(t.grad_fn, None) for t in outs]
    while stack:
        node, owner = stack.pop()
        if node is None or node in names or type(node).__name__ == "AccumulateGrad":
            continue
        cls = getattr(node, "_forward_cls", None)
        if cls is not None:
            name: tuple[str, str | None] | None = (f"{code_name(cls)}.backward", _def_line(cls))
        else:
            name = graph.get(node, owner)
        if name is None:
            continue
        names[node] = name
        for nxt, _ in node.next_functions:
            stack.append((nxt, name))
    return names


#: the autograd Function through which torch runs a module's full backward hooks
_HOOK_FUNCTION = "BackwardHookFunction.backward"


def _user_backward_hook(module: torch.nn.Module) -> tuple[str, str | None] | None:
    """(name, definition line) of ``module``'s first full backward hook, if it has one."""
    for hook in getattr(module, "_backward_hooks", {}).values():
        code = getattr(hook, "__code__", None)
        if code is not None:
            return code_name(hook), source_text(code.co_filename, code.co_firstlineno)
    return None


def _def_line(cls: Any) -> str | None:
    try:
        fn = inspect.getsourcefile(cls.backward)
        _, line = inspect.getsourcelines(cls.backward)
    except (OSError, TypeError):
        return None
    return source_text(fn, line) if fn else None


class _BackwardWatch:
    """Node hooks of a backward replay: roots, the first NaN and the links between."""

    def __init__(
        self,
        names: dict[Any, tuple[str, str | None]],
        batch_size: int | None,
        params: set[int] = frozenset(),  # type: ignore[assignment]
    ):
        self.names = names
        self.batch_size = batch_size
        self.params = params  # ids of the module's parameters: their gradients have no rows
        self.roots: list[_Node] = []
        self.first_nan: _Node | None = None
        self.hidden_nan: _Node | None = None
        self.pending: dict[Any, _Node] = {}  # node -> the consumer that sent it a bad grad
        self.records: dict[int, Any] = {}  # id(_Node) -> autograd node
        self.grad_outs: dict[Any, tuple[Any, ...]] = {}

    def hook(self, node: Any):
        def run(grad_inputs: Any, grad_outputs: Any) -> None:
            bad_in = [g for g in grad_inputs if _nonfinite(g)]
            if not bad_in:
                return
            out_bad = any(_nonfinite(g) for g in grad_outputs)
            out_nan = any(_has_nan(g) for g in grad_outputs)
            value = "NaN" if any(_has_nan(g) for g in bad_in) else "inf"
            op, src = self.names[node]
            rec = _Node(op, src, value, self.pending.get(node) if out_bad else None, [])
            self.records[id(rec)] = node
            if not out_bad:
                rec.rows = self._rows(node, grad_inputs)
                self.roots.append(rec)
                if hasattr(node, "_forward_cls"):
                    self.grad_outs[node] = tuple(
                        g.detach().clone() if isinstance(g, torch.Tensor) else g
                        for g in grad_outputs
                    )
                if _zero_where_bad(grad_outputs, bad_in[0]) and self.hidden_nan is None:
                    self.hidden_nan = rec
            if value == "NaN" and not out_nan and self.first_nan is None:
                rec.rows = rec.rows or self._rows(node, grad_inputs)
                self.first_nan = rec
            for (nxt, _), g in zip(node.next_functions, grad_inputs):
                if nxt is not None and _nonfinite(g):
                    self.pending.setdefault(nxt, rec)

        return run

    def _rows(self, node: Any, grad_inputs: Any) -> list[int]:
        """The batch rows of the first non-finite gradient the node sends to something
        other than a parameter (a weight's gradient has no batch dimension, even where
        one of its sizes equals the batch size)."""
        for (nxt, _), g in zip(node.next_functions, grad_inputs):
            if _nonfinite(g) and not self._to_param(nxt):
                return _rows(g, self.batch_size)
        return []

    def _to_param(self, node: Any) -> bool:
        """Whether ``node`` leads to one of the module's parameters through nodes of one
        input each (``weight.t()``, autocast's cast of it: its gradient is the weight's)."""
        for _ in range(8):
            if node is None:
                return False
            if id(getattr(node, "variable", None)) in self.params:
                return True
            nexts = [n for n, _ in node.next_functions if n is not None]
            if len(nexts) != 1:
                return False
            node = nexts[0]
        return False


def _zero_where_bad(grads: Any, bad: torch.Tensor) -> bool:
    """Whether the incoming gradient is exactly zero wherever ``bad`` is non-finite."""
    with torch._C.DisableTorchFunction():
        mask = ~torch.isfinite(bad)
        for g in grads:
            if isinstance(g, torch.Tensor) and g.shape == bad.shape:
                return bool((g[mask] == 0).all())
    return False


def _run_backward_source(node: Any, grad_outputs: Any, batch_size: int | None) -> str | None:
    """The line of a custom Function's backward that made the value: run that backward
    once more (the graph was retained) on the gradients it received, under the spy."""
    if grad_outputs is None:
        return None
    spy = _Spy(batch_size)
    try:
        with torch.no_grad(), spy:
            node._forward_cls.backward(node, *grad_outputs)
    except Exception:
        return None
    chain = spy.chain(False)
    return chain[0].source if chain else None
