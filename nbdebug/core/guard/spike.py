"""The guard's online spike detector: a robust z-score of the loss and of the global
gradient norm against a window of recent healthy steps (:class:`SpikeDetector`), its
settings (:class:`SpikeSettings`, the ``spike=`` option) and what it finds
(:class:`SpikeFinding`).

A NaN is usually the end of a run of growing values: gradient-norm spikes precede loss
spikes, and a diverging run's gradient norm grows for several steps before anything is
non-finite. The detector compares each step with the median of the last ``window`` steps
that were finite and not skipped (so a NaN or a skipped step never poisons it), in units
of the median absolute deviation (MAD x 1.4826, a standard deviation for normal noise):
``z = (x - median) / (1.4826 MAD)``. Both signals are scored in log space (a spike is a
factor): a loss near its floor is heavy-tailed (a converged classifier's batch loss is
0.01 with a 0.1 now and then, one hard example), which a spread taken as it is reads as a
10-sigma spike on every such batch. A loss that has been negative (a likelihood of
continuous data, an adversarial loss) is scored as it is from then on; a loss of exactly 0
(a hinge or margin loss on an easy batch) is left out of a window in log space. Only upward
deviations count, and only a value clearly above every value of the window (by
:data:`TAIL` times the distance from the median to the largest value): the MAD ignores a
minority of high values, so a hard batch that comes back every epoch (a loss twice the
median, every fourth step, creeping up as the model fits the others) scores a large z each
time although it is nothing new. A spike is kept out of the window, so a run that keeps
growing keeps being flagged.

A diverging run also climbs with no single step far out (each within its batch-to-batch
spread). The sustained-rise test scores the median of the loss's last :data:`RISE_STEPS`
steps (flagged ones too, but not its own spikes: a burst that ended is no rise) against
the window's median, in standard errors of such a median (``sqrt(pi / 2) * sigma /
sqrt(RISE_STEPS)``, sigma at least 5 % in log space), with the same threshold; its finding
carries ``rise``, the recent median. The gradient norm is not scored so: it climbs in
healthy runs (early in training; as a likelihood's variance shrinks: lesson 02's Gaussian
head grows it 6x in 30 steps), while a loss that climbs for steps on end is no healthy
run.

A spike is a transient: a run of more than :data:`MIN_WINDOW` flagged steps in a row
(skipped ones included: a skipped update leaves the weights, and so the values, where they
were) is a new level, and the window then holds that run alone (the baseline moves to it;
its last finding says ``new_level``; under ``on_spike="skip"`` that step's update goes on,
so at most :data:`MIN_WINDOW` spike skips come in a row). A step flagged after that starts
a new run.

Thresholds (the defaults, ``spike=True``): ``z=6`` (as OLMo-core's skip-step optimizer),
``window=128`` steps, ``warmup=32``: the detector is silent until it holds 8 steps
(:data:`MIN_WINDOW`); from then until it holds ``warmup`` its threshold is raised by
``sqrt(warmup / n)`` (twice the threshold at 8 steps), so a short run is watched from
its 9th step but only for large spikes (a ``warmup`` above ``window`` ends when the
window is full). The spread has a floor (1 % of the value in log space, 0.1 % of the
median as it is) so that a run whose values barely move does not flag a tiny change.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

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
#: the recent steps whose median the sustained-rise test compares with the window's
RISE_STEPS = 8
#: the standard error of the median of n normal values, in sigmas, times sqrt(n)
_MEDIAN_SE = math.sqrt(math.pi / 2)
_RISE_SE = _MEDIAN_SE / math.sqrt(RISE_STEPS)  # of a median of RISE_STEPS values, in sigmas
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
    rise : bool
        Whether the loss is also scored for a sustained rise (the median of its last
        :data:`RISE_STEPS` steps against the window's); off for a loss that climbs by
        design (an adversarial or a curriculum's).
    """

    z: float = 6.0
    window: int = 128
    warmup: int = 32
    rise: bool = True

    def __post_init__(self) -> None:
        z = self.z
        if isinstance(z, bool) or not isinstance(z, (int, float)) or not 0 < z < math.inf:
            raise ValueError(f"spike z must be a positive finite number; got {z!r}.")
        for name in ("window", "warmup"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"spike {name} must be an int; got {v!r}.")
        if not isinstance(self.rise, bool):
            raise ValueError(f"spike rise must be True or False; got {self.rise!r}.")
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
        unknown = sorted(set(value) - {"z", "window", "warmup", "rise"})
        if not unknown:
            return SpikeSettings(**value)
    raise ValueError(
        "spike must be True (the default thresholds), False/None (off), a z-score threshold, "
        f"a dict with keys z, window, warmup, rise, or a SpikeSettings; got {value!r}."
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
        The robust z-score (in log space, but for a loss that has been negative).
    threshold : float
        The threshold it crossed (raised during the warm-up).
    window : int
        How many healthy steps the window held.
    history : list of float
        The signal's last values before this step (oldest first).
    new_level : bool
        The step ends a run of more than :data:`MIN_WINDOW` flagged steps in a row: the
        run is a new level, and its values join the window (the step is not skipped).
    rise : float or None
        A sustained rise (no single step far enough out): the median of the last
        :data:`RISE_STEPS` steps (this one included), which ``z`` then scores in standard
        errors of such a median; ``None`` for a spike of this step alone.
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
    rise: float | None = None

    @property
    def message(self) -> str:
        if self.rise is not None:
            return (
                f"{self.signal} rose at step {self.step}: the median of its last "
                f"{RISE_STEPS} steps, {fmt_num(self.rise)}, is {self.z:.1f} standard errors "
                f"above the median {fmt_num(self.median)} of the last {self.window} healthy "
                f"steps (threshold {self.threshold:.1f}; this step {fmt_num(self.value)})"
            )
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
    last raw values. ``log``: the values are held as logarithms; ``signed``: a value below
    zero (admitted) turns the window to values as they are, for good; ``rises``:
    the sustained-rise test scores this signal."""

    def __init__(self, size: int, log: bool, *, signed: bool = False, rises: bool = False) -> None:
        self.ring = np.empty(size, dtype=np.float64)
        self.n = 0  # values held
        self.at = 0  # where the next one goes
        self.raw: deque[float] = deque(maxlen=_HISTORY)
        # the last steps' values, flagged ones too (the sustained-rise test)
        self.recent: deque[float] = deque(maxlen=RISE_STEPS - 1)
        self.log = log
        self.signed = signed
        self.rises = rises
        # (position, value) of the values held that no later one reaches, in decreasing
        # order: the first is the largest held (a sliding maximum; most steps compare
        # with it alone)
        self.tops: deque[tuple[int, float]] = deque()
        self.added = 0  # values added so far
        # (added, median, sigma, top) as last computed (:meth:`_spread`)
        self._stats: tuple[int, float, float, float] | None = None

    @property
    def values(self) -> list[float]:
        """The values held, oldest first."""
        held = self.ring[: self.n] if self.n < len(self.ring) else np.roll(self.ring, -self.at)
        return [float(v) for v in held]

    def transform(self, x: float | None) -> float | None:
        """``x`` in the window's units (``None``: not finite, or not positive in log
        space)."""
        if x is None or not math.isfinite(x):
            return None
        if self.log:
            return math.log(x) if x > 0 else None
        return x

    def admit(self, raw: float | None) -> None:
        """Add a healthy step's value (a signed window that meets a value below zero
        holds its values as they are from then on; a 0 is left out in log space)."""
        if self.log and self.signed and raw is not None and math.isfinite(raw) and raw < 0:
            self._unlog()
        x = self.transform(raw)
        if x is not None:
            self.add(x, float(raw))  # type: ignore[arg-type]

    def _unlog(self) -> None:
        """The values held, as they are (exp is increasing: the sliding maximum keeps
        its order)."""
        self.log = False
        self._stats = None
        self.ring[: self.n] = np.exp(self.ring[: self.n])
        self.tops = deque((i, math.exp(v)) for i, v in self.tops)
        self.recent = deque((math.exp(v) for v in self.recent), maxlen=RISE_STEPS - 1)

    def new_level(self, raws: Sequence[float | None]) -> None:
        """Take a run of flagged values as a new level: a run that settled (a step to
        data in other units) becomes the window alone, so the baseline moves to it; a run
        that kept climbing (:func:`_climbing`) leaves the window as it was, so a
        divergence that goes on growing is scored against the steps before it, and
        flagged again (admitted, a geometric growth would widen the window's spread
        until it looked like noise)."""
        values = [v for v in (self.transform(r) for r in raws) if v is not None]
        if _climbing(values):
            return
        self.n = self.at = self.added = 0
        self._stats = None
        self.tops.clear()
        self.raw.clear()
        for raw in raws:
            self.admit(raw)

    def observe(self, raw: float | None) -> None:
        """Note a step's value for the sustained-rise test (of a signal it scores)."""
        if not self.rises:
            return
        x = self.transform(raw)
        if x is not None:
            self.recent.append(x)

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

    def raw_units(self, v: float) -> float:
        return math.exp(v) if self.log else v

    def score(self, x: float) -> _Scored | None:
        """How ``x`` stands against the window, or ``None`` with too few values. Only a
        value above every value held can be a spike (the window's median and spread are
        then taken afresh); the sustained-rise test compares the recent median with the
        window's as of at most :data:`RISE_STEPS` admitted steps ago (one sort of the
        window per that many steps, not per step)."""
        if self.n < MIN_WINDOW:
            return None
        full = len(self.recent) == RISE_STEPS - 1
        above = x > self.top
        if not (above or full):
            return _QUIET
        med, sigma, top = self._spread(fresh=above)
        rise, z_rise = math.nan, -math.inf
        if full:
            recent = sorted([*self.recent, x])
            rise = 0.5 * (recent[RISE_STEPS // 2 - 1] + recent[RISE_STEPS // 2])
            # the rise's spread: a median of RISE_STEPS values, with a floor of 5 % in log
            # space (a loss that barely moves is not flagged for a lasting 1 % rise)
            level = max(sigma, 0.05 if self.log else 0.05 * abs(med) + 1e-12)
            z_rise = (rise - med) / (level * _RISE_SE)
        unseen = above and x > top + TAIL * (top - med)
        return _Scored((x - med) / sigma, med, unseen, z_rise, rise)

    def _spread(self, *, fresh: bool) -> tuple[float, float, float]:
        """The window's median, robust sigma and largest value: computed now when
        ``fresh`` or when the last ones are :data:`RISE_STEPS` admitted steps old."""
        stats = self._stats
        if fresh or stats is None or self.added - stats[0] >= RISE_STEPS:
            ordered = np.sort(self.ring[: self.n])  # one sort: the median and the top
            med = _middle(ordered)
            deviations = np.abs(ordered - med)
            deviations.sort()
            floor = 0.01 if self.log else 1e-3 * abs(med) + 1e-12
            sigma = max(_MAD_SIGMA * _middle(deviations), floor)
            stats = self._stats = (self.added, med, sigma, float(ordered[-1]))
        return stats[1], stats[2], stats[3]


def _climbing(values: Sequence[float]) -> bool:
    """Whether a run of values kept rising: at least three quarters of its steps went up
    and its last three end above its first three (medians). A step to a new level with
    noise rises on half of its steps (a flat run of 9 passes by chance 1 time in 35); a
    geometric growth, which the window would absorb as it went, on nearly all."""
    if len(values) < 6:
        return False
    ups = sum(b > a for a, b in itertools.pairwise(values))
    return 4 * ups >= 3 * (len(values) - 1) and sorted(values[-3:])[1] > sorted(values[:3])[1]


class _Scored(NamedTuple):
    """A value against its window: its z, the window's median (window units), whether it
    is above every value held, and the sustained-rise z of the recent median ``rise``
    (a tuple: one is made per signal and step)."""

    z: float
    median: float
    unseen: bool
    z_rise: float
    rise: float


#: a value below the window's top, without a rise to score (most steps)
_QUIET = _Scored(-math.inf, math.nan, False, -math.inf, math.nan)


class SpikeDetector:
    """Scores each step against the recent healthy ones (see the module docstring).

    :meth:`score` reads a step and returns its findings, changing nothing;
    :meth:`admit` then adds the step to the windows when it was healthy (finite and not
    skipped). Never raises on a step: a signal it cannot score (no gradients yet, no
    loss given, a non-positive gradient norm) is left out, and :attr:`status` says why.
    """

    def __init__(self, settings: SpikeSettings) -> None:
        self.settings = settings
        self.windows = {
            s: _Window(
                settings.window, log=True, signed=s == "loss", rises=s == "loss" and settings.rise
            )
            for s in SIGNALS
        }
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
            limit = self.threshold(window.n)
            spike = scored.z > limit and scored.unseen
            if spike or scored.z_rise > limit:
                found.append(
                    SpikeFinding(
                        step=reading.step,
                        signal=signal,
                        value=float(raw),
                        median=window.raw_units(scored.median),
                        z=float(scored.z if spike else scored.z_rise),
                        threshold=limit,
                        window=window.n,
                        history=list(window.raw),
                        rise=None if spike else window.raw_units(scored.rise),
                    )
                )
        return found

    def new_level(self, readings: Sequence[StepReading]) -> None:
        """Take a run of flagged steps as a new level (:meth:`_Window.new_level`)."""
        for signal, window in self.windows.items():
            window.new_level([getattr(r, signal) for r in readings])

    def observe(self, reading: StepReading, found: Sequence[SpikeFinding] = ()) -> None:
        """Note a scored step's values for the sustained-rise test: every signal's but
        one that spiked on its own (``found``: the step's findings; a burst of spikes that
        ended is no rise of the steps after it)."""
        spiked = {f.signal for f in found if f.rise is None}
        for signal, window in self.windows.items():
            if signal not in spiked:
                window.observe(getattr(reading, signal))

    def admit(self, reading: StepReading) -> None:
        """Add a healthy step (finite, not skipped) to the windows."""
        for signal, window in self.windows.items():
            window.admit(getattr(reading, signal))

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
