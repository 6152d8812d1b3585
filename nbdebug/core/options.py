"""Keyword options of a public entry point, grouped in frozen dataclasses: one home.

An entry point with more options than its signature should carry (``NaNGuard``,
``diagnose``, ``drift``, ``check``, ``gradcheck``, ``debug``, ...) takes them as
``**options`` and builds its frozen options dataclass with :func:`options_from` (flat
fields) or :func:`grouped_options` (fields spread over nested groups, as a user thinks of
them). Both refuse an unknown name the way Python refuses an unknown keyword argument: one
sentence naming it, the closest allowed name, and every name the call takes.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


def field_names(cls: type[DataclassInstance] | DataclassInstance) -> list[str]:
    """The names of the ``init`` fields of a dataclass, in order."""
    return [f.name for f in fields(cls) if f.init]


def refuse_unknown(
    given: Iterable[str], allowed: Iterable[str], *, where: str, listed: Iterable[str] = ()
) -> None:
    """Raise ``TypeError`` for the first name of ``given`` not in ``allowed``.

    Parameters
    ----------
    given : iterable of str
        The keyword names of the call.
    allowed : iterable of str
        The names the call takes as options.
    where : str
        The call, as the user wrote it (``"NaNGuard()"``, ``"drift()"``).
    listed : iterable of str, optional
        The keyword names of the signature itself, listed before ``allowed``.
    """
    allowed = list(allowed)
    unknown = [k for k in given if k not in allowed]
    if not unknown:
        return
    names = [*listed, *allowed]
    close = difflib.get_close_matches(unknown[0], names, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise TypeError(
        f"{where} got an unexpected keyword argument {unknown[0]!r}{hint}; its keyword "
        f"arguments are: {', '.join(names)}."
    )


def options_from(
    cls: type[T],
    options: Mapping[str, object],
    *,
    where: str,
    also: Iterable[str] = (),
    base: T | None = None,
) -> T:
    """``base`` (default ``cls()``) with the flat ``options`` put in, validated by the
    dataclass itself; an unknown name is a ``TypeError`` (:func:`refuse_unknown`, with
    ``also`` listed as the signature's own keywords)."""
    if base is not None and not isinstance(base, cls):
        raise TypeError(f"options must be a {cls.__name__}; got {type(base).__qualname__}.")
    refuse_unknown(options, field_names(cls), where=where, listed=also)
    values: dict[str, Any] = dict(options)
    if base is None:
        return cls(**values)
    return replace(base, **values) if values else base


def grouped_options(
    base: T,
    groups: Mapping[str, type[DataclassInstance]],
    options: Mapping[str, object],
    *,
    where: str,
    also: Iterable[str] = (),
) -> T:
    """``base`` with the flat ``options`` put into its nested groups.

    ``groups`` maps an attribute of ``base`` to the frozen dataclass it holds; an option
    that is a field of one of them goes there, one that is a plain field of ``base`` is
    set on ``base``. An unknown name is a ``TypeError`` (:func:`refuse_unknown`).
    """
    owner = {name: attr for attr, group in groups.items() for name in field_names(group)}
    own = [n for n in field_names(base) if n not in groups]
    refuse_unknown(options, [*own, *owner], where=where, listed=also)
    changes: dict[str, Any] = {k: v for k, v in options.items() if k in own}
    for attr in groups:
        mine = {k: v for k, v in options.items() if owner.get(k) == attr}
        if mine:
            changes[attr] = replace(getattr(base, attr), **mine)
    return replace(base, **changes) if changes else base
