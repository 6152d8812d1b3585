"""The rewind window of a snapshot: the training state K steps before the failure and
every step since, enough to replay the run from there through the failing step.

A :class:`RewindWindow` is kept by :class:`~nbdebug.NaNGuard` with ``rewind=K`` and
written into the snapshot's ``"rewind"`` field; ``snap.rewind`` gives it back (``None``
for a snapshot written without ``rewind=`` and for older files).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from ..state import RngState
from ..text import fmt_bytes
from .rngdata import rng_from_payload, rng_to_payload

__all__ = [
    "RewindStep",
    "RewindWindow",
    "check_window",
    "describe_window",
    "window_from_payload",
    "window_to_payload",
]


@dataclass
class RewindStep:
    """One step of a rewind window, as it started.

    Attributes
    ----------
    step : int
        The guard's step number.
    inputs, target : Any or None
        A detached CPU copy of the step's batch (``None`` with ``stored=False`` when the
        batch was larger than the window keeps, or given only as ``ids``).
    stored : bool
        Whether ``inputs``/``target`` hold the batch.
    ids : list of int or None
        The dataset indices of the batch's rows, when the training loop gave them.
    rng : RngState
        The RNG states (torch, CUDA, numpy, Python) at the step's start.
    lr : list of float
        Each parameter group's learning rate at that step.
    loss, grad_norm : float or None
        The step's loss and total gradient norm as the guard measured them.
    """

    step: int
    inputs: Any | None
    target: Any | None
    stored: bool
    ids: list[int] | None
    rng: RngState
    lr: list[float] = field(default_factory=list)
    loss: float | None = None
    grad_norm: float | None = None


@dataclass
class RewindWindow:
    """The state at the start of ``start_step`` and every step from there on.

    Attributes
    ----------
    start_step : int
        The step whose start ``model_state`` and the optimizer, scheduler and scaler
        states are (before its forward, before its optimizer step).
    model_state : dict of str to Tensor
        ``model.state_dict()`` at that point (CPU tensors).
    optimizer_state, scheduler_state, scaler_state : dict or None
        Their ``state_dict()`` at that point (``None``: not given to the guard).
    steps : list of RewindStep
        ``start_step`` .. the failing step, in order, the failing step last.
    nbytes : int
        The memory the window holds: the state copy and the stored batches.
    """

    start_step: int
    model_state: dict[str, Tensor]
    optimizer_state: dict[str, Any] | None
    scheduler_state: dict[str, Any] | None
    scaler_state: dict[str, Any] | None
    steps: list[RewindStep] = field(default_factory=list)
    nbytes: int = 0

    def __repr__(self) -> str:
        last = self.steps[-1].step if self.steps else self.start_step
        stored = sum(s.stored for s in self.steps)
        return (
            f"RewindWindow(steps {self.start_step}..{last}, {len(self.steps)} steps, "
            f"{stored} batches stored, {fmt_bytes(self.nbytes)})"
        )


# --------------------------------------------------------------------------- as plain data

#: the keys of the ``rewind`` field's dictionary, and of each of its steps
WINDOW_KEYS = ("start_step", "model_state", "optimizer", "scheduler", "scaler", "steps", "nbytes")
STEP_KEYS = ("step", "inputs", "target", "stored", "ids", "rng", "lr", "loss", "grad_norm")


def window_to_payload(window: RewindWindow) -> dict[str, Any]:
    """``window`` as the plain data of the snapshot's ``rewind`` field (its tensors are
    the window's own: the writer copies them)."""
    return {
        "start_step": int(window.start_step),
        "model_state": dict(window.model_state),
        "optimizer": window.optimizer_state,
        "scheduler": window.scheduler_state,
        "scaler": window.scaler_state,
        "steps": [
            {
                "step": int(s.step),
                "inputs": s.inputs,
                "target": s.target,
                "stored": bool(s.stored),
                "ids": None if s.ids is None else [int(i) for i in s.ids],
                "rng": rng_to_payload(s.rng),
                "lr": [float(v) for v in s.lr],
                "loss": s.loss,
                "grad_norm": s.grad_norm,
            }
            for s in window.steps
        ],
        "nbytes": int(window.nbytes),
    }


def window_from_payload(d: Mapping[str, Any]) -> RewindWindow:
    """The inverse of :func:`window_to_payload` (of a field whose tensors were read)."""
    steps = [
        RewindStep(
            step=int(s["step"]),
            inputs=s["inputs"],
            target=s["target"],
            stored=bool(s["stored"]),
            ids=None if s["ids"] is None else [int(i) for i in s["ids"]],
            rng=rng_from_payload(s["rng"]),
            lr=[float(v) for v in s["lr"]],
            loss=None if s["loss"] is None else float(s["loss"]),
            grad_norm=None if s["grad_norm"] is None else float(s["grad_norm"]),
        )
        for s in d["steps"]
    ]
    return RewindWindow(
        start_step=int(d["start_step"]),
        model_state=dict(d["model_state"]),
        optimizer_state=d["optimizer"],
        scheduler_state=d["scheduler"],
        scaler_state=d["scaler"],
        steps=steps,
        nbytes=int(d["nbytes"]),
    )


def check_window(value: Any) -> None:
    """The ``rewind`` field's check: ``None`` or a dictionary of :data:`WINDOW_KEYS`
    whose steps hold :data:`STEP_KEYS`, in step order (raises ``ValueError``)."""
    if value is None:
        return
    missing = [k for k in WINDOW_KEYS if k not in value]
    if missing:
        raise ValueError(f"the rewind window lacks {', '.join(missing)}")
    if not isinstance(value["start_step"], int) or not isinstance(value["steps"], list):
        raise ValueError("the rewind window's start_step must be an int and its steps a list")
    if not isinstance(value["model_state"], dict):
        raise ValueError("the rewind window's model_state must be a dict")
    last = None
    for s in value["steps"]:
        if not isinstance(s, dict) or any(k not in s for k in STEP_KEYS):
            raise ValueError(f"a step of the rewind window must hold {', '.join(STEP_KEYS)}")
        if not isinstance(s["step"], int) or (last is not None and s["step"] <= last):
            raise ValueError("the rewind window's steps must be ints in increasing order")
        last = s["step"]


def describe_window(d: Mapping[str, Any] | None) -> str | None:
    """One line about a ``rewind`` field (its tensors need not be read): the steps, how
    many batches are stored, the memory; ``None`` without one."""
    if d is None:
        return None
    steps = d["steps"]
    last = steps[-1]["step"] if steps else d["start_step"]
    stored = sum(bool(s["stored"]) for s in steps)
    return (
        f"state at the start of step {d['start_step']}, steps {d['start_step']}..{last} "
        f"({len(steps)}; {stored} batches stored), {fmt_bytes(int(d['nbytes']))}"
    )
