"""What the trainer callbacks share: the framework check, the guard they build, the batch
of the step, and the stub that stands in for a callback whose framework is missing."""

from __future__ import annotations

import inspect
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..core.guard import GuardOptions, NaNGuard
from ..core.snapshot.data import object_name
from ..core.stats import has_nonfinite
from .sampler_ids import SamplerIds

__all__ = [
    "StepBatch",
    "batch_form",
    "check_options",
    "check_version",
    "make_guard",
    "method_source",
    "missing_framework",
    "split_batch",
    "takes_index",
]

#: NaNGuard arguments that a callback takes from its trainer (autocast: from its precision
#: setting), not from the user
FROM_TRAINER = ("model", "optimizer", "scheduler", "scaler", "autocast")


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3])


def check_version(name: str, found: str, low: str, high: str) -> None:
    """Raise ``ImportError`` when ``found`` is outside ``[low, high)``, in one sentence."""
    v = _version_tuple(found)
    if not (_version_tuple(low) <= v < _version_tuple(high)):
        raise ImportError(
            f"nbdebug's {name} callback supports {name} >={low},<{high}; found {name} {found}."
        )


def check_options(callback: str, options: dict[str, Any]) -> dict[str, Any]:
    """The callback's ``**guard_options``, checked as :class:`nbdebug.NaNGuard`'s options
    (:meth:`~nbdebug.core.guard.GuardOptions.from_settings`): a wrong name or value fails
    when the callback is made, not mid-training."""
    accepted = GuardOptions.names()
    for key in options:
        if key in FROM_TRAINER or key == "directory":
            raise TypeError(
                f"{callback} takes {key!r} from the trainer (directory= is its own argument); "
                f"got {key}= among the guard options."
            )
        if key not in accepted:
            allowed = ", ".join(k for k in accepted if k not in (*FROM_TRAINER, "directory"))
            raise TypeError(f"{callback} got an unknown guard option {key!r}; expected {allowed}.")
    GuardOptions.from_settings(**options)  # the values: wrong ones fail here too
    return dict(options)


def missing_framework(module: str, framework: str, extra: str, error: ImportError) -> type:
    """A stand-in ``NaNGuardCallback`` whose construction raises ``ImportError`` with the
    install hint (the framework could not be imported)."""

    class NaNGuardCallback:
        """Stand-in: the framework is not installed (see the ``ImportError`` it raises)."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise ImportError(
                f"{module}.NaNGuardCallback needs {framework}, which cannot be imported "
                f"({error}): pip install nbdebug[{extra}]"
            ) from error

    NaNGuardCallback.__module__ = module
    return NaNGuardCallback


def split_batch(batch: Any) -> tuple[Any, Any]:
    """``(inputs, target)`` of a batch: a pair ``(x, y)`` is inputs and target; anything else
    (a tensor, a dict of model keyword arguments, a longer tuple) is the inputs alone."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    return batch, None


def replay_inputs(module: Any, inputs: Any, target: Any = None) -> tuple[Any, Any]:
    """``(inputs, target)`` as a snapshot's replay passes them (a dict is the model's
    keyword arguments). A dict batch whose keys ``module.forward`` takes as keywords stays
    as it is; one whose keys it takes in part (``{"x": ..., "y": ...}`` for
    ``forward(self, x)``, as ``training_step`` calls ``self(batch["x"])``) gives those keys,
    and the one key left over is the target (several stay in the inputs' place: the batch is
    then the one positional argument); one whose keys it does not take at all (a
    LightningModule whose ``forward(batch)`` reads ``batch["input_ids"]``) becomes the one
    positional argument, ``(batch,)``."""
    if not isinstance(inputs, Mapping):
        return inputs, target
    try:
        signature = inspect.signature(module.forward)
    except ValueError:  # no signature to read: the convention stands
        return inputs, target
    if _binds(signature, inputs):
        return inputs, target
    taken = {k: v for k, v in inputs.items() if k in signature.parameters}
    rest = [k for k in inputs if k not in taken]
    if taken and len(rest) == 1 and target is None and _binds(signature, taken):
        return taken, inputs[rest[0]]
    return (inputs,), target


def batch_form(batch: Any, inputs: Any, target: Any) -> dict[str, Any] | None:
    """How a replay rebuilds ``batch`` (as the trainer's code received it) from the
    snapshot's ``inputs`` and ``target`` (:func:`replay_inputs`'s): the ``"batch"`` of a
    ``loss_source`` (see :func:`nbdebug.core.snapshot.replay.rebuild_batch`); ``None``
    when they do not give it back."""
    if inputs is batch and target is None:
        return {"form": "inputs"}
    pair = isinstance(batch, (tuple, list)) and len(batch) == 2
    if pair and inputs is batch[0] and target is batch[1]:
        return {"form": "pair", "type": "list" if isinstance(batch, list) else "tuple"}
    if isinstance(batch, Mapping) and isinstance(inputs, Mapping) and target is not None:
        rest = [k for k in batch if k not in inputs]
        if len(rest) == 1 and isinstance(rest[0], str) and batch[rest[0]] is target:
            return {"form": "dict", "key": rest[0]}
    if isinstance(inputs, tuple) and len(inputs) == 1 and inputs[0] is batch and target is None:
        return {"form": "wrapped"}
    return None


def method_source(
    owner: type, method: str, *, call: str, args: list[Any], silence: list[str], batch: Any
) -> dict[str, Any]:
    """A snapshot's ``loss_source``: the trainer's code that computed the loss, ``method``
    of the class ``owner`` (recorded by import path when it has one, and by name)."""
    return {
        "call": call,
        "method": method,
        "class": object_name(owner),
        "name": owner.__qualname__,
        "args": list(args),
        "silence": list(silence),
        "batch": batch,
    }


def takes_index(method: Any) -> bool:
    """Whether a bound ``training_step`` takes ``batch_idx`` (Lightning passes it to one
    with two positional parameters, a ``batch_idx`` or ``*args``)."""
    try:
        params = list(inspect.signature(method).parameters.values())
    except (TypeError, ValueError):
        return True
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in params) >= 2 or any(
        p.name == "batch_idx" or p.kind is inspect.Parameter.VAR_POSITIONAL for p in params
    )


def _binds(signature: inspect.Signature, keywords: Mapping[str, Any]) -> bool:
    try:
        signature.bind(**keywords)
    except TypeError:
        return False
    return True


class StepBatch:
    """The micro-batch an optimizer step is reported with: the first one whose loss was not
    finite, else the last one (gradient accumulation feeds several per step)."""

    def __init__(self) -> None:
        self.batch: Any = None
        self.loss: Any = None
        self.bad = False

    def reset(self) -> None:
        self.batch, self.loss, self.bad = None, None, False

    def add(self, batch: Any, loss: Any = None) -> None:
        """Record a micro-batch (and its loss, once known: see :meth:`set_loss`)."""
        if not self.bad:
            self.batch, self.loss = batch, loss

    def set_loss(self, loss: Any) -> None:
        """The loss of the last recorded micro-batch."""
        if self.bad:
            return
        self.loss = loss.detach() if isinstance(loss, torch.Tensor) else loss
        self.bad = has_nonfinite(self.loss)


def make_guard(
    model: torch.nn.Module,
    optimizer: Any,
    scheduler: Any,
    *,
    directory: Any,
    options: dict[str, Any],
    unwrap: Callable[[Any], Any] = lambda o: o,
) -> NaNGuard:
    """The guard of a callback: ``nbdebug.NaNGuard`` on the trainer's model, optimizer and
    scheduler with the callback's options (``on_nonfinite`` defaults to ``"skip"``)."""
    options = dict(options)
    return NaNGuard(
        model,
        unwrap(optimizer),
        scheduler=unwrap(scheduler),
        directory=directory,
        **options,
    )


class CallbackState:
    """What both trainer callbacks keep (mixed into each framework's callback class).

    Attributes
    ----------
    directory : pathlib.Path
        Where snapshots go.
    guard_options : dict
        The checked :class:`nbdebug.NaNGuard` options.
    guard : nbdebug.NaNGuard or None
        The guard (made when training starts).
    skipped : list of int
        The steps whose update was skipped.
    sampler_ids : nbdebug.integrations.sampler_ids.SamplerIds
        The dataset indices of the training batches (its ``note``: why some had none).
    """

    def init_state(
        self,
        directory: str | os.PathLike[str],
        guard_options: dict[str, Any],
        *,
        framework: str,
        version: str,
        supported: tuple[str, str],
        sampler_ids: bool = True,
    ) -> None:
        """Check the framework's version and the options; start with no guard."""
        check_version(framework, version, *supported)
        self.sampler_ids = SamplerIds(enabled=sampler_ids)
        if not isinstance(directory, (str, os.PathLike)):
            raise TypeError(
                "NaNGuardCallback's directory must be a str or os.PathLike; got "
                f"{type(directory).__qualname__}."
            )
        self.directory = Path(directory)
        self.guard_options = check_options("NaNGuardCallback", guard_options)
        self.guard: NaNGuard | None = None
        self.skipped: list[int] = []
        self.step_batch = StepBatch()
        self.trainer_record: dict[str, Any] = {}

    def record_trainer(self, record: dict[str, Any]) -> None:
        """The trainer that runs the steps (framework, version, ``global_step``, its
        arguments): the snapshots' ``trainer`` field."""
        self.trainer_record = dict(record)
        if self.guard is not None:
            self.guard.set_snapshot_field("trainer", self.trainer_record)

    def record_global_step(self, step: int) -> None:
        """The trainer's ``global_step`` of the step about to be checked."""
        self.record_trainer({**self.trainer_record, "global_step": step})

    def restart_ids(self) -> None:
        """A new run: the batches' dataset indices are recorded afresh."""
        self.sampler_ids.close()
        self.sampler_ids = SamplerIds(enabled=self.sampler_ids.enabled)

    def ids_repr(self) -> str:
        """The repr's note on the dataset ids (empty when every batch had them)."""
        if not self.sampler_ids.enabled:
            return ", dataset ids off (sampler_ids=False)"
        note = self.sampler_ids.note
        return "" if note is None else f", no dataset ids: {note}"
