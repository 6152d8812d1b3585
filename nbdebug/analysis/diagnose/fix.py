"""The fix protocol of :func:`nbdebug.diagnose`: :class:`Replay` (what a replay runs on)
and :class:`Fix` (a small object that changes one thing in a replay).

Each fix has a ``kind`` (a :class:`~nbdebug.core.vocab.FixKind`), the ``module`` it is
aimed at (a qualified name as in ``model.named_modules()``, ``""`` for the whole model,
``None`` when it is aimed at the batch, the loss or the optimizer) and the batch ``rows``
it is aimed at, and these methods:

``applies(trace) -> bool``
    Whether the fix makes sense for the traced failing step.
``apply(replay)``
    A context manager that changes the :class:`Replay` (the copies a replay runs on: model,
    optimizer, batch, loss function, scaler) and undoes its change on exit. Nothing outside
    the replay is touched.
``describe() -> str``
    What is changed, in words (``"drop batch row 3"``); :meth:`Fix.action` says it as the
    doing (``"dropping batch row 3"``) and :meth:`Fix.snippet` gives it as code to paste.

A user fix subclasses :class:`Fix` (or has ``apply`` and ``describe``) and is passed in
``diagnose(..., fixes=[...])``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ...core.trace import Trace
from ...core.vocab import FixKind

__all__ = ["KINDS", "LOCALITY", "Fix", "FixLike", "Replay", "forward_replaced", "kind_of"]

#: The documented fix kinds (the values of :class:`~nbdebug.core.vocab.FixKind`).
KINDS: tuple[str, ...] = tuple(k.value for k in FixKind)

#: Lower is more local: one op, a few rows, one module, the model, the update.
LOCALITY: dict[FixKind, float] = {
    FixKind.EPSILON: 0.0,
    FixKind.DROP_ROWS: 1.0,
    FixKind.FLOAT32: 2.0,
    FixKind.CUSTOM: 2.5,
    FixKind.SCALER: 4.0,
    FixKind.CLIP_GRAD: 4.0,
    FixKind.LOWER_LR: 4.0,
    FixKind.WEIGHTS_CORRUPTED: 9.0,
    FixKind.NOT_REPRODUCIBLE: 9.0,
    FixKind.DIVERGED: 9.0,
    FixKind.RERUN: 9.0,
}

#: A context manager factory (``nullcontext``, a ``TorchFunctionMode`` class, ...).
ContextFactory = Callable[[], AbstractContextManager[Any]]


@contextmanager
def forward_replaced(
    m: torch.nn.Module, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> Iterator[None]:
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

    Examples
    --------
    >>> r = Replay(model=model, inputs=x, target=y, loss_fn=F.cross_entropy)
    >>> with EpsilonFix("norm", "div").apply(r):
    ...     out = r.model(r.inputs)
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    inputs: Any = None  # a batch: a tensor, a tuple/list or a dict of them
    target: Any = None
    loss_fn: Callable[..., Any] | None = None
    scaler: torch.amp.GradScaler | None = None
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
    def around_forward(self, name: str, make: ContextFactory) -> Iterator[None]:
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
    def around_loss(self, make: ContextFactory) -> Iterator[None]:
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


# ---------------------------------------------------------------------- the protocol
@runtime_checkable
class FixLike(Protocol):
    """What :func:`nbdebug.diagnose` needs of a fix object: ``apply`` and ``describe``
    (``kind``, ``module``, ``rows``, ``applies``, ``why_not``, ``action``, ``snippet``
    and ``locality`` are read when present)."""

    def apply(self, replay: Replay) -> AbstractContextManager[Any]: ...

    def describe(self) -> str: ...


def kind_of(fix: object) -> FixKind:
    """The fix's kind as a :class:`~nbdebug.core.vocab.FixKind`: its ``kind`` attribute
    (a member or its string), ``custom`` when it has none or one outside the vocabulary."""
    kind = getattr(fix, "kind", FixKind.CUSTOM)
    try:
        return FixKind(kind)
    except ValueError:
        return FixKind.CUSTOM


# ---------------------------------------------------------------------- base class
class Fix:
    """A candidate fix for :func:`nbdebug.diagnose`. Subclass it and override
    :meth:`apply` (and :meth:`applies`, :meth:`describe`, :meth:`action`, :meth:`snippet`)
    for a fix of your own, then pass it in ``diagnose(..., fixes=[MyFix()])``.

    Attributes
    ----------
    kind : FixKind
        One of :data:`KINDS` (a :class:`~nbdebug.core.vocab.FixKind`; its string works too).
    module : str or None
        The module it changes (``""``: the model; ``None``: the batch, loss or optimizer).
    rows : list of int
        The batch rows it is aimed at (empty: all).
    op : str or None
        For an epsilon: the operation rewritten (``"div"``, ``"log"``, ...).
    locality : float or None
        Lower is more local (one op < rows < a module < the model < the update): the
        ranking prefers the most local fix that makes the step finite. ``None``: the
        kind's default.

    Examples
    --------
    >>> class SwapNorm(nbdebug.Fix):
    ...     module = "norm"
    ...     @contextmanager
    ...     def apply(self, replay):
    ...         old, replay.model.norm = replay.model.norm, SafeNorm()
    ...         try:
    ...             yield
    ...         finally:
    ...             replay.model.norm = old
    ...     def describe(self):
    ...         return "Normalize with eps=1e-5"
    >>> nbdebug.diagnose(snap, fixes=[SwapNorm(), "drop_rows"])
    """

    kind: FixKind = FixKind.CUSTOM
    module: str | None = None
    rows: list[int]
    op: str | None = None
    locality: float | None = None

    def __init__(self) -> None:
        self.rows = []

    def applies(self, trace: Trace) -> bool:
        """Whether this fix makes sense for ``trace`` (the failing step)."""
        return True

    def why_not(self, trace: Trace | None) -> str:
        """One sentence saying why :meth:`applies` is false."""
        return f"the fix {self.describe()} does not apply to this step."

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        """Change ``replay`` for the duration of the block (and undo it on exit)."""
        yield

    def describe(self) -> str:
        """What the fix changes, in words (``"drop batch row 3"``)."""
        return type(self).__name__

    def action(self) -> str:
        """The change as the doing of it, for a sentence that lists the fixes that also
        work (``"dropping batch row 3"``). Default: :meth:`describe`."""
        return self.describe()

    def snippet(self) -> str:
        """The change as code the user can paste."""
        return ""

    @property
    def rank_locality(self) -> float:
        """:attr:`locality`, or the kind's default from :data:`LOCALITY`."""
        if self.locality is not None:
            return float(self.locality)
        return LOCALITY.get(kind_of(self), 2.5)

    def __repr__(self) -> str:
        where = "" if self.module is None else f" in {self.module or '<model>'}"
        rows = f" rows {self.rows}" if self.rows else ""
        return f"{type(self).__name__}({self.kind}{where}{rows}: {self.describe()})"
