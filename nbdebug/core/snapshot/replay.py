"""Replaying a step under the autocast state it ran in: the snapshot's ``autocast`` field,
read from the live step (:func:`autocast_state`) and turned back into the contexts a
replay runs its forward, loss and backward in (:func:`replay_contexts`)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .format import SnapshotError

__all__ = [
    "IN_FLOAT32",
    "MODEL_METHOD",
    "TRAINER_METHOD",
    "ReplayStep",
    "StepModule",
    "autocast_state",
    "autocast_supported",
    "rebuild_batch",
    "replay_autocast",
    "replay_contexts",
    "silenced",
    "stand_in",
    "step_batch",
    "step_module",
]


def autocast_state(device_type: str, *, backward: bool = False) -> dict[str, Any] | None:
    """The active autocast state of ``device_type`` as the snapshot's ``autocast`` field
    (``{"device_type": ..., "dtype": "bfloat16"}``, with ``"backward": True`` when the
    step's backward ran inside the block too), or ``None`` when autocast is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    dtype = torch.get_autocast_dtype(device_type)
    state: dict[str, Any] = {"device_type": device_type, "dtype": str(dtype).replace("torch.", "")}
    if backward:
        state["backward"] = True
    return state


def autocast_supported(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch.autocast(device_type, dtype=dtype)`` runs on this machine (CUDA
    bfloat16 needs an Ampere or newer GPU)."""
    if not torch.amp.autocast_mode.is_autocast_available(device_type):
        return False
    if device_type == "cuda" and dtype == torch.bfloat16:
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if device_type == "cpu":
        return dtype in (torch.bfloat16, torch.float16)
    return True


#: what a replay of a step under an autocast dtype this machine lacks can do instead
IN_FLOAT32 = (
    "replay it in float32 with snap.trace(autocast=False) (nbdebug.check and nbdebug.debug "
    "take that trace)"
)


def replay_autocast(
    spec: Mapping[str, Any] | None, device: torch.device, *, instead: str = IN_FLOAT32
) -> Any:
    """The autocast context a replay on ``device`` runs in: the recorded dtype (``spec``,
    the ``autocast`` field) on ``device``'s type; a null context for ``None``. A dtype the
    device lacks is a SnapshotError whose sentence ends with ``instead``."""

    if spec is None:
        return contextlib.nullcontext()
    name = str(spec["dtype"])
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not autocast_supported(device.type, dtype):
        raise SnapshotError(
            f"this snapshot's step ran under {name} autocast ({spec['device_type']}); "
            f"expected a {device.type} device that supports {name} autocast, found one that "
            f"does not: replay on such a machine, or {instead}."
        )
    return torch.autocast(device.type, dtype=dtype)


def replay_contexts(
    spec: Mapping[str, Any] | None, device: torch.device, *, instead: str = IN_FLOAT32
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The context factories a replay of a step recorded under ``spec`` (the ``autocast``
    field) runs its forward and loss in, and its backward in: the backward outside
    autocast, as training loops and trainers run it, unless the step ran it inside the
    block (``spec["backward"]``). Raises the SnapshotError of :func:`replay_autocast`
    now, for a dtype this machine lacks."""

    replay_autocast(spec, device, instead=instead)

    def forward() -> Any:
        return replay_autocast(spec, device)

    backward = forward if spec is not None and spec.get("backward") else contextlib.nullcontext
    return forward, backward


# --------------------------------------------------------------------------- loss sources
#: ``loss_source["call"]``: ``model.<method>(batch, *args)`` (a LightningModule's
#: ``training_step``) or ``<class>.<method>(trainer, model, batch)`` (a Trainer's
#: ``compute_loss``)
MODEL_METHOD = "model_method"
TRAINER_METHOD = "trainer_method"


def rebuild_batch(form: Mapping[str, Any] | None, inputs: Any, target: Any) -> Any:
    """The batch as the trainer's code received it, from the snapshot's inputs and target
    (``loss_source["batch"]``: ``{"form": "pair", "type": "tuple" | "list"}`` for
    ``(inputs, target)``, ``{"form": "dict", "key": k}`` for the inputs with the target
    under ``k``, ``{"form": "wrapped"}`` for ``inputs[0]``, else the inputs alone)."""
    kind = (form or {}).get("form")
    if kind == "pair":
        return [inputs, target] if (form or {}).get("type") == "list" else (inputs, target)
    if kind == "dict" and isinstance(inputs, Mapping):
        return {**inputs, str((form or {})["key"]): target}
    if kind == "wrapped" and isinstance(inputs, (tuple, list)) and len(inputs) == 1:
        return inputs[0]
    return inputs


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


@contextlib.contextmanager
def silenced(obj: object, names: Sequence[str]) -> Iterator[None]:
    """The instance methods ``names`` of ``obj`` made no-ops (``self.log`` of a module with
    no trainer attached) for the duration; the instance's own attributes are put back, the
    class is never changed."""
    own = vars(obj)
    saved = {n: own[n] for n in names if n in own}
    for n in names:
        object.__setattr__(obj, n, _noop)
    try:
        yield
    finally:
        for n in names:
            if n in saved:
                object.__setattr__(obj, n, saved[n])
            else:
                own.pop(n, None)


class StepModule(torch.nn.Module):
    """The module a replay traces when the trainer's code computes the loss: its
    ``forward`` takes the batch (as :func:`nbdebug.trace` passes it: one tensor,
    ``*batch`` or ``**batch``) and returns that code's loss, ``model.training_step(batch,
    *args)`` or ``Trainer.compute_loss(trainer, model, batch)``.

    It shares ``model``'s submodules, parameters and buffers (the same dictionaries), so
    the trace names them as ``model.named_modules()`` does, with the trainer's code as the
    root's own (``""``); the model itself is not a child. ``silence`` names instance
    methods of ``model`` made no-ops during each call (``log``, ``log_dict``).
    """

    step_model: torch.nn.Module
    source: dict[str, Any]
    trainer: object
    pack: str  # how forward gets the batch: "one" argument, a "tuple", "list" or "dict"

    def __init__(self, model: torch.nn.Module, source: Mapping[str, Any], trainer: object) -> None:
        super().__init__()
        for name in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            object.__setattr__(self, name, getattr(model, name))
        object.__setattr__(self, "step_model", model)
        object.__setattr__(self, "source", dict(source))
        object.__setattr__(self, "trainer", trainer)
        object.__setattr__(self, "pack", "one")
        self.training = model.training

    def train(self, mode: bool = True) -> StepModule:
        super().train(mode)
        self.step_model.training = mode
        return self

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        batch: Any = dict(kwargs) if kwargs else args[0] if self.pack == "one" else args
        if self.pack == "list":
            batch = list(args)
        src, model = self.source, self.step_model
        with silenced(model, [str(n) for n in src.get("silence") or ()]):
            if src.get("call") == TRAINER_METHOD:
                fn = getattr(type(self.trainer), str(src["method"]))
                named = dict(src.get("kwargs") or {})  # num_items_in_batch=, as it was called
                return fn(self.trainer, model, batch, *src.get("args") or (), **named)
            return getattr(model, str(src["method"]))(batch, *src.get("args") or ())

    def __deepcopy__(self, memo: dict[int, Any]) -> StepModule:
        # the model copied (with the memo: an optimizer copied beside it keeps its
        # parameters), the trainer or its stand-in shared
        new = step_module(copy.deepcopy(self.step_model, memo), self.source, self.trainer)
        object.__setattr__(new, "pack", self.pack)
        memo[id(self)] = new
        return new


_STEP_CLASSES: dict[type, type[StepModule]] = {}


def step_module(model: torch.nn.Module, source: Mapping[str, Any], trainer: object) -> StepModule:
    """A :class:`StepModule` over ``model``, of a class named as ``model``'s (what the
    trace's ``model_name`` and the root's type show)."""
    cls = type(model)
    sub = _STEP_CLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (StepModule,), {"__qualname__": cls.__qualname__})
        _STEP_CLASSES[cls] = sub
    return sub(model, source, trainer)


def step_batch(module: StepModule, batch: Any) -> Any:
    """``batch`` as the trace passes it to ``module`` (``module(*batch)`` for a tuple or
    list, ``module(**batch)`` for a dict), with ``module`` told how to rebuild it."""
    pack = "one"
    if isinstance(batch, (tuple, list)) and not isinstance(batch, torch.Tensor):
        pack = "list" if isinstance(batch, list) else "tuple"
        batch = tuple(batch)
    elif isinstance(batch, Mapping):
        pack = "dict"
    object.__setattr__(module, "pack", pack)
    return batch


@dataclass(frozen=True)
class ReplayStep:
    """What a replay of a snapshot's step runs (:meth:`Snapshot.replay_step`): the model
    (or a :class:`StepModule` over it), the batch and target on ``device``, the loss."""

    model: torch.nn.Module
    inputs: Any
    target: Any
    loss_fn: Any
    device: torch.device


def stand_in(cls: type) -> object:
    """An instance of ``cls`` made without calling its ``__init__`` (a Trainer's, which
    wants a model, arguments and data): what a replay calls ``cls.compute_loss`` on. An
    attribute it lacks raises an ``AttributeError`` that says to pass the trainer."""

    def missing(self: Any, name: str) -> Any:
        raise AttributeError(
            f"{cls.__qualname__}.compute_loss reads self.{name}, which the replay's stand-in "
            f"for the trainer lacks: pass snap.trace(trainer=your_trainer)."
        )

    sub = type(cls.__name__, (cls,), {"__getattr__": missing, "__qualname__": cls.__qualname__})
    return object.__new__(sub)
