"""A position over a trace's events, with filters. Pure Python, no widgets: the Step tab
drives one, and tests can drive it directly."""

from __future__ import annotations

from ..core.trace.events import Event
from ..core.trace.result import Trace
from ..core.vocab import Phase

#: phase filter -> the event phases it keeps ("forward" is the whole forward pass:
#: the batch, module outputs and the loss).
PHASE_FILTERS: dict[str, tuple[Phase, ...]] = {
    "all": (Phase.INPUT, Phase.FORWARD, Phase.LOSS, Phase.BACKWARD),
    "forward": (Phase.INPUT, Phase.FORWARD, Phase.LOSS),
    "backward": (Phase.BACKWARD,),
}


class Cursor:
    """The current event of a trace, moved by steps, jumps and filters.

    ``visible`` holds the indices (into ``trace.events``) that pass the phase and
    module-name filters; ``position`` is the place of the current event in it. A jump to
    an event the filters hide (the origin, the next non-finite event) clears the filters.

    Parameters
    ----------
    trace : Trace
    phase : {"all", "forward", "backward"}
    module : str
        Keep events whose module name contains this text (case-insensitive).
    """

    def __init__(self, trace: Trace, *, phase: str = "all", module: str = ""):
        if not isinstance(trace, Trace):
            raise TypeError(f"Cursor expects an nbdebug Trace; got {type(trace).__qualname__}.")
        self.trace = trace
        self.phase = "all"
        self.module = ""
        self.visible: list[int] = []
        self.index: int | None = None  # the current event's index in trace.events
        self.set_filter(phase=phase, module=module)
        if self.visible:
            self.index = self.visible[0]

    # ---- filters -----------------------------------------------------------------------
    def set_filter(self, *, phase: str | None = None, module: str | None = None) -> None:
        """Change the filters; the current event stays when it passes them, else the
        cursor moves to the first visible event after it (or the last one before it)."""
        if phase is not None:
            if phase not in PHASE_FILTERS:
                raise ValueError(
                    f"phase filter must be one of {tuple(PHASE_FILTERS)}; got {phase!r}."
                )
            self.phase = phase
        if module is not None:
            if not isinstance(module, str):
                raise TypeError(f"module filter must be a string; got {type(module).__qualname__}.")
            self.module = module
        phases = PHASE_FILTERS[self.phase]
        needle = self.module.strip().lower()
        self.visible = [
            e.index
            for e in self.trace.events
            if e.phase in phases and (not needle or needle in (e.module or "<model>").lower())
        ]
        self._visible_set = set(self.visible)
        if self.index is not None and self.index not in self._visible_set:
            after = [i for i in self.visible if i > self.index]
            self.index = after[0] if after else (self.visible[-1] if self.visible else self.index)

    def clear_filter(self) -> None:
        self.set_filter(phase="all", module="")

    # ---- where we are ------------------------------------------------------------------
    @property
    def event(self) -> Event | None:
        """The current event (``None`` for an empty trace)."""
        return None if self.index is None else self.trace.events[self.index]

    @property
    def position(self) -> int | None:
        """Place of the current event among the visible ones (``None`` when hidden)."""
        if self.index is None or self.index not in self._visible_set:
            return None
        return self.visible.index(self.index)

    def __len__(self) -> int:
        return len(self.visible)

    # ---- moves (each returns whether the cursor moved) --------------------------------
    def goto(self, index: int) -> bool:
        """Move to ``trace.events[index]``, clearing the filters if they hide it."""
        if not 0 <= index < len(self.trace.events):
            raise ValueError(
                f"event index must be in 0..{len(self.trace.events) - 1}; got {index}."
            )
        if index not in self._visible_set:
            self.clear_filter()
        moved = index != self.index
        self.index = index
        return moved

    def seek(self, position: int) -> bool:
        """Move to the ``position``-th visible event (clamped)."""
        if not self.visible:
            return False
        position = max(0, min(int(position), len(self.visible) - 1))
        return self.goto(self.visible[position])

    def first(self) -> bool:
        return self.seek(0)

    def last(self) -> bool:
        return self.seek(len(self.visible) - 1)

    def next(self) -> bool:
        after = self._after()
        return self.goto(after[0]) if after else False

    def prev(self) -> bool:
        if self.index is None:
            return False
        before = [i for i in self.visible if i < self.index]
        return self.goto(before[-1]) if before else False

    def to_origin(self) -> bool:
        """Jump to where the first non-finite value was produced (else the first
        non-finite event); False when the trace has neither."""
        target = self.trace.origin or self.trace.first_nonfinite
        if target is None:
            return False
        return self.goto(target.index)

    def next_nonfinite(self) -> bool:
        """Move to the next visible event holding NaN/Inf after the current one."""
        for i in self._after():
            if not self.trace.events[i].stats.finite:
                return self.goto(i)
        return False

    def _after(self) -> list[int]:
        if self.index is None:
            return list(self.visible)
        return [i for i in self.visible if i > self.index]

    def __repr__(self) -> str:
        ev = self.event
        where = "empty" if ev is None else f"#{ev.index} {ev.label}"
        return (
            f"Cursor({where}; {len(self.visible)}/{len(self.trace.events)} visible, "
            f"phase={self.phase!r}, module={self.module!r})"
        )
