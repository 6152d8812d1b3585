"""The guard's online spike detector: a robust z-score of the loss and of the global
gradient norm against a window of recent healthy steps (:class:`SpikeDetector`), its
settings (:class:`SpikeSettings`, the ``spike=`` option) and what it finds
(:class:`SpikeFinding`).

A NaN is usually the end of a run of growing values: gradient-norm spikes precede loss
spikes, and a diverging run's gradient norm grows for several steps before anything is
non-finite. The detector compares each step with the median of the last ``window``
steps that were finite and not skipped (so a NaN or a skipped step never poisons it), in
units of the median absolute deviation (MAD x 1.4826, a standard deviation for normal
noise): ``z = (x - median) / (1.4826 MAD)``. The gradient norm is scored in log space (a
spike is a factor), the loss as it is. Only upward deviations count, and only a value
clearly above every value of the window (by :data:`TAIL` times the distance from the
median to the largest value): the MAD ignores a minority of high values, so a hard batch
that comes back every epoch (a loss twice the median, every fourth step, creeping up as
the model fits the others) scores a large z each time although it is nothing new. A
spike is kept out of the window, so a run that keeps growing keeps being flagged. A spike
is a transient: a run of more than :data:`MIN_WINDOW` flagged steps in a row (skipped
ones included: a skipped update leaves the weights, and so the values, where they were)
is a new level, and the guard admits the whole run into the window at once (its last
finding says ``new_level``; under ``on_spike="skip"`` that step's update goes on, so at
most :data:`MIN_WINDOW` spike skips come in a row). A step flagged after that starts a
new run.

Thresholds (the defaults, ``spike=True``): ``z=6`` (as OLMo-core's skip-step optimizer),
``window=128`` steps, ``warmup=32``: the detector is silent until it holds 8 steps
(:data:`MIN_WINDOW`); from then until it holds ``warmup`` its threshold is raised by
``sqrt(warmup / n)`` (twice the threshold at 8 steps), so a short run is watched from
its 9th step but only for large spikes (a ``warmup`` above ``window`` ends when the
window is full). The spread has a floor (1 % of the gradient norm, 0.1 % of the loss's
median) so that a run whose values barely move does not flag a tiny change.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from ..text import fmt_num

if TYPE_CHECKING:  # pragma: no cover
    from .reading import StepReading

__all__ = [
    "MIN_WINDOW",
    "SPIKE_ACTIONS",
    "SpikeAction",
    "SpikeDetector",
    "SpikeFinding",
    "SpikeSettings",
    "spike_settings",
]

#: what the guard does on a spike (``on_spike``)
SpikeAction = Literal["snapshot", "skip", "raise", "ignore"]
SPIKE_ACTIONS: tuple[SpikeAction, ...] = ("snapshot", "skip", "raise", "ignore")
#: the fewest healthy steps the spread is estimated from
MIN_WINDOW = 8
#: the signals the detector scores, in the order it reports them
SIGNALS = ("grad_norm", "loss")
_MAD_SIGMA = 1.4826  # MAD -> standard deviation for normal noise
#: a spike also exceeds the window's largest value by this fraction of (largest - median)
TAIL = 0.5
_HISTORY = 16  # recent values a finding carries


@dataclass(frozen=True)
class SpikeSettings:
    """The spike detector's thresholds (``NaNGuard(spike=...)``).

    Attributes
    ----------
    z : float
        A step whose robust z-score exceeds this is a spike.
    window : int
        How many recent healthy steps the median and MAD are taken over (>= 8).
    warmup : int
        Below this many steps in the window the threshold is raised by
        ``sqrt(warmup / n)`` (>= 8: the detector is silent below 8 steps, and 8 means no
        raised threshold; a warmup above the window ends when the window is full).
    """

    z: float = 6.0
    window: int = 128
    warmup: int = 32

    def __post_init__(self) -> None:
        z = self.z
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not 0 < z < math.inf:
            raise ValueError(f"spike z must be a positive finite number; got {z!r}.")
        for name in ("window", "warmup"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"spike {name} must be an int; got {v!r}.")
        if self.window < MIN_WINDOW:
            raise ValueError(
                f"spike window must be at least {MIN_WINDOW} steps to estimate the spread "
                f"(median and MAD); got {self.window}."
            )
        if self.warmup < MIN_WINDOW:
            raise ValueError(
                f"spike warmup must be at least {MIN_WINDOW} steps (the detector is silent "
                f"until its window holds {MIN_WINDOW} steps, then raises its threshold until "
                f"it holds warmup steps; {MIN_WINDOW} means no raised threshold); "
                f"got {self.warmup}."
            )
        object.__setattr__(self, "z", float(z))


def spike_settings(value: object) -> SpikeSettings | None:
    """The ``spike=`` option as settings (``None``: off): ``True`` the defaults, ``False``
    or ``None`` off, a number the z threshold, a dict of :class:`SpikeSettings` fields
    (``{"z": 8, "window": 64}``) or a :class:`SpikeSettings`.

    Raises
    ------
    ValueError
        Any other value, or a value a field refuses (a window or a warmup under 8 steps).
    """
    if value is None or value is False:
        return None
    if value is True:
        return SpikeSettings()
    if isinstance(value, SpikeSettings):
        return value
    if isinstance(value, (int, float)):
        return SpikeSettings(z=value)
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"z", "window", "warmup"})
        if not unknown:
            return SpikeSettings(**value)
    raise ValueError(
        "spike must be True (the default thresholds), False/None (off), a z-score threshold, "
        f"a dict with keys z, window, warmup, or a SpikeSettings; got {value!r}."
    )


@dataclass(frozen=True)
class SpikeFinding:
    """One spike: a signal of one step far above its recent healthy steps.

    Attributes
    ----------
    step : int
    signal : str
        ``"grad_norm"`` or ``"loss"``.
    value : float
        The step's value.
    median : float
        The median of the window (in the signal's own units).
    z : float
        The robust z-score (log space for the gradient norm).
    threshold : float
        The threshold it crossed (raised during the warm-up).
    window : int
        How many healthy steps the window held.
    history : list of float
        The signal's last values before this step (oldest first).
    new_level : bool
        The step ends a run of more than :data:`MIN_WINDOW` flagged steps in a row: the
        run is a new level, and its values join the window (the step is not skipped).
    """

    step: int
    signal: str
    value: float
    median: float
    z: float
    threshold: float
    window: int
    history: list[float]
    new_level: bool = False

    @property
    def message(self) -> str:
        return (
            f"{self.signal} spiked at step {self.step}: {fmt_num(self.value)} is "
            f"{self.z:.1f} robust sigmas above the median {fmt_num(self.median)} of the last "
            f"{self.window} healthy steps (threshold {self.threshold:.1f})"
        )

    def as_dict(self) -> dict[str, Any]:
        """The finding as plain data (a history row's ``"spikes"``, a snapshot's reason)."""
        return {**asdict(self), "message": self.message}


def _middle(ordered: np.ndarray) -> float:
    """The median of a sorted, non-empty array (``np.median``'s value, at a quarter of
    its cost on a window: this runs at every check)."""
    n = len(ordered)
    k = n // 2
    return float(ordered[k]) if n % 2 else 0.5 * (float(ordered[k - 1]) + float(ordered[k]))


class _Window:
    """One signal's recent healthy values (transformed, in a preallocated ring) and its
    last raw values."""

    def __init__(self, size: int, log: bool) -> None:
        self.ring = np.empty(size, dtype=np.float64)
        self.n = 0  # values held
        self.at = 0  # where the next one goes
        self.raw: deque[float] = deque(maxlen=_HISTORY)
        self.log = log
        # (position, value) of the values held that no later one reaches, in decreasing
        # order: the first is the largest held (a sliding maximum; most steps compare
        # with it alone)
        self.tops: deque[tuple[int, float]] = deque()
        self.added = 0  # values added so far

    @property
    def values(self) -> list[float]:
        """The values held, oldest first."""
        held = self.ring[: self.n] if self.n < len(self.ring) else np.roll(self.ring, -self.at)
        return [float(v) for v in held]

    def transform(self, x: float | None) -> float | None:
        if x is None or not math.isfinite(x):
            return None
        if self.log:
            return math.log(x) if x > 0 else None
        return x

    def add(self, x: float, raw: float) -> None:
        size = len(self.ring)
        self.ring[self.at] = x
        self.at = (self.at + 1) % size
        self.n = min(self.n + 1, size)
        self.raw.append(raw)
        tops = self.tops
        while tops and tops[-1][1] <= x:
            tops.pop()
        tops.append((self.added, x))
        self.added += 1
        if tops[0][0] <= self.added - 1 - size:  # it left the window
            tops.popleft()

    @property
    def top(self) -> float:
        """The largest value held (``-inf`` for none)."""
        return self.tops[0][1] if self.tops else -math.inf

    def score(self, x: float) -> tuple[float, float, bool] | None:
        """(z, median in raw units, whether ``x`` is above every value held), or ``None``
        with too few values. Only a value above every value held can be a spike, so the
        median and the spread are computed for it alone (most steps cost one ``max``)."""
        if self.n < MIN_WINDOW:
            return None
        if not x > self.top:
            return -math.inf, math.nan, False
        held = self.ring[: self.n]
        ordered = np.sort(held)  # one sort: the median and the top
        med = _middle(ordered)
        deviations = np.abs(ordered - med)
        deviations.sort()
        mad = _middle(deviations)
        floor = 0.01 if self.log else 1e-3 * abs(med) + 1e-12
        sigma = max(_MAD_SIGMA * mad, floor)
        top = float(ordered[-1])
        return (x - med) / sigma, math.exp(med) if self.log else med, x > top + TAIL * (top - med)


class SpikeDetector:
    """Scores each step against the recent healthy ones (see the module docstring).

    :meth:`score` reads a step and returns its findings, changing nothing;
    :meth:`admit` then adds the step to the windows when it was healthy (finite and not
    skipped). Never raises on a step: a signal it cannot score (no gradients yet, no
    loss given, a non-positive gradient norm) is left out, and :attr:`status` says why.
    """

    def __init__(self, settings: SpikeSettings) -> None:
        self.settings = settings
        self.windows = {s: _Window(settings.window, log=s == "grad_norm") for s in SIGNALS}
        #: why the last step's signals could not be scored (empty when they were)
        self.status: dict[str, str] = {}

    def threshold(self, n: int) -> float:
        s = self.settings
        return s.z * math.sqrt(max(1.0, min(s.warmup, s.window) / n))

    def score(self, reading: StepReading, *, has_grads: bool = True) -> list[SpikeFinding]:
        """The spikes of the step read (none while warming up)."""
        self.status = {}
        found = []
        for signal, window in self.windows.items():
            raw = getattr(reading, signal)
            if signal == "grad_norm" and not has_grads:
                self.status[signal] = "no gradients yet (check() before a backward?)"
                continue
            x = window.transform(raw)
            if x is None:
                if raw is None:
                    self.status[signal] = "no loss given to check()"
                continue
            scored = window.score(x)
            if scored is None:
                self.status[signal] = f"warming up ({window.n} of {MIN_WINDOW} healthy steps)"
                continue
            z, median, unseen = scored
            limit = self.threshold(window.n)
            if z > limit and unseen:
                found.append(
                    SpikeFinding(
                        step=reading.step,
                        signal=signal,
                        value=float(raw),
                        median=median,
                        z=float(z),
                        threshold=limit,
                        window=window.n,
                        history=list(window.raw),
                    )
                )
        return found

    def admit(self, reading: StepReading) -> None:
        """Add a healthy step (finite, not skipped) to the windows."""
        for signal, window in self.windows.items():
            raw = getattr(reading, signal)
            x = window.transform(raw)
            if x is not None:
                window.add(x, float(raw))

    def recent(self, signal: str) -> Sequence[float]:
        """The last healthy values of ``signal`` (oldest first)."""
        return list(self.windows[signal].raw)


def spike_action(action: SpikeAction, distributed: bool) -> SpikeAction:
    """What the guard does on a spike: ``action``; in a distributed run, where every rank
    must decide alike and each rank scores its own loss, ``"ignore"`` (each rank records
    its findings in its history, no spike snapshot).

    Raises
    ------
    ValueError
        ``"skip"`` or ``"raise"`` in a distributed run.
    """
    if not distributed:
        return action
    if action in ("skip", "raise"):
        raise ValueError(
            f"on_spike={action!r} needs every rank to decide alike, and each rank scores its "
            "own loss: a distributed run takes on_spike='snapshot' or 'ignore' (the findings "
            "go into each rank's history)."
        )
    return "ignore"
