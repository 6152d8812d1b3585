"""The op-level replays: which torch operation produced a NaN/Inf, and the chain to the NaN.

One module (or the loss function) is run again on its inputs as they were at the call,
under the :class:`.spy.Spy`. For a backward origin the forward operations' autograd nodes
are watched the same way: the root is the first node whose incoming gradient was finite
and whose outgoing one is not; a custom ``autograd.Function`` is named
``ProdFn.backward``, with the line of its backward that made the value. A gradient
already non-finite where it reaches the model's output was made by the loss's backward:
the loss function is replayed forward and backward on the recorded output the same way.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from ..batch import LossFn, compute_loss, named_tensors
from ..state import AutocastState
from ..stats import count_nonfinite, has_nan, has_nonfinite
from ..text import code_name
from ..vocab import NonFinite
from .capture import CallCapture, copy_arguments
from .events import Chain, ChainLink
from .frames import source_text
from .spy import Node, OpFinding, Spy, bad_rows, chain_end, finding, root_of, tensors_of

__all__ = [
    "LossStep",
    "replay_backward",
    "replay_forward",
    "replay_loss",
    "replay_loss_backward",
    "run_backward_source",
]

#: an autograd graph node (``tensor.grad_fn``)
GradNode = torch.autograd.graph.Node
#: (op, ``file.py:line``) a graph node is named by
NodeName = tuple[str, str | None]
#: the gradients a graph node receives or sends (``None`` where there is none)
Grads = Sequence[torch.Tensor | None]


def _known(module: torch.nn.Module, arguments: object) -> set[int]:
    """Ids of the tensors a replay of ``module`` starts from: its arguments, its
    parameters and its buffers."""
    known = {id(t) for t in tensors_of(arguments)}
    known.update(id(p) for p in module.parameters())
    known.update(id(b) for b in module.buffers())
    return known


def replay_forward(
    module: torch.nn.Module,
    capture: CallCapture,
    kind: NonFinite,
    batch_size: int | None,
    masks: tuple[int, ...] = (),
) -> OpFinding:
    """Run ``module`` on its inputs as they were at the call, under the spy. ``masks``:
    positions (in ``named_tensors((args, kwargs))`` order) of inputs that are intended
    masks."""
    args, kwargs = capture.fresh()
    spy = Spy(batch_size, capture.call_site, known=_known(module, (args, kwargs)))
    for i, t in enumerate(tensors_of((args, kwargs))):
        if i in masks:
            spy.tag_mask(t)
    with torch.set_grad_enabled(capture.grad_enabled), capture.autocast.applied(), spy:
        out = module(*args, **kwargs)
    f = finding(spy, kind)
    bad = [t for t in tensors_of(out) if has_nonfinite(t)]
    counts = [count_nonfinite(t) for t in bad]
    f.counts = (sum(c[0] for c in counts), sum(c[1] for c in counts))
    f.mask = bool(bad) and not f.chain and all(spy.is_mask(t) for t in bad)
    return f


def replay_loss(
    step: LossStep, kind: NonFinite, batch_size: int | None, masks: Collection[str] = ()
) -> OpFinding:
    """Run the loss computation again on the recorded model output, under the spy (and
    the autocast state the loss ran in). ``masks``: the output tensors
    (``named_tensors(output, "output")`` names) that hold intended masks; a loss made
    non-finite from them alone is rooted at the loss's first operation on the mask's way
    to the loss (:func:`.spy.finding`)."""
    output = copy_arguments(step.output)
    spy = Spy(batch_size)
    for name, t in named_tensors(output, "output"):
        if name in masks:
            spy.tag_mask(t)
    amp = step.autocast.applied() if step.autocast is not None else contextlib.nullcontext()
    with torch.enable_grad(), amp, spy:
        loss = compute_loss(output, step.target, step.loss_fn)
    return finding(spy, kind, end=loss)


def replay_backward(
    module: torch.nn.Module,
    capture: CallCapture,
    grad_outputs: dict[str, torch.Tensor],
    kind: NonFinite,
    batch_size: int | None,
    param: torch.Tensor | None = None,
) -> OpFinding:
    """Run ``module`` forward and backward on its recorded inputs and incoming gradient;
    name the forward op whose backward turned a finite gradient into a non-finite one
    (the root), and the chain to the first NaN. ``reproduced`` tells whether this
    module's backward made a non-finite value at all: in one of the gradients the step
    computed, those of the inputs that required grad at the call and of the module's
    parameters (an input the step asked no gradient of gets none here either); with
    ``param`` (one of the module's parameters), in that parameter's gradient."""
    args, kwargs = capture.fresh()
    leaves: list[torch.Tensor] = []
    for name, t in named_tensors((args, kwargs)):
        if capture.wanted_grad(name, t):
            t.requires_grad_(True)
            leaves.append(t)
    leaves += [p for p in module.parameters() if p.requires_grad]
    spy = Spy(batch_size, capture.call_site, graph=True, known=_known(module, (args, kwargs)))
    with torch.enable_grad(), capture.autocast.applied(), spy:
        out = module(*args, **kwargs)
    outs: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for name, t in named_tensors(out, "output"):
        g = grad_outputs.get(name)
        if g is not None and t.requires_grad:
            outs.append(t)
            grads.append(g)
    if not outs or not leaves:
        return OpFinding()
    params = frozenset(id(p) for p in module.parameters())
    judged = [param] if param is not None else leaves
    b = _Backward(outs, grads, leaves, spy, batch_size, params, {id(t) for t in judged})
    found = _watched_backward(b, kind)
    hooked = _user_backward_hook(module) if found.op == _HOOK_FUNCTION else None
    if hooked is not None:
        # torch's BackwardHookFunction carries the module's full backward hooks: the value
        # was made in the user's hook, not in torch's identity backward
        c = found.chain
        found.chain = Chain([ChainLink(hooked[0], hooked[1], c[0].value, c[0].rows), *c[1:]])
        found.op, found.source = hooked
        found.note = (
            f"made by the module's full backward hook {hooked[0]} (register_full_backward_hook) "
            "from a finite gradient: the line is the hook's definition."
        )
    return found


def replay_loss_backward(
    step: LossStep, grad_names: Collection[str], kind: NonFinite, batch_size: int | None
) -> OpFinding:
    """Run the loss computation forward and backward on the recorded model output
    (``grad_names``: the output tensors, ``named_tensors(output, "output")`` names, that a
    gradient reached in the step): name the loss's operation whose backward turned a
    finite gradient into the non-finite one that reached the model's output."""
    output = copy_arguments(step.output)
    leaves = [t for n, t in named_tensors(output, "output") if n in grad_names]
    for t in leaves:
        t.requires_grad_(True)
    if not leaves:
        return OpFinding()
    spy = Spy(batch_size, graph=True)
    amp = step.autocast.applied() if step.autocast is not None else contextlib.nullcontext()
    with torch.enable_grad(), amp, spy:
        loss = compute_loss(output, step.target, step.loss_fn)
    if not loss.requires_grad:
        return OpFinding()
    one = [torch.ones_like(loss)]
    b = _Backward([loss], one, leaves, spy, batch_size, frozenset(), {id(t) for t in leaves})
    return _watched_backward(b, kind)


@dataclass
class LossStep:
    """What a replay of the loss reads: the loss function, the model's output (as the
    exact pass recorded it) and target, and the autocast state the loss ran in."""

    loss_fn: LossFn | None
    output: object
    target: object
    autocast: AutocastState | None = None


@dataclass
class _Backward:
    """One backward replay: the forward's outputs and the gradients they receive, the
    leaves whose gradients the step computed, the spy that named the forward's graph."""

    outs: list[torch.Tensor]
    grads: list[torch.Tensor]
    leaves: list[torch.Tensor]
    spy: Spy
    batch_size: int | None
    params: frozenset[int]  # ids of parameters among the leaves: their gradients have no rows
    judged: set[int]  # ids of the leaves whose non-finite gradient reproduces the step's


def _watched_backward(b: _Backward, kind: NonFinite) -> OpFinding:
    """Run the backward of ``b`` with every named graph node watched: the root (the first
    node that sent a non-finite gradient from finite ones), the chain to the first NaN,
    and whether a judged leaf's gradient went non-finite (``reproduced``)."""
    names = _graph_names(b.outs, b.spy.graph or {})
    watch = _BackwardWatch(names, b.batch_size, b.params)
    handles = [node.register_hook(watch.hook(node)) for node in names]
    try:
        grads_in = torch.autograd.grad(
            b.outs, b.leaves, b.grads, allow_unused=True, retain_graph=True
        )
    finally:
        for h in handles:
            h.remove()
    found = OpFinding(
        reproduced=any(
            g is not None and has_nonfinite(g) and id(t) in b.judged
            for t, g in zip(b.leaves, grads_in)
        )
    )
    end = chain_end(watch.roots, watch.first_nan, kind == NonFinite.NAN)
    if end is None:
        return found
    chain, root = end.path(), root_of(end)
    root_node = watch.records.get(id(root))
    if root_node is not None and hasattr(root_node, "_forward_cls"):
        src = run_backward_source(root_node, watch.grad_outs.get(root_node), b.batch_size)
        if src:
            chain = Chain([ChainLink(chain[0].op, src, chain[0].value, chain[0].rows), *chain[1:]])
    found.chain = chain
    found.op, found.source, found.rows = chain[0].op, chain[0].source, list(chain[0].rows)
    if watch.hidden_nan is not None and watch.hidden_nan is root:
        found.note = (
            f"the backward of {found.op} multiplied a zero gradient by a non-finite local "
            "derivative (a hidden NaN, e.g. behind torch.where or a mask)."
        )
    elif len(chain) > 1 and chain[-1].value == NonFinite.NAN and chain[0].value != NonFinite.NAN:
        found.note = (
            f"the backward of {chain[-1].op} turned an Inf into NaN; the Inf was made by "
            f"{found.op}'s backward."
        )
    return found


def _graph_names(
    outs: list[torch.Tensor], graph: dict[GradNode, NodeName]
) -> dict[GradNode, NodeName]:
    """Every autograd node of the replayed forward, named by the torch call that made it
    (a node made inside a composite takes its consumer's name; a custom Function's node
    is ``ProdFn.backward``)."""
    names: dict[GradNode, NodeName] = {}
    stack: list[tuple[GradNode | None, NodeName | None]] = [(t.grad_fn, None) for t in outs]
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


def _def_line(cls: type) -> str | None:
    try:
        backward = getattr(cls, "backward")  # noqa: B009 - a Function subclass's own
        fn = inspect.getsourcefile(backward)
        _, line = inspect.getsourcelines(backward)
    except (OSError, TypeError):
        return None
    return source_text(fn, line) if fn else None


class _BackwardWatch:
    """Node hooks of a backward replay: roots, the first NaN and the links between."""

    def __init__(
        self,
        names: dict[GradNode, NodeName],
        batch_size: int | None,
        params: frozenset[int] = frozenset(),
    ):
        self.names = names
        self.batch_size = batch_size
        self.params = params  # ids of the module's parameters: their gradients have no rows
        self.roots: list[Node] = []
        self.first_nan: Node | None = None
        self.hidden_nan: Node | None = None
        self.pending: dict[GradNode, Node] = {}  # node -> the consumer that sent it a bad grad
        self.records: dict[int, GradNode] = {}  # id(Node) -> autograd node
        self.grad_outs: dict[GradNode, tuple[torch.Tensor | None, ...]] = {}

    def hook(self, node: GradNode) -> Callable[[Grads, Grads], None]:
        """The hook of one graph node: judges the gradients it sends against those it got."""

        def run(grad_inputs: Grads, grad_outputs: Grads) -> None:
            bad_in = [g for g in grad_inputs if has_nonfinite(g)]
            if not bad_in:
                return
            out_bad = any(has_nonfinite(g) for g in grad_outputs)
            out_nan = any(has_nan(g) for g in grad_outputs)
            value = NonFinite.NAN if any(has_nan(g) for g in bad_in) else NonFinite.INF
            op, src = self.names[node]
            rec = Node(op, src, value, self.pending.get(node) if out_bad else None, [])
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
            if value == NonFinite.NAN and not out_nan and self.first_nan is None:
                rec.rows = rec.rows or self._rows(node, grad_inputs)
                self.first_nan = rec
            for (nxt, _), g in zip(node.next_functions, grad_inputs):
                if nxt is not None and has_nonfinite(g):
                    self.pending.setdefault(nxt, rec)

        return run

    def _rows(self, node: GradNode, grad_inputs: Grads) -> list[int]:
        """The batch rows of the first non-finite gradient the node sends to something
        other than a parameter (a weight's gradient has no batch dimension, even where
        one of its sizes equals the batch size)."""
        for (nxt, _), g in zip(node.next_functions, grad_inputs):
            if has_nonfinite(g) and not self._to_param(nxt):
                return bad_rows(g, self.batch_size)
        return []

    def _to_param(self, node: GradNode | None) -> bool:
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


def _zero_where_bad(grads: Grads, bad: torch.Tensor) -> bool:
    """Whether the incoming gradient is exactly zero wherever ``bad`` is non-finite."""
    with torch._C.DisableTorchFunction():
        mask = ~torch.isfinite(bad)
        for g in grads:
            if isinstance(g, torch.Tensor) and g.shape == bad.shape:
                return bool((g[mask] == 0).all())
    return False


def run_backward_source(
    node: GradNode, grad_outputs: Grads | None, batch_size: int | None
) -> str | None:
    """The line of a custom Function's backward that made the value: run that backward
    once more (the graph was retained) on the gradients it received, under the spy."""
    if grad_outputs is None:
        return None
    spy = Spy(batch_size)
    try:
        with torch.no_grad(), spy:
            getattr(node, "_forward_cls").backward(node, *grad_outputs)  # noqa: B009
    except Exception:
        return None
    chain = spy.chain(False)
    return chain[0].source if chain else None
