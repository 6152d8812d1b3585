"""The events of one pass, stored in bulk (:class:`EventColumns`).

A pass records one event per measured tensor, thousands per step on a large model, from
inside the hooks of the forward and backward pass. Each is appended as one plain tuple
(a :data:`Row`, its fields in :data:`ROW_FIELDS` order); no :class:`.records.RawEvent`
object is made on that path. Readers that need one field of every event read its column
(:meth:`EventColumns.vectors`, :meth:`EventColumns.phases`, ...) or the rows themselves;
readers that index events (the origin rules of an exact pass) get ``RawEvent`` objects,
built on first use for every row recorded so far, once, and kept."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from operator import itemgetter
from typing import Final, overload

from ..vocab import EventKind, Phase
from .records import PHASE_OF, RawEvent, Vector

__all__ = ["ROW_FIELDS", "EventColumns", "Row"]

#: one event: the fields of :class:`.records.RawEvent` after ``phase`` (which follows
#: from ``kind``, :data:`.records.PHASE_OF`), in its order
Row = tuple[
    EventKind,  # kind
    str,  # module
    str,  # name
    tuple[int, ...],  # shape
    str,  # dtype
    int,  # call
    int,  # depth
    str,  # module_type
    Vector,  # vector
    list[int],  # samples
    str | None,  # param
    int,  # slot
]

#: the names of a :data:`Row`'s fields, in order
ROW_FIELDS: tuple[str, ...] = (
    "kind",
    "module",
    "name",
    "shape",
    "dtype",
    "call",
    "depth",
    "module_type",
    "vector",
    "samples",
    "param",
    "slot",
)

# positions in a Row (ROW_FIELDS.index(...), spelled as literals for the type checker)
_KIND: Final = 0
_MODULE: Final = 1
_SHAPE: Final = 3
_VECTOR: Final = 8


class EventColumns(Sequence[RawEvent]):
    """The events of one pass: appended as :data:`Row` tuples, read as columns, or as
    :class:`.records.RawEvent` objects (``events[i]``, iteration) made once on first use.

    Fields change only through :meth:`set_vector` (the one field a pass fills in after
    the event: a parameter gradient measured once the backward is over); the objects are
    frozen, so a reader cannot change one behind the rows' back."""

    __slots__ = ("_objects", "_rows")

    def __init__(self) -> None:
        self._rows: list[Row] = []
        self._objects: list[RawEvent] = []  # the first len(_objects) rows, as objects

    # ------------------------------------------------------------------ writing
    def add(self, row: Row) -> int:
        """Append one event; its index."""
        rows = self._rows
        rows.append(row)
        return len(rows) - 1

    def set_vector(self, i: int, vector: Vector) -> None:
        """Event ``i``'s statistics vector (its object, when made already, is remade)."""
        k, module, name, shape, dtype, call, depth, mtype, _, samples, param, slot = self._rows[i]
        self._rows[i] = (
            k,
            module,
            name,
            shape,
            dtype,
            call,
            depth,
            mtype,
            vector,
            samples,
            param,
            slot,
        )
        if i < len(self._objects):
            self._objects[i] = dataclasses.replace(self._objects[i], vector=vector)

    # ------------------------------------------------------------------ columns
    @property
    def rows(self) -> Sequence[Row]:
        """Every event's :data:`Row`, in order (read only)."""
        return self._rows

    def vectors(self) -> list[Vector]:
        """Every event's statistics vector (the same objects as the events')."""
        return list(map(itemgetter(_VECTOR), self._rows))

    def shapes(self) -> list[tuple[int, ...]]:
        return list(map(itemgetter(_SHAPE), self._rows))

    def modules(self) -> list[str]:
        return list(map(itemgetter(_MODULE), self._rows))

    def phases(self) -> list[Phase]:
        return [PHASE_OF[row[_KIND]] for row in self._rows]

    # ------------------------------------------------------------------ objects
    def _materialise(self) -> list[RawEvent]:
        """Objects for the rows recorded since the last read; all objects."""
        objects, rows = self._objects, self._rows
        if len(objects) < len(rows):
            objects.extend(RawEvent(PHASE_OF[r[_KIND]], *r) for r in rows[len(objects) :])
        return objects

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> RawEvent: ...

    @overload
    def __getitem__(self, i: slice) -> list[RawEvent]: ...

    def __getitem__(self, i: int | slice) -> RawEvent | list[RawEvent]:
        return self._materialise()[i]

    def __iter__(self) -> Iterator[RawEvent]:
        return iter(self._materialise())

    def __repr__(self) -> str:
        return f"EventColumns({len(self._rows)} events, {len(self._objects)} as objects)"
