"""``NaNGuardCallback`` for ``transformers.Trainer`` (``pip install nbdebug[hf]``).

>>> from nbdebug.integrations.hf import NaNGuardCallback
>>> trainer = transformers.Trainer(model, args, train_dataset=ds,
...                                callbacks=[NaNGuardCallback(directory="snapshots")])
>>> trainer.train()                   # a NaN step is a no-op and written to snapshots/
>>> snap = nbdebug.load_snapshot("snapshots/step-000000012.nbsnap", model=make_model)
>>> snap.trace().origin
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..core.snapshot import autocast_state
from .base import CallbackState, make_guard, missing_framework

__all__ = ["SUPPORTED", "NaNGuardCallback"]

#: the transformers versions this callback supports, ``[low, high)``
SUPPORTED = ("4.41", "6.0")
_log = logging.getLogger("nbdebug")


def _unwrap(obj: Any) -> Any:
    """The torch optimizer / scheduler inside accelerate's wrappers."""
    if obj is None or not type(obj).__module__.startswith("accelerate"):
        return obj
    return getattr(obj, "optimizer", None) or getattr(obj, "scheduler", None) or obj


def _loss_of(output: Any) -> Any:
    """The loss in a model's output as the Trainer reads it: ``output["loss"]`` (a
    ``ModelOutput`` or dict), else a tuple's first element when it is a scalar tensor."""
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    if loss is None and isinstance(output, tuple) and output:
        first = output[0]
        if isinstance(first, torch.Tensor) and first.dim() == 0:
            loss = first
    return loss


try:
    import transformers
except ImportError as _error:  # the extra is not installed
    NaNGuardCallback: Any = missing_framework(__name__, "transformers", "hf", _error)
else:

    class NaNGuardCallback(CallbackState, transformers.TrainerCallback):  # type: ignore[no-redef]
        """Run :class:`nbdebug.NaNGuard` on every optimizer step of a ``transformers.Trainer``.

        The guard checks in ``on_pre_optimizer_step`` (after the backward and the gradient
        clipping, before ``optimizer.step()``). The Trainer has no "skip this step"
        control, so on a bad step (with ``on_nonfinite="skip"``, the default) the callback
        sets every gradient to ``None``: ``optimizer.step()`` then skips every parameter
        (a torch optimizer passes over a parameter whose ``.grad`` is ``None``: no update,
        no AdamW moment or weight-decay change), so the step is a no-op for the weights.
        The learning-rate scheduler still steps and ``state.global_step`` still counts it.
        The skip is logged to the ``"nbdebug"`` Python logger, and the Trainer logs that
        step (``control.should_log``) with ``nbdebug/skipped`` (1.0) and
        ``nbdebug/skipped_step`` added: in ``state.log_history`` and for the callbacks
        after this one (the console printer, and reporters added after it; those of
        ``report_to``, which the Trainer puts first, see that row without it). The Trainer
        logs an update under the step count after it (``global_step + 1``); the snapshot,
        :attr:`skipped` and ``nbdebug/skipped_step`` number it by the updates before it, as
        the scheduler's ``last_epoch`` and Lightning's ``global_step`` do.

        With ``max_grad_norm`` (1.0 by default) the Trainer clips before this check, and
        clipping spreads one NaN gradient element to every gradient: the reason then lists
        every parameter. The snapshot's replay (``snap.trace()``) names where it was made.
        The loss is read from the model's output as the Trainer reads it (``outputs.loss``,
        or a tuple's first element when it is a scalar); a loss computed outside the model
        (a custom ``compute_loss``) is not seen: the guard checks the gradients alone, the
        history has no loss, and the replay needs ``snap.trace(loss_fn=...)`` (and the
        labels, when ``compute_loss`` took them out of the batch before calling the model).

        The snapshot holds the batch the Trainer fed the model (read by a forward hook
        on the model while it trains, removed at the end of training; the keyword
        arguments the model was called with: the batch, labels included, and what
        ``compute_loss`` adds such as ``num_items_in_batch``; under gradient accumulation
        the first micro-batch whose loss was not finite, else the last), the
        ``TrainingArguments`` as plain data (``snap.trainer["args"]``), the optimizer and
        the learning-rate scheduler states, and the autocast state the forward actually
        ran under (``snap.autocast``, read inside the model's forward by pre-hooks on its
        children: under ``bf16=True`` bfloat16; under ``fp16=True`` float16 on a
        GPU, but nothing on CPU, where accelerate trains ``fp16=True`` in float32 without
        autocast). Under ``fp16=True`` on a GPU the guard gets accelerate's GradScaler: a
        step whose float16 gradients overflow is the scaler's own skip (no snapshot, not
        in :attr:`skipped`).

        Under DDP (the Trainer started by ``torchrun`` or ``accelerate launch``) every
        rank runs its own callback: the guards agree on each step (one ``all_reduce``),
        every rank makes a step that any rank found non-finite a no-op, and each writes
        ``step-...-rankN.nbsnap`` (see :func:`nbdebug.compare_ranks`).

        Parameters
        ----------
        directory : str or PathLike
            Where snapshots go (``step-000000012.nbsnap``; step = ``state.global_step``).
        **guard_options
            Further :class:`nbdebug.NaNGuard` options (``patience``, ``on_nonfinite``,
            ``max_snapshots``, ``checks``, ...). The model, optimizer and scheduler come
            from the Trainer.

        Attributes
        ----------
        directory, guard_options, guard, skipped
            As in :class:`nbdebug.integrations.base.CallbackState`.
        """

        def __init__(
            self, directory: str | os.PathLike[str] = "nbdebug-snapshots", **guard_options: Any
        ):
            self.init_state(
                directory,
                guard_options,
                framework="transformers",
                version=transformers.__version__,
                supported=SUPPORTED,
            )
            self._hooks: list[Any] = []
            self._unlogged = 0
            self._device_type = "cpu"
            self._autocast_seen: dict[str, str] | None = None

        def __repr__(self) -> str:
            return (
                f"hf NaNGuardCallback(directory={str(self.directory)!r}, "
                f"{len(self.skipped)} skipped step(s))"
            )

        # a Lightning Trainer calls this first: the wrong trainer
        def setup(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            if not isinstance(self, NaNGuardCallback):  # the class, called unbound
                trainer = self  # (the first argument is then the trainer)
            raise TypeError(
                "nbdebug.integrations.hf.NaNGuardCallback expects a transformers.Trainer; it "
                f"was attached to a {type(trainer).__module__}.{type(trainer).__qualname__}: "
                "use nbdebug.integrations.lightning.NaNGuardCallback there."
            )

        # what a Lightning Trainer reads while it fails on setup(): nothing to do
        state_key = "nbdebug.integrations.hf.NaNGuardCallback"

        def on_exception(self, *args: Any, **kwargs: Any) -> None:
            return None

        def teardown(self, *args: Any, **kwargs: Any) -> None:
            return None

        def _record(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
            if module.training and torch.is_grad_enabled():
                self.step_batch.add(dict(kwargs) if kwargs and not args else (args or kwargs))
                loss = _loss_of(output)
                if loss is not None:
                    self.step_batch.set_loss(loss)

        def _watch_autocast(self, module: Any, args: Any) -> None:
            if module.training and torch.is_grad_enabled():
                self._autocast_seen = autocast_state(self._device_type)

        def _remove_hook(self) -> None:
            while self._hooks:
                self._hooks.pop().remove()

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            model = kwargs.get("model")
            if not isinstance(model, torch.nn.Module):
                raise TypeError(
                    "nbdebug.integrations.hf.NaNGuardCallback expects the Trainer to pass its "
                    f"model (a torch.nn.Module); found {type(model).__qualname__}."
                )
            optimizer = kwargs.get("optimizer")
            options = dict(self.guard_options)
            scaler = getattr(optimizer, "scaler", None)  # accelerate's, under fp16 on a GPU
            if scaler is not None:
                options["scaler"] = scaler
            self.guard = make_guard(
                model,
                optimizer,
                kwargs.get("lr_scheduler"),
                directory=self.directory,
                options=options,
                unwrap=_unwrap,
            )
            self.guard.writer.fields["trainer"] = {
                "framework": "transformers",
                "version": transformers.__version__,
                "global_step": int(state.global_step),
                "args": args.to_dict(),
            }
            self._device_type = next((p.device.type for p in model.parameters()), "cpu")
            self._autocast_seen = None
            self._remove_hook()
            self._hooks.append(model.register_forward_hook(self._record, with_kwargs=True))
            # accelerate enters autocast inside the model's forward: its children see it
            for inner in list(model.children()) or [model]:
                self._hooks.append(inner.register_forward_pre_hook(self._watch_autocast))

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._remove_hook()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.guard is not None:
                self.guard.mark_step_start()

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.guard is None:
                return
            step = int(state.global_step)
            inputs, loss = self.step_batch.batch, self.step_batch.loss
            self.step_batch.reset()
            fields = self.guard.writer.fields
            fields["trainer"]["global_step"] = step
            if self._autocast_seen is not None:
                fields["autocast"] = self._autocast_seen
            else:
                fields.pop("autocast", None)
            self._autocast_seen = None
            try:
                ok = self.guard.check(loss, inputs=inputs, step=step)
            except BaseException:
                self._remove_hook()  # on_train_end will not come
                raise
            if ok or self.guard.on_nonfinite == "continue":
                return
            self.skipped.append(step)
            self._unlogged += 1
            _log.warning(
                "nbdebug: step %d made a no-op (non-finite %s); snapshot %s",
                step,
                self.guard.history[-1].get("nonfinite"),
                self.guard.snapshots[-1] if self.guard.snapshots else None,
            )

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            if self._unlogged:
                control.should_log = True  # the skip goes into the log of its own step
            return control

        def on_log(
            self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
        ) -> None:
            if isinstance(logs, dict) and self._unlogged:
                # the Trainer logs an update under its step count after it (global_step + 1
                # of the guard's step): skipped_step is the snapshot's number
                added = {
                    "nbdebug/skipped": float(self._unlogged),
                    "nbdebug/skipped_step": float(self.skipped[-1]),
                }
                logs.update(added)
                history = getattr(state, "log_history", None)
                if history and history[-1].get("step") == state.global_step:
                    history[-1].update(added)
                self._unlogged = 0
