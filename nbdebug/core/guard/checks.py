"""The health checks a guard runs after each decision: the :class:`StepChecks` it is given,
and the registry that turns ``checks=True`` / a number of steps / a dict into one.

Core never imports the health checks (they live in :mod:`nbdebug.analysis.checks.guard`,
a layer beside core that imports it). ``import nbdebug`` hands their module to
:mod:`nbdebug.core.sources` as the source of :data:`~nbdebug.core.sources.GUARD_CHECKS`,
imported on the first :func:`resolve_checks` that needs it, which registers its resolver
(:func:`register_checks`). So there is one
guard class, :class:`nbdebug.NaNGuard`, whatever path it is imported from.
"""

from __future__ import annotations

import abc
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from ..sources import GUARD_CHECKS, load_sources

if TYPE_CHECKING:  # pragma: no cover
    from ..snapshot.write import Scaler
    from .history import HistoryRow
    from .reading import StepReading

__all__ = ["GuardView", "StepChecks", "register_checks", "resolve_checks"]


class GuardView(Protocol):
    """What the health checks read of a guard: its live training objects and history."""

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer | None: ...

    @property
    def scaler(self) -> Scaler | None: ...

    @property
    def history(self) -> deque[HistoryRow]: ...


class StepChecks(abc.ABC):
    """What ``NaNGuard(checks=...)`` calls after each decision: health checks on the live
    model, owned by an object that keeps its own state (cadence, what it recorded).

    :class:`nbdebug.GuardChecks` implements this; ``checks=True`` / an int / a dict
    become one through the registry of this module.
    """

    def attach(self, guard: GuardView) -> None:  # noqa: B027 (optional hook)
        """Called once by ``NaNGuard.__init__`` with the guard it serves."""

    @abc.abstractmethod
    def run(self, guard: GuardView, reading: StepReading, *, failing: bool) -> Mapping[str, object]:
        """Check the step just read; return the fields to add to its history row
        (e.g. ``{"checks": [...]}``), empty when this step is not checked. Never raises."""


#: turns a ``checks=`` value other than a StepChecks / False / None into a StepChecks
ChecksResolver = Callable[[object], "StepChecks | None"]
_RESOLVERS: list[ChecksResolver] = []


def register_checks(resolver: ChecksResolver) -> None:
    """Resolve ``checks=True`` / an int / a dict with ``resolver`` (replacing any other)."""
    _RESOLVERS[:] = [resolver]


def resolve_checks(checks: object) -> StepChecks | None:
    """The ``checks=`` option as a :class:`StepChecks` (``None``: off): a ``StepChecks``
    object as it is, ``False``/``None`` off, anything else through the registered resolver
    (``True``, a number of steps, a dict: a new ``GuardChecks`` each time).

    Raises
    ------
    TypeError
        No resolver is registered (the health checks were never made available).
    ValueError
        A value the resolver refuses.
    """
    if checks is None or checks is False:
        return None
    if isinstance(checks, StepChecks):
        return checks
    while not _RESOLVERS and load_sources(GUARD_CHECKS):
        pass
    if not _RESOLVERS:
        raise TypeError(
            "NaNGuard(checks=...) takes a StepChecks object here: no health checks are "
            "registered for checks=True, a number of steps or a dict (import nbdebug "
            f"registers them); got {checks!r}."
        )
    return _RESOLVERS[0](checks)
