"""The keyword options of :func:`nbdebug.diagnose`, checked once into a frozen
:class:`DiagnoseOptions`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from ...core.batch import check_flag
from ...core.options import refuse_unknown
from ...core.vocab import FixKind
from .fix import KINDS, Fix, FixLike

__all__ = ["DiagnoseOptions", "FixChoice"]


@dataclass(frozen=True)
class FixChoice:
    """The fixes to try: ``kinds`` selects from the menu (``None``: the whole menu; an
    empty set: none of it) and ``extra`` are the user's fix objects."""

    kinds: frozenset[FixKind] | None = None
    extra: tuple[FixLike, ...] = ()


def _choose(fixes: object) -> FixChoice:
    if fixes is None:
        return FixChoice()
    one = isinstance(fixes, (str, Fix)) or not isinstance(fixes, Sequence)
    items: Sequence[object] = [fixes] if one else fixes  # type: ignore[assignment]
    kinds: set[FixKind] = set()
    objs: list[FixLike] = []
    for f in items:
        if isinstance(f, str):
            if f not in KINDS:
                raise ValueError(f"unknown fix kind {f!r}; the kinds are {', '.join(KINDS)}.")
            kinds.add(FixKind(f))
        elif callable(getattr(f, "apply", None)):
            objs.append(f)  # type: ignore[arg-type]
        else:
            raise TypeError(
                "fixes must hold fix kinds (str) or fix objects with applies(), apply() and "
                f"describe(); got {type(f).__qualname__}."
            )
    return FixChoice(frozenset(kinds), tuple(objs))


@dataclass(frozen=True)
class DiagnoseOptions:
    """The keyword options of :func:`nbdebug.diagnose` (each described there), checked.

    ``diagnose(source, ..., steps=3)`` and ``diagnose(source, ...,
    options=DiagnoseOptions(steps=3))`` are the same call.

    Attributes
    ----------
    scaler : torch.amp.GradScaler or None
    history : NaNGuard, list of dict, DataFrame or None
    fixes : str, Fix or sequence of them, or None
    steps : int
    budget_s : float or None
    trust_recipe : bool
    progress : bool
    autocast : bool
    choice : FixChoice
        ``fixes`` sorted into menu kinds and fix objects (derived, not a parameter).

    Examples
    --------
    >>> opts = nbdebug.DiagnoseOptions(steps=3, fixes=["epsilon", "drop_rows"])
    >>> nbdebug.diagnose(snap, options=opts)
    """

    scaler: torch.amp.GradScaler | None = None
    history: object = None
    fixes: object = None
    steps: int = 1
    budget_s: float | None = None
    trust_recipe: bool = False
    progress: bool = True
    autocast: bool = True
    choice: FixChoice = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        steps, budget = self.steps, self.budget_s
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1; got {steps!r}.")
        if budget is not None and (
            isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget < 0
        ):
            raise ValueError(f"budget_s must be a number of seconds >= 0 or None; got {budget!r}.")
        check_flag(self.autocast, "autocast")
        object.__setattr__(self, "choice", _choose(self.fixes))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in order."""
        return tuple(f.name for f in fields(cls) if f.init)

    @classmethod
    def of(cls, options: DiagnoseOptions | None, keywords: Mapping[str, object]) -> DiagnoseOptions:
        """``options`` (default: the defaults) with ``keywords`` put in; a ``TypeError``
        naming an unknown keyword and the allowed ones."""
        if options is not None and not isinstance(options, DiagnoseOptions):
            raise TypeError(f"options must be a DiagnoseOptions; got {type(options).__qualname__}.")
        refuse_unknown(
            keywords, cls.names(), where="diagnose()", listed=("model", "optimizer", "options")
        )
        base = options if options is not None else cls()
        return replace(base, **keywords) if keywords else base  # type: ignore[arg-type]
