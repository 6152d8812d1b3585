"""The spy of an op-level replay: follows non-finite values from torch operation to torch
operation and finds the root and the chain to the first NaN.

* the **root** is the first operation whose inputs were finite and whose output is not
  (NaN or Inf);
* an **intended mask** is not a root: an operation that writes a constant ``-inf``
  (``masked_fill``, ``where``, ``full`` with an infinite value argument), an input marked
  as a mask (a ``-inf`` attention mask from the batch), and what only carries such
  values on (``scores + mask``) are tagged as masks; an operation that turns masks into
  NaN (the softmax of a fully masked row) is a root, and so is, for a result that must
  not be a mask (a loss), the first operation on the masks' way to it;
* the **chain** links every operation that consumed a non-finite value to the one that
  produced it, so the first NaN leads back to its root: ``Tensor.div (inf) -> linear (NaN)``;
* composite torch functions (:mod:`.ops`) are descended into when they are the root;
* sources are the user's frames (:func:`.frames.user_source`).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..batch import named_tensors
from ..optable import base_name
from ..state import RngState
from ..stats import has_nan, has_nonfinite, row_dim, row_flags
from ..vocab import NonFinite
from .events import Chain, ChainLink
from .frames import user_source
from .ops import descendable, op_name, shadow

#: a torch function or method as a ``TorchFunctionMode`` receives it
TorchCallable = Callable[..., object]
#: an autograd graph node (``tensor.grad_fn``)
GradNode = torch.autograd.graph.Node

__all__ = [
    "UNSEEN",
    "Node",
    "OpFinding",
    "Spy",
    "bad_rows",
    "chain_end",
    "finding",
    "root_of",
    "tensors_of",
]

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


def tensors_of(obj: object) -> list[torch.Tensor]:
    """The tensors in a nested structure (``named_tensors`` order)."""
    return [t for _, t in named_tensors(obj)]


def bad_rows(t: torch.Tensor, batch_size: int | None) -> list[int]:
    """The batch rows of ``t`` holding a NaN or Inf (none when it has no batch dimension)."""
    d = row_dim(t.shape, batch_size)
    if d is None or t.layout != torch.strided:
        return []
    with torch._C.DisableTorchFunction():
        rows: list[int] = torch.nonzero(row_flags(t, d)).flatten().tolist()
        return rows


def _inf_constant(obj: object, depth: int = 0) -> bool:
    """Whether a non-tensor argument is an infinite constant (``float("-inf")``)."""
    if isinstance(obj, float):
        return math.isinf(obj)
    if isinstance(obj, (tuple, list)) and depth < 3:
        return any(_inf_constant(v, depth + 1) for v in obj)
    if isinstance(obj, dict) and depth < 3:
        return any(_inf_constant(v, depth + 1) for v in obj.values())
    return False


@dataclass
class Node:
    """A tensor's non-finite values: the op that made them and where they came from."""

    op: str
    source: str | None
    value: NonFinite
    parent: Node | None
    rows: list[int]

    def path(self) -> Chain:
        links: list[ChainLink] = []
        n: Node | None = self
        while n is not None:
            links.append(ChainLink(n.op, n.source, n.value, n.rows))
            n = n.parent
        return Chain(reversed(links))


class Spy(TorchFunctionMode):
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
        self.roots: list[Node] = []
        self.first_nan: Node | None = None
        self._nodes: dict[int, tuple[weakref.ref[torch.Tensor], Node]] = {}
        # mask tensors, each with the op that carried the mask into it (None: from outside)
        self._masks: dict[int, tuple[weakref.ref[torch.Tensor], Node | None]] = {}
        self.depth = 0
        # backward replays: autograd node -> (op, source) of the call that made it
        self.graph: dict[GradNode, tuple[str, str | None]] | None = {} if graph else None

    # tags ---------------------------------------------------------------
    def node_of(self, t: torch.Tensor) -> Node | None:
        hit = self._nodes.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def is_mask(self, t: torch.Tensor) -> bool:
        hit = self._masks.get(id(t))
        return hit is not None and hit[0]() is t

    def mask_node(self, t: torch.Tensor) -> Node | None:
        """The op that carried an intended mask into ``t`` (its ``parent``: the op before
        it on the mask's way), ``None`` when ``t`` is no mask or came from outside."""
        hit = self._masks.get(id(t))
        return hit[1] if hit is not None and hit[0]() is t else None

    def tag_mask(self, t: torch.Tensor, node: Node | None = None) -> None:
        self._nodes.pop(id(t), None)
        self._masks[id(t)] = (weakref.ref(t), node)

    def _tag(self, t: torch.Tensor, node: Node) -> None:
        self._masks.pop(id(t), None)
        self._nodes[id(t)] = (weakref.ref(t), node)

    def _forget(self, t: torch.Tensor) -> None:
        self._nodes.pop(id(t), None)
        self._masks.pop(id(t), None)

    # the mode -----------------------------------------------------------
    def __torch_function__(
        self,
        func: TorchCallable,
        types: Sequence[type],
        args: Sequence[object] = (),
        kwargs: dict[str, object] | None = None,
    ) -> object:
        kwargs = kwargs or {}
        descend = self.depth < _MAX_DESCENT and descendable(func)
        if self.graph is not None and descend and func is not F.scaled_dot_product_attention:
            # a backward replay: run composites with their body visible from the start,
            # so that their autograd nodes are named by the elementary operations
            out = self._inside(func, args, kwargs)
            descend = False
        else:
            out = None
        rng = RngState.capture() if descend else None
        if out is None:
            out = func(*args, **kwargs)
        outs = tensors_of(out)
        if not outs and func is torch.Tensor.__setitem__ and isinstance(args[0], torch.Tensor):
            outs = [args[0]]  # ``t[rows] = value`` returns nothing: it writes ``t``
        if not outs:
            return out
        if self.graph is not None:
            self._name_nodes(func, outs, self.graph)
        bad = [t for t in outs if has_nonfinite(t)]
        if not bad:
            for t in outs:
                self._forget(t)
            return out
        parent, mask_in, in_nan, unseen, via = self._sources((args, kwargs), {id(t) for t in outs})
        value = NonFinite.NAN if any(has_nan(t) for t in bad) else NonFinite.INF
        if unseen and parent is None:
            parent = Node(UNSEEN, None, NonFinite.NAN, None, bad_rows(bad[0], self.batch_size))
            self._root(parent)
        if parent is not None:
            node = Node(op_name(func), user_source(self.call_site), value, parent, [])
            if value == NonFinite.NAN and not in_nan and self.first_nan is None:
                node.rows = bad_rows(bad[0], self.batch_size)
                self.first_nan = node
            for t in bad:
                self._tag(t, node)
            return out
        if value == NonFinite.INF and (mask_in or _inf_constant((args, kwargs))):
            # (no rows: a mask's rows are not a finding, and an attention mask is big)
            carried = Node(op_name(func), user_source(self.call_site), value, via, [])
            for t in bad:
                self.tag_mask(t, carried)
            return out
        if descend and rng is not None:
            inner = self._descend(func, args, kwargs, rng)
            if inner is not None:
                return inner
        node = Node(
            op_name(func),
            user_source(self.call_site),
            value,
            None,
            bad_rows(bad[0], self.batch_size),
        )
        self._root(node)
        for t in bad:
            self._tag(t, node)
        return out

    def _inside(
        self, func: TorchCallable, args: Sequence[object], kwargs: dict[str, object]
    ) -> object:
        """``func`` run with its body visible to the spy (one level deeper)."""
        self.depth += 1
        try:
            with self:
                return shadow(func)(*args, **kwargs)
        finally:
            self.depth -= 1

    def _name_nodes(
        self,
        func: TorchCallable,
        outs: list[torch.Tensor],
        graph: dict[GradNode, tuple[str, str | None]],
    ) -> None:
        """Backward replays: the autograd nodes of ``outs`` named by the call that made them
        (a composite's inner node keeps its elementary name unless this is the same op)."""
        name = op_name(func)
        for t in outs:
            seen = graph.get(t.grad_fn) if t.grad_fn is not None else None
            if t.grad_fn is not None and (seen is None or base_name(seen[0]) == base_name(name)):
                graph[t.grad_fn] = (name, user_source(self.call_site))

    def _sources(
        self, arguments: object, same: set[int]
    ) -> tuple[Node | None, bool, bool, bool, Node | None]:
        """What the arguments of a call that made a non-finite value carried: the node of
        the first tagged one (its parent), whether a mask or a NaN came in, whether a
        NaN came from code the spy cannot see, and the op that carried the first mask in
        (``None`` for a mask from outside). ``same``: ids of the call's outputs."""
        parent: Node | None = None
        via: Node | None = None
        mask_in = in_nan = unseen = False
        for t in tensors_of(arguments):
            node = self.node_of(t)
            if node is not None:
                parent = parent or node
                in_nan = in_nan or node.value == NonFinite.NAN
            elif self.is_mask(t):
                via = via if mask_in else self.mask_node(t)
                mask_in = True
            elif id(t) in same or isinstance(t, torch.nn.Parameter):
                continue  # written in place / a weight: finite before as far as we know
            elif has_nonfinite(t):
                if has_nan(t):
                    if self.known is not None and id(t) not in self.known:
                        unseen = True  # made by code the spy cannot see
                    continue  # a NaN from outside the replay (a buffer): this op is the root
                mask_in = True  # an -inf from outside (a mask buffer, a mask input)
        return parent, mask_in, in_nan, unseen, via

    def _root(self, node: Node) -> None:
        self.roots.append(node)
        if node.value == NonFinite.NAN and self.first_nan is None:
            self.first_nan = node

    def _descend(
        self, func: TorchCallable, args: Sequence[object], kwargs: dict[str, object], rng: RngState
    ) -> object:
        """Run a composite again with its body visible; ``None`` when nothing inside it
        was seen making the value (then the composite itself is the root)."""
        n_roots, first_nan = len(self.roots), self.first_nan
        rng.restore()
        self.depth += 1
        try:
            with self:
                out = shadow(func)(*args, **kwargs)
        except Exception:
            return None
        finally:
            self.depth -= 1
        bad = [t for t in tensors_of(out) if has_nonfinite(t)]
        if not bad or len(self.roots) == n_roots:
            del self.roots[n_roots:]
            self.first_nan = first_nan
            return None
        outer = op_name(func)
        for root in self.roots[n_roots:]:
            if base_name(root.op) == base_name(outer) and root.parent is None:
                root.op = outer  # a thin wrapper (F.softmax -> Tensor.softmax): its own name
        return out

    # results ------------------------------------------------------------
    def chain(self, prefer_nan: bool) -> Chain:
        end = chain_end(self.roots, self.first_nan, prefer_nan)
        return end.path() if end is not None else Chain()


def chain_end(roots: list[Node], first_nan: Node | None, prefer_nan: bool) -> Node | None:
    """The last node of the chain: the first NaN when the value looked for is NaN or
    when that NaN descends from the first root; else the first root."""
    if first_nan is not None and (prefer_nan or not roots or root_of(first_nan) is roots[0]):
        return first_nan
    return roots[0] if roots else None


def root_of(node: Node) -> Node:
    while node.parent is not None:
        node = node.parent
    return node


#: the root of a chain whose first NaN came out of code the spy cannot see
UNSEEN = "<unseen code>"


def finding(spy: Spy, kind: NonFinite, end: torch.Tensor | None = None) -> OpFinding:
    """The replay's finding from its spy: the root op and source, the chain, rows and the
    note (``kind``: the value looked for, the chain ends at the first NaN for NaN).

    ``end``: the replay's result when it must not be a mask (a loss): if no root made
    it non-finite but intended masks did, the root is the first op on the masks' way to
    it (``F.cross_entropy`` of logits masked with ``-inf`` at a row's own label)."""
    chain = spy.chain(kind == NonFinite.NAN)
    via = spy.mask_node(end) if end is not None and not chain else None
    if via is not None:
        # masks carry only infinities: the chain (root to the first NaN) is the root
        chain = Chain(via.path()[:1])
        f = OpFinding(chain=chain, reproduced=True, rows=list(chain[0].rows))
        f.op, f.source = chain[0].op, chain[0].source
        f.note = (
            f"made from intended masks (infinite values used as a mask): {chain[0].op} "
            "turned them into the non-finite result instead of leaving them out."
        )
        return f
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
        if len(chain) > 1 and last.value == NonFinite.NAN and root.value != NonFinite.NAN:
            f.note = (
                f"{last.op} turned an Inf into NaN; the Inf was made by {root.op}"
                + (f" at {root.source}" if root.source else "")
                + "."
            )
            f.rows = list(last.rows) or f.rows
    return f
