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
import sys
import threading
from collections.abc import Mapping
from types import FrameType
from typing import Any

import torch

from ..core.snapshot import autocast_state
from ..core.snapshot.replay import TRAINER_METHOD
from .base import CallbackState, make_guard, method_source, missing_framework

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


#: "no child of the model has run in this forward yet"
_UNSEEN: Any = object()


def _decorator_autocasts(forward: Any) -> list[Any]:
    """The ``torch.autocast`` objects that decorators around ``forward`` enter, outermost
    first: accelerate's mixed-precision wrapper of ``model.forward`` (``bf16=True``) is a
    ``torch.autocast`` used as a decorator, as is a ``@torch.autocast(...)`` of one's own.
    Read from the closures along the ``__wrapped__`` chain."""
    found: list[Any] = []
    seen: set[int] = set()
    fn = forward
    while fn is not None and id(fn) not in seen and len(seen) < 16:
        seen.add(id(fn))
        fn = getattr(fn, "__func__", fn)  # a bound method: its function
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if isinstance(value, torch.autocast):
                found.append(value)
        fn = getattr(fn, "__wrapped__", None)
    return found


def _forward_autocast(model: torch.nn.Module, device_type: str) -> tuple[bool, Any]:
    """``(decorated, state)``: whether a decorator around ``model.forward`` sets the autocast
    of ``device_type`` (on or off), and the autocast state inside it, as
    :func:`autocast_state` gives it. The innermost such decorator decides."""
    casts = [c for c in _decorator_autocasts(model.forward) if c.device == device_type]
    if not casts:
        return False, None
    inner = casts[-1]
    enabled = bool(getattr(inner, "_enabled", True))
    with torch.autocast(device_type, dtype=inner.fast_dtype, enabled=enabled):
        return True, autocast_state(device_type)


def _called_children(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of ``module`` that its forward can call: a container that has no
    forward of its own (``ModuleList``, ``ModuleDict``) stands for its children."""
    found = []
    for child in module.children():
        if type(child).forward is torch.nn.Module.forward:
            found.extend(_called_children(child))
        else:
            found.append(child)
    return found


def _on_stack(frame: FrameType | None, codes: frozenset[int]) -> bool:
    """Whether ``frame`` or a frame that called it runs one of ``codes`` (their ids)."""
    while frame is not None:
        if id(frame.f_code) in codes:
            return True
        frame = frame.f_back
    return False


def _plain_argument(value: Any) -> Any:
    """An argument of ``compute_loss`` as a snapshot records it (``num_items_in_batch``: a
    one-element tensor as its number); ``...`` for one it cannot."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return ...


try:
    import transformers
except ImportError as _error:  # the extra is not installed
    NaNGuardCallback: Any = missing_framework(__name__, "transformers", "hf", _error)
else:

    def _training_loop() -> tuple[tuple[Any, ...], Any]:
        """``(codes, trainer)``: the code of the frames that run the Trainer's training loop,
        read from the stack of ``on_train_begin``: the frame that called
        ``CallbackHandler.on_train_begin`` (``Trainer._inner_training_loop``, or a
        subclass's own) and ``Trainer.train``'s; and the Trainer (that frame's ``self``).
        ``((), None)`` when no Trainer called it."""
        from transformers.trainer_callback import CallbackHandler

        begin = CallbackHandler.on_train_begin.__code__
        train = getattr(getattr(transformers.Trainer, "train", None), "__code__", None)
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code is not begin:
            frame = frame.f_back
        if frame is None or frame.f_back is None:
            return (), None
        frame = frame.f_back
        trainer = frame.f_locals.get("self")
        codes = [frame.f_code]
        while frame is not None and frame.f_code is not train:
            frame = frame.f_back
        if frame is not None:
            codes.append(frame.f_code)
        return tuple(codes), trainer if isinstance(trainer, transformers.Trainer) else None

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
        step (``control.should_log``) with ``nbdebug/skipped`` (1.0),
        ``nbdebug/skipped_step`` and the guard's skip counters ``nbdebug/skips`` (in all)
        and ``nbdebug/skips_in_row`` added: in ``state.log_history`` and for the callbacks
        after this one (the console printer, and reporters added after it; those of
        ``report_to``, which the Trainer puts first, see that row without it). The Trainer
        logs an update under the step count after it (``global_step + 1``); the snapshot,
        :attr:`skipped` and ``nbdebug/skipped_step`` number it by the updates before it, as
        the scheduler's ``last_epoch`` and Lightning's ``global_step`` do.

        With ``max_grad_norm`` (1.0 by default) the Trainer clips before this check, and
        clipping spreads one NaN gradient element to every gradient: the reason then lists
        every parameter. The snapshot's replay (``snap.trace()``) names where it was made.
        The loss is read from the model's output as the Trainer reads it (``outputs.loss``,
        or a tuple's first element when it is a scalar). When the model returns none, the
        loss is the Trainer's ``compute_loss``'s (a subclass's override included): the
        callback wraps ``trainer.compute_loss`` for each micro-batch (an attribute of the
        trainer, taken off as it is called), the guard checks the loss it returns, and the
        snapshot holds the batch ``compute_loss`` got (before it took the labels out) and
        records it as the step's ``loss_source``, with the arguments the Trainer passed
        (``num_items_in_batch``): ``snap.trace()``, ``nbdebug.diagnose``, ``%nbdebug`` and
        ``nbdebug inspect`` replay ``compute_loss`` on the loaded model, called on a
        stand-in for the trainer (the class imported with ``trust_recipe=True``, or given:
        ``snap.trace(trainer=MyTrainer)``; an override that reads the trainer's attributes,
        such as ``self.args``, needs ``snap.trace(trainer=trainer)``). Not with ``loss_fn=``
        among the options: the replay then calls the model and that loss function.

        The snapshot holds the batch the Trainer fed the model (for a model that returns its
        loss, the keyword arguments the model was called with: the batch, labels included,
        and what ``compute_loss`` adds such as ``num_items_in_batch``; under gradient
        accumulation the first micro-batch whose loss was not finite, else the last), the
        ``TrainingArguments`` as plain data (``snap.trainer["args"]``), the optimizer and the
        learning-rate scheduler states, and the autocast state the forward actually ran
        under (``snap.autocast``: under
        ``bf16=True`` bfloat16; under ``fp16=True`` float16 on a GPU, but nothing on CPU,
        where accelerate trains ``fp16=True`` in float32 without autocast). It is read
        inside the model's forward by a pre-hook on the child that runs first; for a model
        without children, from the autocast that a decorator around its ``forward`` enters
        (accelerate's wrapper under ``bf16=True``, or a ``@torch.autocast`` of one's own),
        else the one around the call. Under ``fp16=True`` on a GPU the guard gets
        accelerate's GradScaler: a step whose float16 gradients overflow is the scaler's
        own skip (no snapshot, not in :attr:`skipped`).

        The hooks that read them are on the model for one micro-batch at a time: put on in
        ``on_step_begin`` and ``on_substep_end``, taken off by the forward hook as the
        model's forward returns or raises (an ``always_call`` hook). The Trainer has no
        exception callback, but between steps, and after a ``train()`` that stopped with
        an error (in the forward, the backward, the data, another callback), the model's
        hook dictionaries are as they were. Two cases leave the hooks on until the model's
        next forward: a ``KeyboardInterrupt`` inside the forward (torch runs no hook then)
        and an error between a step's start and its forward. The hooks check that the
        Trainer's training loop is on the stack, so that next forward, not the Trainer's,
        records nothing and takes them off (as does the next ``train()``).

        Under DDP (the Trainer started by ``torchrun`` or ``accelerate launch``) every
        rank runs its own callback: the guards agree on each step (one ``all_reduce``),
        every rank makes a step that any rank found non-finite a no-op, and each writes
        ``step-...-rankN.nbsnap`` (see :func:`nbdebug.compare_ranks`).

        Dataset indices: the guard gets each micro-batch's indices as the training
        ``DataLoader``'s batch sampler yielded them (under DDP accelerate's per-rank
        shard of them), recorded as the loader fetched them
        (:mod:`nbdebug.integrations.sampler_ids`; the batches, their order and the random
        draws are those of a run without the callback): the snapshot's ``ids``,
        :func:`nbdebug.row_blame`'s ids and a skipped batch's in ``skip_batches.json``.
        Where they cannot be known (an ``IterableDataset``, accelerate's
        ``dispatch_batches``, the epoch a resumed run fast-forwards through) no ids are
        passed and the callback's repr says why (nothing for a resumed epoch). The
        recording hook is on the Trainer's loader from ``on_epoch_begin`` to the iterator
        the Trainer makes next, which takes it off (after an error in between: the
        loader's next iterator, which records nothing).

        Parameters
        ----------
        directory : str or PathLike
            Where snapshots go (``step-000000012.nbsnap``; step = ``state.global_step``).
        sampler_ids : bool
            ``False``: pass the guard no dataset indices (nothing is recorded).
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
            self,
            directory: str | os.PathLike[str] = "nbdebug-snapshots",
            *,
            sampler_ids: bool = True,
            **guard_options: Any,
        ):
            self.init_state(
                directory,
                guard_options,
                framework="transformers",
                version=transformers.__version__,
                supported=SUPPORTED,
                sampler_ids=sampler_ids,
            )
            self._ids_kept = False  # this micro-batch is the one the snapshot holds
            self._unlogged = 0
            self._device_type = "cpu"
            self._autocast_seen: dict[str, str] | None = None
            # the hooks of one micro-batch (see _arm) and what they need
            self._model: Any = None
            self._leave_hook: Any = None
            self._leave_fn: Any = self._leave
            self._probes: list[Any] = []
            self._probe_child: Any = None
            self._inner_autocast: Any = _UNSEEN
            self._decorated: tuple[bool, Any] = (False, None)
            self._loop_codes: tuple[Any, ...] = ()
            self._loop_ids: frozenset[int] = frozenset()
            self._loop_thread = 0
            # the Trainer's compute_loss, watched for one micro-batch (see _watch_loss)
            self._trainer: Any = None
            self._watching: Any = None  # the wrapper on the trainer
            self._loss_call: tuple[Any, tuple[Any, ...], dict[str, Any]] | None = None
            self._loss_pending = False  # this micro-batch's loss is compute_loss's
            self._step_source: dict[str, Any] | None = None  # the kept micro-batch's

        def __repr__(self) -> str:
            return (
                f"hf NaNGuardCallback(directory={str(self.directory)!r}, "
                f"{len(self.skipped)} skipped step(s){self.ids_repr()})"
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

        # -- the hooks: on the model for one micro-batch's forward at a time ----------------

        def _arm(self) -> None:
            """Hook the model for the Trainer's next micro-batch: a forward hook that records
            the batch and its loss and takes every hook of the callback off again
            (``always_call``: also when the forward raises), and a pre-hook on the child that
            ran first in the last forward (on every child until one has run), which reads
            the autocast state inside the forward (accelerate enters it there)."""
            model = self._model
            if model is None or self._leave_hook is not None:
                return
            self._leave_hook = model.register_forward_hook(
                self._leave_fn, with_kwargs=True, always_call=True
            )
            self._inner_autocast = _UNSEEN
            child = self._probe_child
            children = _called_children(model) if child is None else [child]
            self._probes = [c.register_forward_pre_hook(self._probe) for c in children]
            self._watch_loss()

        def _disarm(self) -> None:
            if self._leave_hook is not None:
                self._leave_hook.remove()
                self._leave_hook = None
            while self._probes:
                self._probes.pop().remove()
            self._unwatch_loss()

        def _watch_loss(self) -> None:
            """Wrap the Trainer's ``compute_loss`` for the next micro-batch (an attribute of
            the trainer itself, taken off again as it is called): the wrapper records the
            batch ``compute_loss`` got, before it takes anything out of it (``labels``),
            and the loss it returns, for a model that returns none (:meth:`_leave`)."""
            trainer = self._trainer
            if trainer is None or self._watching is not None or "compute_loss" in vars(trainer):
                return  # no Trainer, or a compute_loss of the user's own on the instance
            if "loss_fn" in self.guard_options:  # the replay takes that loss function
                return

            def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
                self._unwatch_loss()
                if self._in_training():
                    batch = dict(inputs) if isinstance(inputs, Mapping) else inputs
                    self._loss_call = (batch, args, kwargs)
                result = trainer.compute_loss(model, inputs, *args, **kwargs)
                if self._loss_pending:  # the model returned no loss: this is the step's
                    self._loss_pending = False
                    self.step_batch.set_loss(result[0] if isinstance(result, tuple) else result)
                return result

            trainer.compute_loss = compute_loss
            self._watching = compute_loss

        def _unwatch_loss(self) -> None:
            trainer, fn = self._trainer, self._watching
            self._watching = None
            if fn is not None and vars(trainer).get("compute_loss") is fn:
                del vars(trainer)["compute_loss"]

        def _loss_source(self, call: tuple[Any, tuple[Any, ...], dict[str, Any]]) -> Any:
            """The ``loss_source`` of a loss the Trainer's ``compute_loss`` computed, called
            with ``call``'s arguments (``None`` when one cannot be recorded): its replay
            runs ``type(trainer).compute_loss(trainer, model, batch, ...)``."""
            _, args, kwargs = call
            plain = [_plain_argument(a) for a in args]
            named = {k: _plain_argument(v) for k, v in kwargs.items()}
            if any(v is ... for v in (*plain, *named.values())):
                return None
            source = method_source(
                type(self._trainer),
                "compute_loss",
                call=TRAINER_METHOD,
                args=plain,
                silence=[],
                batch={"form": "inputs"},
            )
            return {**source, "kwargs": named}

        def _in_training(self) -> bool:
            """Whether the forward now running is the Trainer's (its training loop is on this
            thread's stack). A forward of anyone else's once training has stopped on an
            error that no callback saw (a ``KeyboardInterrupt`` inside the forward, an error
            between a step's start and its forward) takes the hooks off."""
            if not self._loop_ids:
                return True  # not started by a Trainer's loop: the callbacks alone decide
            if _on_stack(sys._getframe(1), self._loop_ids):
                return True
            if threading.get_ident() == self._loop_thread or not _on_stack(
                sys._current_frames().get(self._loop_thread), self._loop_ids
            ):
                self._disarm()  # training has stopped
            return False

        def _probe(self, module: Any, args: Any) -> None:
            # traceable by torch.compile (no graph break inside the model's forward); whose
            # forward this was, _leave decides
            if self._inner_autocast is _UNSEEN:  # the first child to run in this forward
                self._inner_autocast = autocast_state(self._device_type)
                self._probe_child = module  # the next micro-batches hook this child alone

        def _leave(self, module: Any, args: Any, kwargs: Any, output: Any) -> None:
            if not self._in_training():
                return
            if output is not None and not (module.training and torch.is_grad_enabled()):
                return  # a forward without gradients inside the step: its own comes next
            inner = self._inner_autocast
            if inner is _UNSEEN:  # no child ran (or the model has none)
                self._probe_child = None
                decorated, state = self._decorated
                inner = state if decorated else autocast_state(self._device_type)
            self._disarm()
            call, self._loss_call = self._loss_call, None
            if output is None:  # the forward raised: training stops with it
                return
            loss = _loss_of(output)
            # a model that returns no loss: the loss is compute_loss's, and the snapshot
            # holds the batch compute_loss got, to replay it
            source = self._loss_source(call) if loss is None and call is not None else None
            self._loss_pending = source is not None
            if not self.step_batch.bad:  # the micro-batch the snapshot will hold
                self._step_source = source
                self._ids_kept = True
            batch = dict(kwargs) if kwargs and not args else (args or kwargs)
            self.step_batch.add(call[0] if source is not None and call is not None else batch)
            if loss is not None:
                self.step_batch.set_loss(loss)
            self._autocast_seen = inner

        # -- the Trainer's events -------------------------------------------------------

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
            self.record_trainer(
                {
                    "framework": "transformers",
                    "version": transformers.__version__,
                    "global_step": int(state.global_step),
                    "args": args.to_dict(),
                }
            )
            self._disarm()
            self.restart_ids()
            self._model = model
            self._device_type = next((p.device.type for p in model.parameters()), "cpu")
            self._autocast_seen = None
            self._probe_child = None
            # accelerate has wrapped model.forward by now (autocast under bf16=True): what a
            # model without children ran in
            self._decorated = _forward_autocast(model, self._device_type)
            self._loop_codes, self._trainer = _training_loop()
            self._loop_ids = frozenset(id(code) for code in self._loop_codes)
            self._loop_thread = threading.get_ident()
            self._leave_fn = self._leave
            if "torch._dynamo" in sys.modules:  # torch.compile may trace the model's hooks:
                # one graph break at the forward's end, not one per untraceable call
                self._leave_fn = torch.compiler.disable(self._leave)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._disarm()
            self.sampler_ids.close()
            self._model = None
            self._loop_codes, self._loop_ids, self._trainer = (), frozenset(), None

        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # the Trainer makes the epoch's iterator next: it records the batches' indices
            # (not an iterator made once training stopped on an error after this)
            loop = self._loop_ids
            self.sampler_ids.arm(
                kwargs.get("train_dataloader"),
                active=lambda: not loop or _on_stack(sys._getframe(1), loop),
            )

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.sampler_ids.disarm()  # the epoch's iterator is made (the loader is as it was)
            if self.guard is not None:
                self.guard.mark_step_start()
                self._arm()

        def _take_ids(self) -> None:
            """A micro-batch is over: its dataset indices are the next recorded."""
            self.sampler_ids.take(kept=self._ids_kept)
            self._ids_kept = False

        def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._take_ids()
            self._arm()  # the next micro-batch of gradient accumulation

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._disarm()  # a step whose forward never reached the model
            self._take_ids()
            if self.guard is None:
                return
            step = int(state.global_step)
            inputs, loss = self.step_batch.batch, self.step_batch.loss
            ids = self.sampler_ids.step_ids(inputs)
            self.sampler_ids.end_step()
            self.step_batch.reset()
            self.record_global_step(step)
            self.guard.set_snapshot_field("autocast", self._autocast_seen)  # None: none seen
            self.guard.set_snapshot_field("loss_source", self._step_source)  # None: the model's
            self._autocast_seen, self._step_source, self._loss_pending = None, None, False
            ok = self.guard.check(loss, inputs=inputs, step=step, ids=ids)
            if ok or not self.guard.history[-1].get("skipped"):
                return
            self.skipped.append(step)
            self._unlogged += 1
            _log.warning(
                "nbdebug: step %d made a no-op (%s); snapshot %s",
                step,
                self.guard.history[-1].get("skip_reason"),
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
                    "nbdebug/skips": float(self.guard.skips.total) if self.guard else 0.0,
                    "nbdebug/skips_in_row": float(self.guard.skips.in_row) if self.guard else 0.0,
                }
                logs.update(added)
                history = getattr(state, "log_history", None)
                if history and history[-1].get("step") == state.global_step:
                    history[-1].update(added)
                self._unlogged = 0
