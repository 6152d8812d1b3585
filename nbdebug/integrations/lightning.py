"""``NaNGuardCallback`` for the Lightning ``Trainer`` (``pip install nbdebug[lightning]``).

>>> from nbdebug.integrations.lightning import NaNGuardCallback
>>> trainer = lightning.Trainer(callbacks=[NaNGuardCallback(directory="snapshots")])
>>> trainer.fit(module, loader)       # a NaN step is skipped and written to snapshots/
>>> snap = nbdebug.load_snapshot("snapshots/step-000000012.nbsnap", model=MyModule)
>>> snap.trace().origin
"""

from __future__ import annotations

import inspect
import logging
import os
from typing import Any

import torch

from ..core.snapshot.replay import MODEL_METHOD
from .base import (
    CallbackState,
    batch_form,
    make_guard,
    method_source,
    missing_framework,
    replay_inputs,
    split_batch,
    takes_index,
)

__all__ = ["SUPPORTED", "NaNGuardCallback"]

#: the Lightning versions this callback supports, ``[low, high)``
SUPPORTED = ("2.0", "3.0")
_log = logging.getLogger("nbdebug")
#: the LightningModule methods a replay of ``training_step`` makes no-ops (no trainer is
#: attached to the loaded module)
SILENCED = ("log", "log_dict", "print")

try:
    import lightning
    import lightning.pytorch as pl
except ImportError as _error:  # the extra is not installed
    NaNGuardCallback: Any = missing_framework(__name__, "Lightning", "lightning", _error)
else:
    _PRECISION_DTYPES = {"bf16-mixed": "bfloat16", "16-mixed": "float16"}

    class NaNGuardCallback(CallbackState, pl.Callback):  # type: ignore[no-redef]
        """Run :class:`nbdebug.NaNGuard` on every optimizer step of a Lightning ``Trainer``.

        The guard checks in ``on_before_optimizer_step``: after the backward (the closure
        has run) and, under ``precision="16-mixed"``, after the GradScaler unscaled the
        gradients, before the optimizer updates the weights. On a bad step it writes a
        snapshot with the step's batch (the one ``training_step`` received; under
        gradient accumulation the first micro-batch whose loss was not finite, else the
        last: a NaN made in the gradients alone, with a finite loss, by an earlier
        micro-batch is then not in the snapshot, and its replay finds no origin), and,
        with ``on_nonfinite="skip"`` (the default), sets every gradient to ``None``:
        Lightning then still calls ``optimizer.step()``, and a torch optimizer skips each
        parameter whose ``.grad`` is ``None`` (no update, no momentum or Adam moment
        change, no weight decay), so the step is a no-op for the weights. The skip
        is logged to the trainer's loggers as ``nbdebug/skipped`` (1.0) at the step, with
        the guard's skip counters ``nbdebug/skips`` (in all) and ``nbdebug/skips_in_row``,
        and to the ``"nbdebug"`` Python logger.

        The optimizer's learning-rate scheduler still steps (Lightning steps it after the
        optimizer). Lightning's gradient clipping (``gradient_clip_val``) is left out of a
        skipped step: there is no gradient to clip (torch's ``clip_grad_value_`` fails on
        none), and the trainer's setting is back for the next step. Every optimizer step is
        checked (under manual optimization with several optimizers, each one's, with the
        batch ``training_step`` received); the snapshot holds the first optimizer's state.

        Mixed precision: the autocast dtype the trainer ran (``trainer.precision``) goes
        into the snapshot. On CPU, Lightning 2.x itself runs ``precision="16-mixed"`` as
        ``"bf16-mixed"`` (with its warning "AMP with fp16 is not supported on CPU"), so
        the snapshot says bfloat16; float16 with a GradScaler on CPU takes
        ``plugins=[MixedPrecision("16-mixed", "cpu")]``. A step whose float16 gradients
        overflow under the GradScaler is the scaler's own skip (it skips the update and
        lowers the scale): no snapshot, not in :attr:`skipped`, a history row with
        ``skipped=True, nonfinite=None``; a non-finite loss is the guard's.

        Under DDP every rank runs its own callback: the guards agree on each step (one
        ``all_reduce``), every rank skips a step that any rank found non-finite, and each
        writes ``step-...-rankN.nbsnap`` (see :func:`nbdebug.compare_ranks`).

        Dataset indices: the guard gets each batch's indices as the training
        ``DataLoader``'s batch sampler yielded them (each rank its own, under DDP: the
        global indices of its ``DistributedSampler``), recorded as the loader fetched them
        (:mod:`nbdebug.integrations.sampler_ids`; the batches, their order and the random
        draws are those of a run without the callback): the snapshot's ``ids``,
        :func:`nbdebug.row_blame`'s ids and a skipped batch's in ``skip_batches.json``.
        Where they cannot be known (an ``IterableDataset``, several training loaders, ...)
        no ids are passed and the callback's repr says why. The strategy's
        ``process_dataloader`` (which gets the training loader last) arms it, an attribute
        of the strategy from ``on_fit_start`` to the end of ``fit`` (or its error).

        Parameters
        ----------
        directory : str or PathLike
            Where snapshots go (``step-000000012.nbsnap``; step = ``trainer.global_step``).
        sampler_ids : bool
            ``False``: pass the guard no dataset indices (nothing is recorded).
        **guard_options
            Further :class:`nbdebug.NaNGuard` options (``patience``, ``on_nonfinite``,
            ``loss_fn``, ``recipe``, ``max_snapshots``, ``checks``, ...). The model,
            optimizer, scheduler and GradScaler come from the trainer.

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
                framework="lightning",
                version=lightning.__version__,
                supported=SUPPORTED,
                sampler_ids=sampler_ids,
            )
            # (the strategy, our process_dataloader, the one of the instance's own it hides)
            self._strategy_hook: tuple[Any, Any, Any] | None = None
            self._stepped = False  # an optimizer step ran during this training_step
            self._clip_val: Any = None  # the trainer's gradient_clip_val, off for a skip
            self._batch_idx = 0  # the index training_step got the step's batch with

        def __repr__(self) -> str:
            return (
                f"lightning NaNGuardCallback(directory={str(self.directory)!r}, "
                f"{len(self.skipped)} skipped step(s){self.ids_repr()})"
            )

        # a transformers.Trainer calls this first: the wrong trainer
        def on_init_end(self, *args: Any, **kwargs: Any) -> None:
            raise TypeError(
                "nbdebug.integrations.lightning.NaNGuardCallback expects a Lightning Trainer; "
                "it was attached to a transformers.Trainer: use "
                "nbdebug.integrations.hf.NaNGuardCallback there."
            )

        def setup(self, trainer: Any, pl_module: Any = None, stage: str | None = None) -> None:
            # (defaults: given the class, Lightning's call binds its trainer to self)
            if not isinstance(self, NaNGuardCallback):  # the class, called unbound
                raise TypeError(
                    "callbacks= takes an instance, NaNGuardCallback(directory=...), not the "
                    "class nbdebug.integrations.lightning.NaNGuardCallback."
                )
            if not isinstance(trainer, pl.Trainer):
                raise TypeError(
                    "nbdebug.integrations.lightning.NaNGuardCallback expects a "
                    f"lightning.pytorch.Trainer; it was attached to a {type(trainer).__module__}."
                    f"{type(trainer).__qualname__}."
                )

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            # the training loader is made (and its first iterator) before on_train_start:
            # the strategy's process_dataloader, which gets it last, arms it
            self.restart_ids()
            strategy = trainer.strategy
            process = strategy.process_dataloader

            def process_dataloader(dataloader: Any) -> Any:
                out = process(dataloader)
                if trainer.training:  # not a sanity check's or validation's loader
                    self.sampler_ids.arm(out)
                return out

            previous = vars(strategy).get("process_dataloader")  # an instance's own, if any
            strategy.process_dataloader = process_dataloader
            self._strategy_hook = (strategy, process_dataloader, previous)

        def _stop_ids(self) -> None:
            """Leave the strategy and the training loaders as they were."""
            if self._strategy_hook is not None:
                strategy, hook, previous = self._strategy_hook
                if vars(strategy).get("process_dataloader") is hook:
                    del vars(strategy)["process_dataloader"]
                    if previous is not None:
                        strategy.process_dataloader = previous
                self._strategy_hook = None
            self.sampler_ids.close()

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            loaders = trainer.train_dataloader  # the next epoch's iterator records
            if isinstance(loaders, (list, tuple, dict)):
                self.sampler_ids.close("the training batches come from several loaders")
            elif "dataloader_iter" in inspect.signature(pl_module.training_step).parameters:
                self.sampler_ids.close("training_step takes the batches itself (dataloader_iter)")
            else:
                self.sampler_ids.arm(loaders)

        def teardown(self, *args: Any, **kwargs: Any) -> None:
            if isinstance(self, NaNGuardCallback):  # (not the class, called unbound)
                self._stop_ids()

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            optimizer = trainer.optimizers[0] if trainer.optimizers else None
            configs = getattr(trainer, "lr_scheduler_configs", None) or []
            scheduler = configs[0].scheduler if configs else None
            options = dict(self.guard_options)
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            if scaler is not None:
                options.setdefault("scaler", scaler)
            self.guard = make_guard(
                pl_module, optimizer, scheduler, directory=self.directory, options=options
            )
            self.record_trainer(
                {
                    "framework": "lightning",
                    "version": lightning.__version__,
                    "global_step": int(trainer.global_step),
                    "args": {
                        "precision": str(trainer.precision),
                        "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
                        "gradient_clip_val": trainer.gradient_clip_val,
                        "max_steps": int(trainer.max_steps),
                        "max_epochs": trainer.max_epochs,
                        "hparams": dict(getattr(pl_module, "hparams", {}) or {}),
                    },
                }
            )
            dtype = _PRECISION_DTYPES.get(str(trainer.precision))
            if dtype is not None:
                device = next((p.device.type for p in pl_module.parameters()), "cpu")
                self.guard.set_snapshot_field("autocast", {"device_type": device, "dtype": dtype})

        def on_train_batch_start(
            self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
        ) -> None:
            if self.guard is None:
                return
            if self.step_batch.batch is None:  # the first micro-batch of an optimizer step
                self.guard.mark_step_start()
            if not self.step_batch.bad:  # the micro-batch the snapshot will hold
                self._batch_idx = int(batch_idx)
            self.sampler_ids.take(kept=not self.step_batch.bad)
            self.step_batch.add(batch)

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            # under automatic optimization Lightning divides the loss by
            # accumulate_grad_batches before the backward: the history gets training_step's
            n = int(trainer.accumulate_grad_batches)
            if pl_module.automatic_optimization and n > 1 and isinstance(loss, torch.Tensor):
                loss = loss.detach() * n
            self.step_batch.set_loss(loss)

        def on_train_batch_end(self, trainer: Any, *args: Any, **kwargs: Any) -> None:
            self._restore_clipping(trainer)
            if self._stepped:  # an optimizer step ended with this batch
                self.step_batch.reset()
                self._stepped = False

        def on_exception(self, trainer: Any = None, *args: Any, **kwargs: Any) -> None:
            # it takes any arguments so that, given the class instead of an instance,
            # Lightning's call of it unbound leaves setup()'s error standing
            if isinstance(self, NaNGuardCallback):
                self._restore_clipping(trainer)
                self._stop_ids()

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._restore_clipping(trainer)
            self._stop_ids()

        def _record_loss_source(self, pl_module: Any, inputs: Any, target: Any) -> None:
            """Without ``loss_fn=``, the loss is ``training_step``'s: the snapshot records
            it (``loss_source``), so its replay runs ``training_step(batch, batch_idx)``
            with ``self.log``, ``self.log_dict`` and ``self.print`` made no-ops."""
            assert self.guard is not None
            form = batch_form(self.step_batch.batch, inputs, target)
            if "loss_fn" in self.guard_options or form is None:
                return
            if not pl_module.automatic_optimization:  # it steps the optimizer itself
                return
            args = [self._batch_idx] if takes_index(pl_module.training_step) else []
            source = method_source(
                type(pl_module),
                "training_step",
                call=MODEL_METHOD,
                args=args,
                silence=list(SILENCED),
                batch=form,
            )
            self.guard.set_snapshot_field("loss_source", source)

        def _restore_clipping(self, trainer: Any) -> None:
            if self._clip_val is not None and trainer is not None:
                trainer.gradient_clip_val = self._clip_val
                self._clip_val = None

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self.guard is None:
                return
            step = int(trainer.global_step)
            inputs, target = replay_inputs(pl_module, *split_batch(self.step_batch.batch))
            loss = self.step_batch.loss
            # the batch is kept to the end of training_step (on_train_batch_end): under
            # manual optimization a second optimizer steps on the same batch
            self._stepped = True
            self.record_global_step(step)
            self._record_loss_source(pl_module, inputs, target)
            ids = self.sampler_ids.step_ids(inputs)
            if self.guard.check(loss, inputs=inputs, target=target, step=step, ids=ids):
                return
            row = self.guard.history[-1]
            if not row.get("skipped"):  # on_nonfinite="continue": recorded, not skipped
                return
            if trainer.gradient_clip_val is not None:  # Lightning clips next: nothing to clip
                self._clip_val = trainer.gradient_clip_val
                trainer.gradient_clip_val = None
            self.skipped.append(step)
            reason = row.get("skip_reason")
            _log.warning(
                "nbdebug: step %d skipped (%s); snapshot %s",
                step,
                reason,
                self.guard.snapshots[-1] if self.guard.snapshots else None,
            )
            skips = self.guard.skips
            for logger in trainer.loggers:
                logger.log_metrics({"nbdebug/skipped": 1.0}, step=step)
                counters = {"nbdebug/skips": skips.total, "nbdebug/skips_in_row": skips.in_row}
                logger.log_metrics({k: float(v) for k, v in counters.items()}, step=step)
