"""The records a trace is made of: :class:`Event` (one tensor seen at one point of the
forward or backward pass) and :class:`ParamInfo` (one parameter after the backward)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..stats import Histogram, TensorStats
from ..text import rows_text
from ..vocab import EventKind, NonFinite, Phase

#: the phases of a traced step, in order
PHASES = (Phase.INPUT, Phase.FORWARD, Phase.LOSS, Phase.BACKWARD)


class ChainLink(str):
    """One operation of an origin's chain, read as ``"Tensor.div (inf)"``.

    A ``str`` (so ``"div" in link`` and ``" -> ".join(chain)`` work) with attributes:
    ``op`` (the torch operation, ``"Tensor.div"``, ``"ProdFn.backward"``), ``source``
    (``"model.py:83"`` or ``None``), ``value`` (what its output held that its inputs did
    not: ``"inf"`` or ``"NaN"``) and ``rows`` (batch rows of that output, when known).
    """

    op: str
    source: str | None
    value: NonFinite
    rows: list[int]

    def __new__(
        cls, op: str, source: str | None, value: str, rows: list[int] | None = None
    ) -> ChainLink:
        link = super().__new__(cls, f"{op} ({value})")
        link.op, link.source, link.rows = op, source, list(rows or [])
        link.value = NonFinite(value)
        return link

    def __reduce__(self) -> tuple[object, ...]:
        return (ChainLink, (self.op, self.source, self.value, self.rows))

    def made(self) -> str:
        """``"Inf made by Tensor.div at model.py:83"``."""
        where = f" at {self.source}" if self.source else ""
        return f"{'NaN' if self.value == NonFinite.NAN else 'Inf'} made by {self.op}{where}"


class Chain(list[ChainLink]):
    """The operations from the root (the first that turned finite values into a
    non-finite one) to the first NaN, in order: ``Tensor.div (inf) -> linear (NaN)``.
    One link when the root made the NaN itself (or only an Inf was produced); empty
    when the op-level replay could not tell."""

    def __str__(self) -> str:
        return " -> ".join(self)

    def __repr__(self) -> str:
        return f"Chain({' -> '.join(self)})" if self else "Chain()"

    def describe(self) -> str:
        """``"Inf made by Tensor.div at model.py:83, NaN by linear at model.py:84"``."""
        if not self:
            return ""
        text = self[0].made()
        if len(self) > 1 and self[-1].value == NonFinite.NAN and self[0].value != NonFinite.NAN:
            last = self[-1]
            text += f", NaN by {last.op}" + (f" at {last.source}" if last.source else "")
        return text


@dataclass
class Event:
    """One tensor observed during :func:`nbdebug.trace`, in execution order.

    Attributes
    ----------
    index : int
        Position in ``Trace.events``.
    phase : Phase
        A ``str`` enum (:class:`nbdebug.core.vocab.Phase`, equal to its value):
        ``"input"`` (the batch and the target), ``"forward"`` (a module's output),
        ``"loss"`` or ``"backward"`` (a gradient).
    module : str
        Qualified name as in ``model.named_modules()``; ``""`` is the model itself (and
        the batch and the loss).
    kind : EventKind
        A ``str`` enum (:class:`nbdebug.core.vocab.EventKind`): ``"input"`` (a batch
        tensor), ``"target"`` (a tensor of ``target``, the second argument of the loss),
        ``"output"``, ``"loss"``, ``"grad_output"`` (gradient arriving at a module's
        output), ``"grad_input"`` (gradient leaving a module through an input that no
        other module produced) or ``"param_grad"``.
    name : str
        Which tensor: ``"output"``, ``"output[1]"``, ``"output['logits']"``, an input
        name, or a parameter name for ``param_grad``.
    shape : tuple of int
    dtype : str
        e.g. ``"float32"``.
    stats : TensorStats
        norm, mean, std, min, max, absmax, zero_frac, n_nan, n_inf.
    hist : Histogram
        32 fixed bins of log10|x|.
    samples : list of int
        Batch rows holding non-finite values.
    call : int
        Module call number (``-1`` for the batch and the loss); a module called twice
        has two calls.
    depth : int
        Nesting depth of the module (the model is 0).
    module_type : str
        Class name of the module.
    op, source : str or None
        For the origin: the root torch operation, the first that turned finite values
        into a non-finite one (``"torch.log"``, ``"Tensor.div"``, ``"ProdFn.backward"``),
        and the first ``"file.py:line"`` outside torch's own files that called it (for a
        module of torch's own, the line that called the module; where only torch's code
        called it, a torch module inside ``nn.Sequential`` or a torch loss function, the
        line in torch that ran it, ``"torch/nn/modules/linear.py:134"``).
    chain : Chain
        For the origin: the operations from the root to the first NaN, each a
        :class:`ChainLink` (``Tensor.div (inf) -> linear (NaN)``).
    param : str or None
        For a parameter gradient, or an origin caused by a corrupted parameter or buffer,
        its qualified name.
    note : str
        A sentence that explains the origin, when there is one (for people: every fact
        in it is also a field).
    corrupted : bool
        For the origin: ``param`` already held non-finite values before the step (the
        weights were corrupted, nothing in the step made the value).
    """

    index: int
    phase: Phase
    module: str
    kind: EventKind
    name: str
    shape: tuple[int, ...]
    dtype: str
    stats: TensorStats
    hist: Histogram
    samples: list[int] = field(default_factory=list)
    call: int = -1
    depth: int = 0
    module_type: str = ""
    op: str | None = None
    source: str | None = None
    param: str | None = None
    note: str = ""
    chain: Chain = field(default_factory=Chain)
    corrupted: bool = False

    @property
    def finite(self) -> bool:
        return self.stats.finite

    @property
    def label(self) -> str:
        """Short human-readable name: ``"forward encoder.layers.0 output"``."""
        where = self.module or "<model>"
        if self.phase == Phase.LOSS:
            return "loss"
        if self.phase == Phase.INPUT:
            return f"input {self.name}"
        return f"{self.phase} {where} {self.name}"

    def __repr__(self) -> str:
        bad = ""
        if not self.finite:
            bad = f" nan={self.stats.n_nan} inf={self.stats.n_inf}"
            if self.samples:
                bad += f" {rows_text(self.samples)}"
        extra = ""
        if self.op or self.source:
            extra = f" op={self.op} at {self.source}"
        if len(self.chain) > 1:
            extra += f" chain={self.chain}"
        if self.param:
            extra += f" param={self.param}"
        return (
            f"Event(#{self.index} {self.phase} {self.module or '<model>'!s} {self.name} "
            f"{tuple(self.shape)} {self.dtype} norm={self.stats.norm:.4g}{bad}{extra})"
        )


@dataclass
class ParamInfo:
    """One parameter after the traced backward (the user's own ``.grad`` is untouched).

    Attributes
    ----------
    name : str
        Qualified name as in ``model.named_parameters()``.
    module : str
        Qualified name of the module that owns it.
    shape : tuple of int
    dtype : str
    requires_grad : bool
    norm : float
        L2 norm of the weight.
    grad_norm : float or None
        L2 norm of its gradient in the traced step (``None``: it got no gradient).
    n_nan, n_inf : int
        Non-finite elements of the weight.
    grad_n_nan, grad_n_inf : int
        Non-finite elements of the gradient.
    ratio : float or None
        ``grad_norm / norm`` (property).

    Examples
    --------
    >>> worst = max(tr.params, key=lambda p: p.ratio or 0.0)
    >>> worst.name, worst.ratio
    """

    name: str
    module: str
    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool
    norm: float
    grad_norm: float | None
    n_nan: int
    n_inf: int
    grad_n_nan: int
    grad_n_inf: int

    @property
    def ratio(self) -> float | None:
        """grad norm / weight norm (``None`` without a gradient; NaN for a gradient holding
        NaN and for a zero weight, where the ratio is undefined; inf for an Inf gradient)."""
        if self.grad_norm is None:
            return None
        if self.grad_n_nan:
            return float("nan")
        if self.grad_n_inf:
            return float("inf")
        if self.norm == 0:
            return float("nan")
        return self.grad_norm / self.norm
