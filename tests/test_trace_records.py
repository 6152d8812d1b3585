"""The events of a pass stored in bulk (issue 34, item 2): one row per event appended from
the hooks, ``RawEvent`` objects only when a reader indexes or iterates the events, made
once and kept, and extended when events are appended after a read."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import nbdebug
from nbdebug.core.trace import columns
from nbdebug.core.trace.columns import ROW_FIELDS, EventColumns, Row
from nbdebug.core.trace.records import RawEvent
from nbdebug.core.vocab import EventKind, Phase


def row(
    kind: EventKind,
    module: str,
    name: str,
    vector: int | np.ndarray,
    *,
    shape: tuple[int, ...] = (4, 3),
    call: int = -1,
    samples: list[int] | None = None,
    param: str | None = None,
    slot: int = -1,
) -> Row:
    depth = module.count(".") + 1 if module else 0
    mtype = "Linear" if module else ""
    return (
        kind,
        module,
        name,
        shape,
        "float32",
        call,
        depth,
        mtype,
        vector,
        samples or [],
        param,
        slot,
    )


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[RawEvent]:
    """Every RawEvent the store makes."""
    out: list[RawEvent] = []

    def counted(*args: object) -> RawEvent:
        ev = RawEvent(*args)  # type: ignore[arg-type]
        out.append(ev)
        return ev

    monkeypatch.setattr(columns, "RawEvent", counted)
    return out


def test_the_row_fields_are_the_raw_event_fields_after_its_phase() -> None:
    names = tuple(f.name for f in dataclasses.fields(RawEvent))
    assert names[0] == "phase"
    assert names[1:] == ROW_FIELDS


def test_appending_gives_indices_and_builds_no_object(made: list[RawEvent]) -> None:
    ev = EventColumns()
    assert len(ev) == 0 and list(ev) == []
    assert ev.add(row(EventKind.INPUT, "", "x", 0)) == 0
    assert ev.add(row(EventKind.OUTPUT, "fc", "output", 1, call=0)) == 1
    assert ev.add(row(EventKind.LOSS, "", "loss", 2, shape=())) == 2
    assert len(ev) == 3
    # the columns are read without objects
    assert ev.vectors() == [0, 1, 2]
    assert ev.shapes() == [(4, 3), (4, 3), ()]
    assert ev.modules() == ["", "fc", ""]
    assert ev.phases() == [Phase.INPUT, Phase.FORWARD, Phase.LOSS]
    assert [r[2] for r in ev.rows] == ["x", "output", "loss"]
    assert made == []


def test_objects_are_made_once_on_the_first_read_and_kept(made: list[RawEvent]) -> None:
    ev = EventColumns()
    ev.add(row(EventKind.INPUT, "", "x", 0))
    ev.add(row(EventKind.OUTPUT, "fc", "output", 1, call=0))
    first = ev[1]
    assert len(made) == 2  # every row so far, at once
    assert first.phase == Phase.FORWARD and first.kind == EventKind.OUTPUT
    assert (first.module, first.name, first.call, first.depth) == ("fc", "output", 0, 1)
    assert (first.module_type, first.vector, first.slot, first.param) == ("Linear", 1, -1, None)
    assert ev[1] is first and ev[-1] is first
    assert [e.name for e in ev] == ["x", "output"]
    assert ev[0:2] == [ev[0], first]
    assert len(made) == 2  # nothing made again


def test_events_appended_after_a_read_extend_the_objects(made: list[RawEvent]) -> None:
    ev = EventColumns()
    ev.add(row(EventKind.INPUT, "", "x", 0))
    x = ev[0]
    assert len(made) == 1
    ev.add(row(EventKind.GRAD_OUTPUT, "fc", "output", 1, call=0))
    ev.add(row(EventKind.PARAM_GRAD, "fc", "weight", 2, shape=(2, 3), param="fc.weight"))
    assert len(ev) == 3 and len(made) == 1  # appending makes nothing
    assert ev[-1].param == "fc.weight" and ev[-1].phase == Phase.BACKWARD
    assert len(made) == 3  # only the two new rows
    assert ev[0] is x
    assert [e.phase for e in ev] == [Phase.INPUT, Phase.BACKWARD, Phase.BACKWARD]
    assert "3 events, 3 as objects" in repr(ev)


def test_events_sharing_a_vector_share_the_same_object() -> None:
    # one gradient measured once, recorded for its consumer and its producer (as the
    # backward hooks do): the origin rules find the events of one tensor by identity
    v = np.arange(4.0)
    w = np.arange(4.0)  # equal, not the same
    ev = EventColumns()
    ev.add(row(EventKind.GRAD_INPUT, "b", "input", v, call=1, samples=[2]))
    ev.add(row(EventKind.GRAD_OUTPUT, "a", "output", v, call=0, samples=[2]))
    ev.add(row(EventKind.GRAD_OUTPUT, "c", "output", w, call=2))
    assert ev.vectors()[0] is v and ev.vectors()[1] is v
    assert ev[0].vector is v and ev[1].vector is ev[0].vector
    assert ev[2].vector is not v
    assert [j for j in range(len(ev)) if ev[j].vector is ev[0].vector] == [0, 1]
    assert ev[0].host is v
    assert ev[1].samples == [2]


def test_set_vector_before_and_after_the_objects_are_made() -> None:
    ev = EventColumns()
    ev.add(row(EventKind.PARAM_GRAD, "fc", "weight", -1, param="fc.weight"))
    ev.add(row(EventKind.PARAM_GRAD, "fc", "bias", -1, shape=(2,), param="fc.bias"))
    ev.set_vector(0, 7)  # before any object
    assert ev.vectors() == [7, -1]
    assert ev[0].vector == 7 and ev[0].name == "weight" and ev[0].param == "fc.weight"
    ev.set_vector(1, 9)  # after: the object follows the row
    assert ev.vectors() == [7, 9]
    assert ev[1].vector == 9
    assert (ev[1].name, ev[1].shape, ev[1].param) == ("bias", (2,), "fc.bias")


def test_the_objects_are_read_only() -> None:
    ev = EventColumns()
    ev.add(row(EventKind.INPUT, "", "x", 0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ev[0].slot = 3  # type: ignore[misc]


def test_a_healthy_trace_makes_no_raw_event_object(made: list[RawEvent]) -> None:
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    tr = nbdebug.trace(lin, x, loss_fn=lambda out: out.pow(2).mean())
    assert made == []
    # by hand: the batch, the model's output, the loss, the output's gradient, and the
    # two parameter gradients (x needs no gradient: no grad_input)
    assert len(tr.events) == 6
    assert [(e.phase, e.kind, e.shape) for e in tr.events[:4]] == [
        (Phase.INPUT, EventKind.INPUT, (4, 3)),
        (Phase.FORWARD, EventKind.OUTPUT, (4, 2)),
        (Phase.LOSS, EventKind.LOSS, ()),
        (Phase.BACKWARD, EventKind.GRAD_OUTPUT, (4, 2)),
    ]
    grads = {e.param: e.shape for e in tr.events[4:]}
    assert grads == {"weight": (2, 3), "bias": (2,)}
    assert all(e.kind == EventKind.PARAM_GRAD and e.depth == 0 for e in tr.events[4:])
    assert [e.index for e in tr.events] == list(range(6))
    assert tr.events[1].module_type == "Linear" and tr.events[0].module_type == ""


def test_a_nan_trace_reads_the_events_as_objects(made: list[RawEvent]) -> None:
    # the exact pass's origin rules index the events: objects, made once per pass
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    x = torch.randn(4, 3)
    x[1, 2] = float("nan")
    tr = nbdebug.trace(model, x, loss_fn=lambda out: out.pow(2).mean())
    assert tr.origin is not None
    assert tr.origin.phase == Phase.INPUT and tr.origin.samples == [1]
    # the quick pass makes none; the exact pass one per event (never twice)
    assert len(made) == len(tr.events)
