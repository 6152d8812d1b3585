"""Per-layer signals the guard keeps for every step (:class:`LayerSignals`).

Three float32 arrays of shape ``(n, P)``, one row per guarded step held (oldest first)
and one column per parameter (named as in ``model.named_parameters()``):

- ``grad_norm``: each parameter's gradient norm ``||g||_2``;
- ``update_ratio``: ``||w_after - w_before||_2 / ||w_before||_2`` around the optimizer
  step (the rule of thumb is about ``1e-3``);
- ``adam_lag``: Adam's lag, ``mean(g^2) / mean(v_hat)`` over a parameter's elements
  (the squared gradient over the bias-corrected second moment before the step's update;
  near 1 when the second moment follows the gradient, large when a gradient outgrows
  what Adam expects).

NaN means "not measured that step" (a signal measured every k steps, a parameter
without a gradient, ``adam_lag`` for an optimizer that is not Adam-like). A non-finite
gradient reads as its norm (``inf`` or NaN) on the step that had it.

On the modules the user names (``NaNGuard(signals={"modules": [...]})``) two more
``(n, M)`` arrays, one column per module: ``max_logit``, the largest element of the
module's output that step (an attention-score module: the attention max-logit), and
``logsumexp``, the largest log-sum-exp over the output's last dimension (the output head:
``log Z`` of its softmax). Both are the maximum over the step's forward calls.

:class:`SignalSettings` is the guard's ``signals=`` option; the cadences and what each
signal costs are in ``docs/early_warning.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = [
    "MODULE_SIGNALS",
    "SIGNAL_NAMES",
    "UPDATE_EVERY",
    "LayerSignals",
    "SignalSettings",
    "signal_settings",
]

#: the per-parameter signals, in the order :meth:`LayerSignals.frame` lists them
SIGNAL_NAMES: tuple[str, ...] = ("grad_norm", "update_ratio", "adam_lag")
#: the per-module signals (on the modules named in ``signals={"modules": [...]}``)
MODULE_SIGNALS: tuple[str, ...] = ("max_logit", "logsumexp")
#: ``update_every="auto"`` without a rewind window that keeps a host copy of the weights
UPDATE_EVERY = 10


def _positive(value: object, name: str, *, none: bool, auto: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, int) and value >= 1
    if not ok and not (none and value is None):
        also = (", 'auto'" if auto else "") + (" or None (off)" if none else "")
        raise ValueError(f"signals {name} must be a positive int{also}; got {value!r}.")


@dataclass(frozen=True)
class SignalSettings:
    """The per-layer signals the guard keeps (``NaNGuard(signals=...)``).

    Attributes
    ----------
    ring : int
        How many steps the arrays hold (the oldest is dropped first).
    update_every : int, "auto" or None
        Measure the update ratio on every this many checks (``None``: never). A measured
        step copies the weights when it is checked and compares them at the next check,
        with one weight-sized buffer kept for it. ``"auto"`` (the default): where the
        guard's rewind window keeps a host copy of the weights (``rewind``, CPU), the
        check after each of its copies measures against that copy (the window's cadence,
        8-64 steps; no weight copy of the signals' own), else every
        :data:`UPDATE_EVERY` checks.
    copy_budget : int or None
        The most bytes of weights one measuring check copies for the update ratio
        (default 512 MiB): larger models are measured in parts of at most this size, in
        turn (each parameter every ``update_every x parts`` checks; a larger parameter
        is a part alone). ``None``: all at once.
    adam_every : int or None
        Measure Adam's lag at least every this many checks (``None``: never), and on
        each check that follows the guard's update watch reading the optimizer state
        (``check_update``: every 10th step), from that read, with no pass of its own.
    modules : tuple of str
        The modules (names as in ``model.named_modules()``) whose output's max-logit and
        log-sum-exp are recorded (forward hooks on those modules only).
    """

    ring: int = 500
    update_every: int | str | None = "auto"
    copy_budget: int | None = 512 * 2**20
    adam_every: int | None = 10
    modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _positive(self.ring, "ring", none=False)
        if self.update_every != "auto":
            _positive(self.update_every, "update_every", none=True, auto=True)
        _positive(self.copy_budget, "copy_budget", none=True)
        _positive(self.adam_every, "adam_every", none=True)
        mods = self.modules
        if isinstance(mods, str):
            mods = (mods,)
        if not isinstance(mods, (list, tuple)) or not all(isinstance(m, str) for m in mods):
            raise ValueError(f"signals modules must be a list of module names (str); got {mods!r}.")
        object.__setattr__(self, "modules", tuple(mods))


def signal_settings(value: object) -> SignalSettings | None:
    """The ``signals=`` option as settings (``None``: off).

    Parameters
    ----------
    value : bool, dict, SignalSettings or None
        ``True``: the defaults; ``False``/``None``: off; a dict of
        :class:`SignalSettings` fields (``ring``, ``update_every``, ``copy_budget``,
        ``adam_every``, ``modules``) or a :class:`SignalSettings`.

    Raises
    ------
    ValueError
        Any other value, an unknown key, or a bad setting (one sentence each).
    """
    if value is None or value is False:
        return None
    if value is True:
        return SignalSettings()
    if isinstance(value, SignalSettings):
        return value
    if isinstance(value, Mapping):
        known = [f.name for f in fields(SignalSettings)]
        unknown = [k for k in value if k not in known]
        if unknown:
            raise ValueError(
                f"signals got the unknown setting {unknown[0]!r}; its settings are "
                f"{', '.join(known)}."
            )
        return SignalSettings(**value)
    raise ValueError(
        "signals must be True, False, a dict of settings (ring, update_every, copy_budget, "
        f"adam_every, modules) or a SignalSettings; got {value!r}."
    )


def _array(value: Any, label: str, want: tuple[int, int]) -> np.ndarray:
    arr = np.asarray(value, dtype=np.float32)
    if arr.size == 0 and want[0] * want[1] == 0:
        arr = arr.reshape(want)
    if tuple(arr.shape) != want:
        raise ValueError(
            f"LayerSignals {label} must have shape (steps, columns) = {want}; "
            f"got {tuple(arr.shape)}."
        )
    return np.ascontiguousarray(arr)


@dataclass(frozen=True, eq=False)
class LayerSignals:
    """Per-parameter signals over the guarded steps held (a ring, oldest first).

    Attributes
    ----------
    names : list of str
        Parameter names as in ``model.named_parameters()`` (P of them).
    steps : numpy.ndarray
        int64, shape ``(n,)``: the guarded steps held, oldest first.
    grad_norm, update_ratio, adam_lag : numpy.ndarray
        float32, shape ``(n, P)``; NaN where a signal was not measured that step.
    modules : list of str
        The modules watched for logits (M of them; empty: none).
    max_logit, logsumexp : numpy.ndarray
        float32, shape ``(n, M)``: per step and module, the largest output element and
        the largest log-sum-exp over the output's last dimension.
    """

    names: list[str]
    steps: np.ndarray
    grad_norm: np.ndarray
    update_ratio: np.ndarray
    adam_lag: np.ndarray
    modules: list[str] = field(default_factory=list)
    max_logit: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))
    logsumexp: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))

    @classmethod
    def from_arrays(
        cls,
        names: Sequence[str],
        steps: Any,
        grad_norm: Any,
        update_ratio: Any,
        adam_lag: Any,
        *,
        modules: Sequence[str] = (),
        max_logit: Any = None,
        logsumexp: Any = None,
    ) -> LayerSignals:
        """Build from array-likes, checking their shapes.

        Parameters
        ----------
        names : sequence of str
            The P parameter names.
        steps : array-like of int
            Shape ``(n,)``.
        grad_norm, update_ratio, adam_lag : array-like of float
            Shape ``(n, P)`` each (converted to float32).
        modules : sequence of str, optional
            The M modules watched for logits.
        max_logit, logsumexp : array-like of float, optional
            Shape ``(n, M)`` each (default: all NaN).

        Returns
        -------
        LayerSignals

        Raises
        ------
        ValueError
            When a shape does not match ``(n,)`` / ``(n, P)`` / ``(n, M)``.
        """
        names_l = [str(n) for n in names]
        mods = [str(m) for m in modules]
        steps_a = np.asarray(steps, dtype=np.int64)
        if steps_a.ndim != 1:
            raise ValueError(
                f"LayerSignals steps must be one-dimensional (n,); got shape "
                f"{tuple(steps_a.shape)}."
            )
        n = int(steps_a.shape[0])
        per_param = [
            _array(v, k, (n, len(names_l)))
            for k, v in (
                ("grad_norm", grad_norm),
                ("update_ratio", update_ratio),
                ("adam_lag", adam_lag),
            )
        ]
        nan = np.full((n, len(mods)), np.nan, np.float32)
        per_module = [
            _array(nan if v is None else v, k, (n, len(mods)))
            for k, v in (("max_logit", max_logit), ("logsumexp", logsumexp))
        ]
        grad, update, lag = per_param
        return cls(names_l, steps_a, grad, update, lag, mods, per_module[0], per_module[1])

    @classmethod
    def from_field(cls, data: Mapping[str, Any]) -> LayerSignals:
        """From a snapshot's ``"signals"`` field (arrays or tensors by name).

        Raises
        ------
        ValueError
            A name is missing or a shape does not fit.
        """
        arrays = {k: v.numpy() if hasattr(v, "numpy") else v for k, v in data.items()}
        missing = [k for k in ("names", "steps", *SIGNAL_NAMES) if k not in arrays]
        if missing:
            raise ValueError(f"it lacks {', '.join(map(repr, missing))}.")
        return cls.from_arrays(
            arrays["names"],
            arrays["steps"],
            *(arrays[s] for s in SIGNAL_NAMES),
            modules=arrays.get("modules") or (),
            max_logit=arrays.get("max_logit"),
            logsumexp=arrays.get("logsumexp"),
        )

    def __len__(self) -> int:
        return int(self.steps.shape[0])

    def signal(self, name: str) -> np.ndarray:
        """The ``(n, P)`` array of a parameter signal (``"grad_norm"``, ``"update_ratio"``,
        ``"adam_lag"``) or the ``(n, M)`` array of a module signal (``"max_logit"``,
        ``"logsumexp"``)."""
        if name not in SIGNAL_NAMES + MODULE_SIGNALS:
            raise ValueError(
                f"signal must be one of {', '.join(SIGNAL_NAMES + MODULE_SIGNALS)}; got {name!r}."
            )
        return getattr(self, name)  # type: ignore[no-any-return]

    @property
    def nbytes(self) -> int:
        """Bytes the arrays hold."""
        arrays = [self.steps, *(self.signal(s) for s in SIGNAL_NAMES + MODULE_SIGNALS)]
        return int(sum(a.nbytes for a in arrays))

    def frame(self) -> pd.DataFrame:
        """A long table: one row per (step, parameter, signal) with its value (NaN
        where not measured); the module signals follow, their module in ``parameter``.

        Returns
        -------
        pandas.DataFrame
            Columns ``step``, ``parameter``, ``signal``, ``value``.
        """
        import pandas as pd

        n = len(self)
        parts = []
        for names, signals in ((self.names, SIGNAL_NAMES), (self.modules, MODULE_SIGNALS)):
            for name in signals:
                parts.append(
                    pd.DataFrame(
                        {
                            "step": np.repeat(self.steps, len(names)),
                            "parameter": np.tile(np.asarray(names, dtype=object), n),
                            "signal": name,
                            "value": self.signal(name).reshape(-1).astype(np.float64),
                        }
                    )
                )
        return pd.concat(parts, ignore_index=True)

    def __repr__(self) -> str:
        span = f"steps {int(self.steps[0])}..{int(self.steps[-1])}" if len(self) else "empty"
        mods = f" + {len(self.modules)} module(s)" if self.modules else ""
        return (
            f"LayerSignals({len(self)} steps x {len(self.names)} parameters{mods}, {span}, "
            f"{self.nbytes / 1024:.1f} KiB)"
        )
