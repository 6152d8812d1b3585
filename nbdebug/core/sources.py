"""Providers that a layer beside or above core hands core lazily, by name.

Core never imports analysis or the UI. Where core needs what those layers provide (the
health checks behind ``NaNGuard(checks=True)``), ``import nbdebug`` adds a *source* here: a
zero-argument callable that imports the provider's module and registers it. Core runs the
sources of a name (:func:`load_sources`) the first time it needs that provider, so nothing
is imported before it is used. This module imports nothing, so ``import nbdebug`` stays
cheap.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = [
    "COMPILER_VERDICT",
    "GUARD_CHECKS",
    "PRECISION_EVIDENCE",
    "add_source",
    "load_sources",
    "provide",
    "provider",
]

#: the name of the provider of ``NaNGuard(checks=True | int | dict)``
GUARD_CHECKS = "guard checks"
#: the name of the provider of ``compiler_verdict(snapshot, ...)`` (whether a compiled
#: model's NaN is the compiler's), which ``diagnose`` reads for a compiled model's snapshot
COMPILER_VERDICT = "compiler verdict"
#: the name of the provider of ``precision_evidence(source, ...)`` (the step as it ran vs
#: float64, op by op), which ``diagnose`` gives as the evidence of a ``float32`` fix
PRECISION_EVIDENCE = "precision evidence"

_SOURCES: dict[str, list[Callable[[], None]]] = {}
_PROVIDED: dict[str, Callable[..., object]] = {}


def add_source(name: str, source: Callable[[], None]) -> None:
    """``source()`` registers a provider of ``name``; it runs (once) when core first needs
    one (:func:`load_sources`)."""
    _SOURCES.setdefault(name, []).append(source)


def load_sources(name: str) -> bool:
    """Run the next source of ``name``; ``False`` when none is left."""
    waiting = _SOURCES.get(name)
    if not waiting:
        return False
    waiting.pop(0)()
    return True


def provide(name: str, function: Callable[..., object]) -> None:
    """Register ``function`` as the provider of ``name`` (a source calls this)."""
    _PROVIDED[name] = function


def provider(name: str) -> Callable[..., object] | None:
    """The provider of ``name``, its sources run first if needed; ``None``: none exists."""
    while name not in _PROVIDED and load_sources(name):
        pass
    return _PROVIDED.get(name)
