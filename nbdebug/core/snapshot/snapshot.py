"""The :class:`Snapshot`: one training step as a snapshot file holds it, with what a
replay needs (the model rebuilt with the stored state, the optimizer, the RNG states)
and :meth:`Snapshot.trace`, which replays the step."""

from __future__ import annotations

import datetime as _dt
import fnmatch
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..batch import check_flag, describe
from ..state import RngState
from ..text import count_text, first_line, shorten
from ..vocab import FailureKind
from .container import TensorEntry, TensorStore, materialize
from .data import build_loss, import_object, is_trusted, to_device
from .format import FIELDS, Lives, SnapshotError, snapshot_attributes, validate_payload
from .replay import (
    MODEL_METHOD,
    TRAINER_METHOD,
    ReplayStep,
    rebuild_batch,
    replay_contexts,
    stand_in,
    step_batch,
    step_module,
)
from .rewind import RewindWindow, describe_window, window_from_payload
from .rngdata import rng_from_payload
from .tensorref import TensorRef

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from ..guard.signals import LayerSignals
    from ..trace import Trace

__all__ = ["Snapshot"]

#: The failures a snapshot's kind records, in words (:attr:`Snapshot.recorded_failure`).
RECORDED: dict[str, str] = {
    FailureKind.LOSS: "a non-finite loss",
    FailureKind.GRAD: "non-finite gradients",
    FailureKind.WEIGHTS: "non-finite weights",
    FailureKind.SCALE: "a collapsed GradScaler scale",
    FailureKind.RANK: "a non-finite value on another rank",
    FailureKind.OPTIMIZER: "a non-finite optimizer update",
}


class Snapshot:
    """One training step saved by :func:`save_snapshot`; see :func:`load_snapshot`.

    Attributes
    ----------
    path : pathlib.Path
    step : int or None
    reason : dict
        ``"kind"`` (``"loss"``, ``"grad"``, ``"weights"``, ``"scale"``, ``"manual"``),
        ``"message"``, and what the guard measured (``loss``, ``grad_norm``,
        ``nonfinite_grads``, ``grad_norms`` per parameter, ...).
    model : torch.nn.Module or None
        The rebuilt model holding the stored state (a copy; ``None`` without ``model=``
        or a trusted recipe).
    model_state : dict of str to Tensor
    inputs, target
        The batch as stored (on ``map_location``).
    history : list of dict
    environment : dict
    time : float
        When it was written (seconds since the epoch).
    recipe, loss_fn_spec : dict or None
    optimizer_state, scaler_state, scheduler_state : dict or None
    rng : dict or None
        Stored RNG states (see :meth:`restore_rng`).
    version : int
        The format version of the file.

    Every field of the snapshot table (``nbdebug.core.snapshot.format.FIELDS``) is an
    attribute (fields newer than the file hold their defaults). Of a safetensors file
    (format 5 on), the model and optimizer states are read when first used
    (``Lives.LAZY`` fields); :meth:`state_entries`, :meth:`nonfinite_state` and
    :meth:`param_norms` come from the file's header without reading them.
    """

    # one attribute per field of the snapshot table (format.FIELDS), set by
    # __init__ from the payload; annotated here for type checkers
    step: int | None
    time: float
    reason: dict[str, Any]
    model_state: dict[str, torch.Tensor]
    model_class: str | None
    model_training: bool
    module_training: dict[str, bool]
    inputs: Any
    target: Any
    optimizer_state: dict[str, Any] | None
    optimizer_class: str | None
    optimizer_params: list[str | None] | None
    scaler_state: dict[str, Any] | None
    scheduler_state: dict[str, Any] | None
    scheduler_class: str | None
    rng: dict[str, Any] | None
    history: list[dict[str, Any]]
    environment: dict[str, Any]
    recipe: dict[str, Any] | None
    loss_fn_spec: dict[str, Any] | None
    dropped: list[str]
    rank: int | None
    world_size: int | None
    local_first: bool | None
    culprit_ranks: list[int]
    rank_kinds: dict[str, list[str]]
    fingerprints: dict[str, Any] | None
    trainer: dict[str, Any] | None
    autocast: dict[str, Any] | None
    layout: str
    loss_source: dict[str, Any] | None
    rewind_data: dict[str, Any] | None
    update_grads: dict[str, Any] | None
    signals_data: dict[str, Any] | None
    ids: list[int] | None
    compiled: dict[str, Any] | None

    def __init__(
        self,
        payload: dict[str, Any],
        path: Path | None = None,
        model: torch.nn.Module | None = None,
        *,
        trust_recipe: bool = False,
        store: TensorStore | None = None,
        modules: Sequence[str] | None = None,
    ):
        self.path = path
        self.version: int = payload["version"]
        self._store = store
        self._lazy: dict[str, Any] = {}
        #: the module patterns a replay records (``snap.trace(modules=...)``'s default);
        #: without a model, also the modules whose state :attr:`model_state` holds
        self.modules = list(modules) if modules is not None else None
        self._state_modules = self.modules if model is None else None
        lazy = {f.attribute for f in FIELDS if f.lives is Lives.LAZY}
        for name, value in snapshot_attributes(payload).items():
            if store is not None and name in lazy:
                self._lazy[name] = value
            else:
                setattr(self, name, value)
        if self._state_modules is not None and "model_state" in self.__dict__:
            self.model_state = {k: v for k, v in self.model_state.items() if self._kept(k)}
        self.time = float(self.time)
        self.model = model
        self.trust_recipe = trust_recipe

    def __getattr__(self, name: str) -> Any:
        # a lazy field (the model or optimizer state of a safetensors file), read once used
        lazy = self.__dict__.get("_lazy")
        if not lazy or name not in lazy:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = lazy[name]
        if name == "model_state":
            value = {k: v for k, v in value.items() if self._kept(k)}
        value = materialize(value, self._store) if self._store is not None else value
        setattr(self, name, value)  # found from now on: __getattr__ is not called again
        return value

    def _kept(self, key: str) -> bool:
        """Whether the state entry ``key`` is kept: it belongs to a module of
        :attr:`modules` (a snapshot loaded without a model), or all are."""
        if self._state_modules is None:
            return True
        owner = key.rsplit(".", 1)[0] if "." in key else ""
        return any(
            fnmatch.fnmatchcase(owner, p) or owner == p or owner.startswith(p + ".")
            for p in self._state_modules
        )

    # ----------------------------------------------------------------- without the weights
    @property
    def bytes_read(self) -> int:
        """Tensor bytes read from the file so far (0 for a file of the older format, which
        is read whole when loaded)."""
        return self._store.bytes_read if self._store is not None else 0

    def state_entries(self) -> dict[str, TensorEntry]:
        """Every model state tensor as the file's header describes it (dtype, shape,
        device, checksum, non-finite count, norm), without reading it. A file of the older
        format records none: they are measured from the loaded tensors."""
        refs = self._lazy.get("model_state")
        if refs is not None and self._store is not None:
            table = self._store.table
            return {
                k: table[r.name]
                for k, r in refs.items()
                if isinstance(r, TensorRef) and self._kept(k)
            }
        from .container import describe_tensor

        return {k: describe_tensor(k, v) for k, v in self.model_state.items()}

    def nonfinite_state(self) -> dict[str, int]:
        """``{state key: number of NaN/Inf elements}`` of the model state tensors holding
        any (recorded at write time: no weight is read)."""
        return {k: e.nonfinite for k, e in self.state_entries().items() if e.nonfinite}

    def verify(self) -> int:
        """Read every tensor of the file and check it against the checksum recorded when
        it was written (nothing is kept); the number of tensors checked.

        Raises
        ------
        SnapshotError
            A tensor's bytes do not match (naming it), or the file cannot be read."""
        if self._store is None:  # the older format was checked when it was loaded
            return len(self.model_state)
        return self._store.verify()

    @classmethod
    def from_payload(
        cls,
        payload: Any,
        path: str | os.PathLike[str] | None = None,
        model: torch.nn.Module | None = None,
        *,
        trust_recipe: bool = False,
        store: TensorStore | None = None,
        modules: Sequence[str] | None = None,
    ) -> Snapshot:
        """The snapshot held by a loaded snapshot dictionary (``torch.load`` of a file).

        The dictionary is checked against the field table
        (:func:`~nbdebug.core.snapshot.format.validate_payload`); the fields that an older
        format version lacks get their defaults.

        Parameters
        ----------
        payload : dict
        path : str or PathLike, optional
            Where it was read from (named in errors, kept as :attr:`path`).
        model : torch.nn.Module, optional
            The module to replay on, used as it is (:func:`load_snapshot` gives a copy).
        trust_recipe : bool
            As for :func:`load_snapshot`.
        store : TensorStore, optional
            Reads the tensors that the dictionary names (``TensorRef``) when used.
        modules : sequence of str, optional
            As for :func:`load_snapshot`.

        Returns
        -------
        Snapshot

        Raises
        ------
        SnapshotError
            Not a snapshot dictionary, a newer format, a missing field or a corrupt value.
        """
        where = Path(path) if path is not None else None
        checked = validate_payload(payload, where if where is not None else "<snapshot>")
        return cls(checked, where, model, trust_recipe=trust_recipe, store=store, modules=modules)

    # ----------------------------------------------------------------- views
    @property
    def rewind(self) -> RewindWindow | None:
        """The guard's rewind window (``NaNGuard(rewind=K)``; its tensors read on first
        use): the state at the start of ``start_step`` and every step since, the failing
        step last. ``None``: written without ``rewind=``, or by an older nbdebug."""
        data = self.rewind_data
        return None if data is None else window_from_payload(data)

    def rewind_summary(self) -> str | None:
        """The rewind window in one line, from the file's header (no tensor read);
        ``None`` without one."""
        if "rewind_data" in self._lazy:  # not read yet: the header's structure is enough
            return describe_window(self._lazy["rewind_data"])
        return describe_window(self.rewind_data)

    @property
    def signals(self) -> LayerSignals | None:
        """The guard's per-layer signals up to this step (``NaNGuard(signals=...)``:
        gradient norm, update ratio, Adam's lag per parameter). ``None``: written without
        them, or by an older nbdebug."""
        from ..guard.signals import LayerSignals  # the guard imports the snapshot package

        data = self.signals_data
        try:
            return None if data is None else LayerSignals.from_field(data)
        except ValueError as e:
            raise SnapshotError(f"{self.path} is corrupt: its 'signals' field: {e}") from e

    @property
    def kind(self) -> str:
        return str(self.reason.get("kind", ""))

    @property
    def message(self) -> str:
        return str(self.reason.get("message", ""))

    @property
    def recorded_failure(self) -> str | None:
        """What the run recorded at this step, in words ("a non-finite loss at step 7");
        ``None`` for a snapshot written by hand (kind ``"manual"``) or of an unknown kind."""
        what = RECORDED.get(self.kind)
        if what is None:
            return None
        return what if self.step is None else f"{what} at step {self.step}"

    @property
    def datetime(self) -> _dt.datetime:
        return _dt.datetime.fromtimestamp(self.time)

    def history_frame(self) -> pd.DataFrame:
        """The guard's history as a DataFrame: one row per step, columns ``step``, ``loss``,
        ``grad_norm``, ``param_norm``, ``lr``, ``scale`` (floats; NaN where not recorded),
        ``skipped`` (bool), then any other recorded columns (``nonfinite``, ``time``)."""
        from ..guard.history import history_frame  # the guard writes the rows it reads

        return history_frame(self.history)

    def param_norms(self) -> dict[str, float]:
        """L2 norm of every floating tensor of the stored model state: recorded at write time
        in a safetensors file (reduced in float32; no weight is read), computed in float64
        from the tensors of an older file."""
        entries = self.state_entries() if self._store is not None else {}
        if entries and all(e.norm is not None or not e.is_floating for e in entries.values()):
            return {k: float(e.norm) for k, e in entries.items() if e.norm is not None}
        out = {}
        for k, v in self.model_state.items():
            if v.is_floating_point() or v.is_complex():
                x = v.detach().abs() if v.is_complex() else v.detach()
                out[k] = float(torch.linalg.vector_norm(x, dtype=torch.float64))
        return out

    # ----------------------------------------------------------------- replay
    def reset_model(self) -> torch.nn.Module:
        """Load the stored state into :attr:`model` again, in the stored dtypes, and set
        its train flags: the model's, and those of the submodules whose flag differed
        (:attr:`module_training`, a BatchNorm frozen in eval).

        A model built in float32 for a step that ran with half-precision weights
        (``model.half()``, Lightning's ``precision="16-true"``) gets those weights in
        their own dtype (``load_state_dict`` alone would cast them to float32 and replay
        another step). The model is nbdebug's own (a copy or the factory's), never the
        caller's."""
        model = self._need_model()
        model.load_state_dict(self.model_state)
        own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        with torch.no_grad():
            for name, stored in self.model_state.items():
                t = own.get(name)
                if t is not None and t.dtype != stored.dtype and stored.is_floating_point():
                    t.data = stored.to(device=t.device, copy=True)
        model.train(self.model_training)
        modules = dict(model.named_modules())
        for name, flag in self.module_training.items():
            if name in modules:
                modules[name].training = flag
        return model

    def _need_model(self) -> torch.nn.Module:
        if self.model is not None:
            return self.model
        hint = ""
        if self.recipe is not None:
            hint = (
                f", or trust_recipe=True to build it with the recorded recipe "
                f"{self.recipe['factory']!r}"
            )
        err = SnapshotError(
            f"this snapshot was loaded without a model: give load_snapshot(path, "
            f"model=...) (a module or a "
            f"zero-argument factory for {self.model_class}){hint}."
        )
        err.needs_model = True
        raise err

    def loss_fn(self) -> Any:
        """The recorded loss function, rebuilt (``None`` when none was recorded)."""
        return build_loss(self.loss_fn_spec, trust=self.trust_recipe)

    def replay_loss_fn(self, loss_fn: Any, call: str) -> Any:
        """``loss_fn`` when given, else the recorded one; a :class:`SnapshotError` naming
        ``call`` (how to pass one) when there is neither but the snapshot has a target."""
        if loss_fn is None:
            loss_fn = build_loss(self.loss_fn_spec, trust=self.trust_recipe, call=call)
        if loss_fn is None and self.target is not None and self.loss_source is None:
            raise SnapshotError(
                f"this snapshot recorded no loss function but has a target: pass {call}."
            )
        return loss_fn

    def restore_rng(self) -> None:
        """Set the global torch / CUDA / numpy / Python RNGs to the stored states."""
        if self.rng is None:
            return
        st = rng_from_payload(self.rng)
        if st.cuda is not None and not (
            torch.cuda.is_available() and len(st.cuda) == torch.cuda.device_count()
        ):
            st.cuda = None
        st.restore()

    def build_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of the failing step over :attr:`model`'s parameters, with its state
        (moments, step counts) and hyper-parameters loaded. ``torch.optim`` classes are
        imported directly; others need ``trust_recipe=True``."""
        model = self._need_model()
        if (
            self.optimizer_state is None
            or self.optimizer_class is None
            or self.optimizer_params is None
        ):
            raise SnapshotError("this snapshot holds no optimizer state.")
        if not is_trusted(self.optimizer_class) and not self.trust_recipe:
            raise SnapshotError(
                f"the optimizer class {self.optimizer_class!r} lies outside torch: "
                f"load with trust_recipe=True."
            )
        try:
            cls = import_object(self.optimizer_class)
            named = dict(model.named_parameters())
            names = iter(self.optimizer_params)
            groups = []
            for g in self.optimizer_state["param_groups"]:
                hyper = {k: v for k, v in g.items() if k != "params"}
                groups.append({**hyper, "params": [named[str(next(names))] for _ in g["params"]]})
            opt: torch.optim.Optimizer = cls(groups)
            opt.load_state_dict(self.optimizer_state)
            return opt
        except Exception as e:
            raise SnapshotError(
                f"cannot rebuild the optimizer {self.optimizer_class!r}: {first_line(e)}"
            ) from e

    def trace(
        self,
        loss_fn: Any = None,
        *,
        autocast: bool = True,
        modules: str | Sequence[str] | None = None,
        trainer: object = None,
    ) -> Trace:
        """Replay the failing step: reload the stored weights and train flag, set the RNGs
        to the step's states, and run :func:`nbdebug.trace` on the stored batch (moved to
        the model's device), under the step's autocast state (``self.autocast``: the
        same dtype, on the model's device type). The caller's RNG states are put back
        afterwards.

        Parameters
        ----------
        loss_fn : callable, optional
            Overrides the recorded loss function.
        autocast : bool
            ``False``: replay in the model's own dtypes even when the step ran under
            autocast.
        modules : str or sequence of str, optional
            Record only these modules (as for :func:`nbdebug.trace`; default: the
            ``modules=`` given to :func:`load_snapshot`). The forward runs the whole model,
            so every weight is read all the same; the optimizer state is never read.
        trainer : type or object, optional
            For a step whose loss a Trainer's ``compute_loss`` computed (``loss_source``):
            the Trainer class (called on a stand-in for ``self``) or a trainer.

        Without ``loss_fn``, a step whose loss the trainer's code computed (a
        LightningModule's ``training_step``, a Trainer's ``compute_loss``: the
        ``loss_source`` field) replays through that code (:meth:`replay_step`).

        Raises
        ------
        TypeError
            An ``autocast`` that is not a bool (a dtype: the replay takes the recorded one).
        SnapshotError
            The step ran under an autocast dtype (bfloat16, float16) that this machine's
            device does not support; or ``modules`` with a step whose forward ran under
            autocast and its backward outside it (replay it without ``modules``).

        Returns
        -------
        nbdebug.Trace
        """
        from ..trace import trace, trace_step

        check_flag(autocast, "autocast")
        modules = modules if modules is not None else self.modules
        spec = self.autocast if autocast else None
        if modules is not None and spec is not None and not spec.get("backward"):
            raise SnapshotError(
                "snap.trace(modules=...) cannot yet replay a step whose forward ran under "
                "autocast and its backward outside it: replay it without modules=."
            )
        step = self.replay_step(loss_fn, "snap.trace(loss_fn=...)", trainer=trainer)
        model, inputs, target, loss_fn = step.model, step.inputs, step.target, step.loss_fn
        forward, backward = replay_contexts(spec, step.device)
        caller = RngState.capture()
        try:
            self.restore_rng()
            if modules is not None:  # the backward runs in the forward's state, or in none
                with forward():
                    tr = trace(model, inputs, target, loss_fn, modules=modules)
            else:
                tr = trace_step(model, inputs, target, loss_fn, forward=forward, backward=backward)
        finally:
            caller.restore()
        from ..guard.update_replay import with_update_origin  # core.guard imports the snapshots

        return with_update_origin(self, tr)  # a failed optimizer step: the update is the origin

    def replay_step(self, loss_fn: Any, call: str, *, trainer: object = None) -> ReplayStep:
        """What a replay of this step runs, with the stored weights reloaded (see
        :meth:`reset_model`) and the batch on the model's device: the model, batch, target
        and loss function; or, when the trainer's code computed the loss
        (:attr:`loss_source`) and no ``loss_fn`` is given, that code
        (:class:`~nbdebug.core.snapshot.replay.StepModule`) on the batch as it received
        it. ``call`` is how the user passes a loss function (named in the errors).

        Raises
        ------
        SnapshotError
            No model; a model without the method that computed the loss (the error names
            the class to pass); a trainer's class that is not given (``trainer=``) and not
            trusted.
        """
        model = self.reset_model()
        loss_fn = self.replay_loss_fn(loss_fn, call)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        inputs = to_device(self.inputs, device)
        target = to_device(self.target, device)
        if isinstance(loss_fn, torch.nn.Module):
            loss_fn = loss_fn.to(device)
        src = self.loss_source
        if loss_fn is not None or src is None:
            return ReplayStep(model, inputs, target, loss_fn, device)
        module = step_module(self._loss_model(model, src, call), src, self._trainer(src, trainer))
        batch = step_batch(module, rebuild_batch(src.get("batch"), inputs, target))
        return ReplayStep(module, batch, None, None, device)

    def _loss_model(
        self, model: torch.nn.Module, src: dict[str, Any], call: str
    ) -> torch.nn.Module:
        """``model``, when it has the method that computed the step's loss."""
        method = str(src.get("method"))
        if src.get("call") != MODEL_METHOD or callable(getattr(model, method, None)):
            return model
        cls = src.get("name") or "?"
        where = f" ({src['class']})" if src.get("class") else ""
        raise SnapshotError(
            f"this snapshot's loss was computed by {cls}.{method}(batch, ...), which the model "
            f"given ({type(model).__qualname__}) lacks: load it with load_snapshot(path, "
            f"model={cls}){where}, or pass {call}."
        )

    def _trainer(self, src: dict[str, Any], trainer: object) -> object:
        """The ``self`` a trainer's loss method is called with: the trainer given, a
        stand-in of the class given or recorded (imported when trusted), or ``None``."""
        if src.get("call") != TRAINER_METHOD:
            return None
        if trainer is None:
            name = src.get("class")
            if not isinstance(name, str) or not self.trust_recipe:
                raise SnapshotError(
                    f"this snapshot's loss was computed by {src.get('name') or '?'}."
                    f"{src.get('method')}(model, inputs) (the Trainer's, {name or 'not importable'}"
                    "): pass snap.trace(trainer=...) (the Trainer class or a trainer), load with "
                    "trust_recipe=True to import the recorded class, or pass loss_fn=."
                )
            trainer = import_object(name)
        return stand_in(trainer) if isinstance(trainer, type) else trainer

    def __repr__(self) -> str:
        model = (
            type(self.model).__qualname__
            if self.model is not None
            else f"{self.model_class} (not built)"
        )
        name = self.path.name if self.path is not None else "<memory>"
        rewind = self.rewind_summary()
        return (
            f"Snapshot({name}: step {self.step}, {self.kind}: {shorten(self.message)}; "
            f"model {model}, "
            f"batch {describe(self.inputs)}, history {count_text(len(self.history), 'row')}"
            f"{'' if rewind is None else f', rewind window: {rewind}'})"
        )
