"""The hooks of one pass over a model: what :func:`nbdebug.trace` records.

A pass installs a forward pre-hook and a forward hook on every module (or on those that
``modules=`` names), a tensor hook on every module output that requires grad (and on
every module input that no module produced), and one hook on every parameter (of
those modules). Two modes:

* quick (``exact=False``): statistics rows stay on the device, one row per measured
  tensor in the pass's :class:`..engine.QuickEngine` (an event's vector is its
  measurement id); nothing is synchronised until the pass is over. A parameter's
  gradient is measured right after autograd accumulated it into ``.grad`` (a
  post-accumulate hook), and then dropped, so a pass never holds a second full set of
  gradients beside the user's (kept aside by the trace). Under (Distributed)DataParallel
  or FSDP2, whose own hooks read the accumulated gradients, a tensor hook marks the
  event's place and the gradients are measured after the backward, in one engine call.
  A gradient that autograd hands a tensor hook as ``None`` (an output of a multi-output
  node that nothing used) reached nothing: no event.
* exact (``exact=True``): run only when the quick pass saw a NaN/Inf. Element-wise
  statistics, the batch rows holding non-finite values, which inputs of each module call
  were finite, the data flow between calls, and a copy of the inputs of the calls still
  able to be the origin (for the op-level replay). Synchronises per event; it is the slow
  path of a failing step.

Held gradients (``RecordOptions.hold``, on as well once the forward calls a module with
gradients disabled, as a reentrant checkpoint's first run does): each reentrant segment runs
a backward of its own, so a parameter may be accumulated several times. Nothing is dropped
then; each parameter gets one event, measured from its whole ``.grad`` after the backward
(the exact pass places one that turned non-finite at that contribution). A pass that saw a
parameter accumulated twice without holding runs again (:meth:`Recorder.split_grads`).
"""

from __future__ import annotations

import fnmatch
import weakref
from collections.abc import Callable, Sequence
from typing import cast
from weakref import ref

import numpy as np
import torch

from .. import kernels
from ..batch import named_tensors
from ..engine import QuickEngine
from ..measure import exact_vector
from ..parallel import is_dtensor, unwrap_data_parallel
from ..stats import (
    IDX_NNAN,
    IDX_NUMEL,
    VECTOR_LEN,
    has_nan,
    has_nonfinite,
    nan_count,
    row_dim,
    row_flags,
    vector_is_finite,
)
from ..text import dtype_name, qualified_name
from ..vocab import EventKind
from .capture import CallCapture
from .columns import ROW_FIELDS, EventColumns
from .hooks import HookSet, hookable_named_modules
from .records import (
    Args,
    CallRecord,
    Kwargs,
    Owner,
    PostHook,
    PreHook,
    RecordOptions,
    Slot,
    Vector,
    host,
)

__all__ = ["Recorder", "select_modules"]


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_PARAM = ROW_FIELDS.index("param")  # a parameter event's qualified name, in its row


def _dtype(t: torch.Tensor) -> str:
    # runs once per event: the name of each dtype is built once
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        name = _DTYPE_NAMES[t.dtype] = dtype_name(t.dtype)
    return name


class Recorder:
    """Hooks and records of one pass. See the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        options: RecordOptions,
        *,
        batch_size: int | None,
        walk: list[tuple[str, torch.nn.Module]] | None = None,
    ) -> None:
        modules, keep, exact = options.modules, options.keep, options.exact
        self.model = model
        # ``model.named_modules()``, made once by the caller (PreservedState.modules)
        self.walk = list(model.named_modules()) if walk is None else walk
        self.modules = modules  # names of the modules to record (None: all)
        self.keep = keep  # names of the modules whose outputs are kept
        self.kept: dict[str, torch.Tensor] = {}
        # quick mode: (event index, parameter) whose gradient is measured after the backward
        self._pending_grads: list[tuple[int, torch.Tensor]] = []
        # held gradients (module docstring): parameters by first accumulation; (exact) the
        # events of those that turned non-finite
        self.hold = options.hold
        self._held: dict[int, torch.Tensor] = {}
        self._early: dict[int, int] = {}
        self.exact = exact
        self.kernel = kernels.compiled()  # quick mode: decided once per pass
        self.engine = QuickEngine(self.kernel)  # quick mode: every measured tensor's row
        self.capture = options.capture and exact
        self.batch_size = batch_size
        self.raw = EventColumns()  # the events, one row each (RawEvent objects on reading)
        self.calls: list[CallRecord] = []
        self.stack: list[int] = []
        self.names: dict[int, str] = {}
        self.types: dict[str, str] = {}
        self.param_names: dict[int, tuple[str, str, str]] = {}
        for name, m in self.walk:
            self.names.setdefault(id(m), name)
            self.types.setdefault(name, type(m).__name__)
            for pname, p in m._parameters.items():
                if p is not None and id(p) not in self.param_names:
                    self.param_names[id(p)] = (name, pname, qualified_name(name, pname))
        # (id, version) -> (weakref, owners): one grad hook per tensor version
        self._grad_hooked: dict[tuple[int, int], tuple[ref[torch.Tensor], list[Owner]]] = {}
        # exact mode: (id, version) -> (weakref, slot index)
        self._slot_of: dict[tuple[int, int], tuple[ref[torch.Tensor], int]] = {}
        self._measured: dict[tuple[int, int], tuple[ref[torch.Tensor], Vector, list[int]]] = {}
        self.slots: list[Slot] = []
        self.capture_closed = False  # exact mode: a call made NaN from NaN-free inputs
        self.recomputing = False  # set once the backward starts (activation checkpointing)
        self.first_bad_call: int = -1
        self._hooks = HookSet()  # replaced by install()'s: every hook this pass adds

    # ------------------------------------------------------------------ installing
    def install(self, hooks: HookSet, params: list[torch.nn.Parameter]) -> None:
        self._hooks = hooks  # the tensor hooks go there too (HookSet.tensor_hook)
        for _, m in hookable_named_modules(self.model, self.walk):
            name = self.names[id(m)]
            if self.modules is not None and name not in self.modules:
                continue
            # the call's inputs as its caller passed them, before the user's own pre-hooks
            # (a pre-hook that makes a NaN is part of this call); its output after the
            # user's forward hooks (what flows on)
            hooks.add(
                m.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True, prepend=True)
            )
            hooks.add(m.register_forward_hook(self._post_hook(name), with_kwargs=True))
        # quick mode: each parameter's gradient is measured as soon as it is accumulated,
        # then dropped (the trace keeps the user's own ``.grad`` aside, so holding every new
        # gradient to the end would need a second gradient-sized block of memory: 420 MB
        # for a 105M-parameter model, page-faulted in on every trace); not under
        # (Distributed)DataParallel or FSDP2 (DTensor parameters), whose own hooks read the
        # accumulated gradients
        free = (
            not self.exact
            and unwrap_data_parallel(self.model) is self.model
            and not any(is_dtensor(p) for p in params)
        )
        for p in params:
            if p.requires_grad and id(p) in self.param_names:
                if self.modules is not None and self.param_names[id(p)][0] not in self.modules:
                    continue
                if free:
                    hooks.add(p.register_post_accumulate_grad_hook(self._accumulated(p)))
                else:
                    hooks.add(p.register_hook(self._param_hook(*self.param_names[id(p)], p)))

    # ------------------------------------------------------------------ statistics
    def record(
        self,
        kind: EventKind,
        module: str,
        name: str,
        t: torch.Tensor,
        call: int,
        depth: int,
        measured: tuple[Vector, list[int]] | None = None,
        slot: int = -1,
    ) -> int:
        """One event of a module call (``call >= 0``) or of the batch or the loss."""
        vector, samples = self.measure(t) if measured is None else measured
        # one tuple per event, in ROW_FIELDS order (no object on the hooks' path)
        return self.raw.add(
            (
                kind,
                module,
                name,
                tuple(t.shape),
                _dtype(t),
                call,
                depth,
                self.types.get(module, "") if call >= 0 else "",
                vector,
                samples,
                None,
                slot,
            )
        )

    def record_param(
        self, module: str, short: str, qual: str, t: torch.Tensor, vector: Vector | None = None
    ) -> int:
        """One parameter gradient's event (``vector``: measured already)."""
        if vector is None:
            # a parameter's tensor has no batch dimension (a weight dimension equal to the
            # batch size is not one): no rows
            vector, _ = self.measure(t, rows=False)
        return self.raw.add(
            (
                EventKind.PARAM_GRAD,
                module,
                short,
                tuple(t.shape),
                _dtype(t),
                -1,
                _depth(module),
                self.types.get(module, ""),
                vector,
                [],
                qual,
                -1,
            )
        )

    def measure(self, t: torch.Tensor, *, rows: bool = True) -> tuple[Vector, list[int]]:
        """The statistics of ``t``, and in the exact pass the batch rows holding its
        non-finite values (``rows=False``: none, for a tensor without a batch dimension)."""
        if not self.exact:
            return self.engine.measure(t), []
        # no autograd state from the hooks: under activation checkpointing a tensor saved
        # here in the first run but not in the recomputation is a CheckpointError
        with torch.no_grad():
            v = exact_vector(t).cpu().numpy()
            samples: list[int] = []
            if rows and not vector_is_finite(v):
                d = row_dim(t.shape, self.batch_size)
                if d is not None and v[IDX_NNAN] == v[IDX_NUMEL]:
                    samples = list(range(t.shape[d]))  # all NaN: every row
                elif d is not None and t.layout == torch.strided:
                    samples = torch.nonzero(row_flags(t, d)).flatten().tolist()
        return v, samples

    # ------------------------------------------------------------------ slots (exact)
    def _slot_for(self, t: torch.Tensor) -> int:
        hit = self._slot_of.get((id(t), t._version))
        if hit is not None and hit[0]() is t:
            return hit[1]
        return -1

    def new_slot(self, t: torch.Tensor, producer: int, finite: bool, has_nan: bool) -> int:
        self.slots.append(Slot(producer, finite, has_nan))
        self._slot_of[(id(t), t._version)] = (weakref.ref(t), len(self.slots) - 1)
        return len(self.slots) - 1

    # ------------------------------------------------------------------ inputs
    def record_batch(self, inputs: object, target: object = None) -> None:
        """The batch's tensors (kind ``"input"``), then the target's (kind ``"target"``:
        a NaN label is a bad batch too, not something the loss produced)."""
        prefix = "x" if isinstance(inputs, torch.Tensor) else "inputs"
        tensors = [(EventKind.INPUT, name, t) for name, t in named_tensors(inputs, prefix)]
        tensors += [(EventKind.TARGET, name, t) for name, t in named_tensors(target, "target")]
        for kind, name, t in tensors:
            measured = self.measure(t)
            slot = -1
            if self.exact:
                v = host(measured[0])
                slot = self.new_slot(t, -1, vector_is_finite(v), nan_count(v) > 0)
            self.record(kind, "", name, t, -1, 0, measured, slot)

    def record_loss(self, loss: torch.Tensor) -> int:
        return self.record(EventKind.LOSS, "", "loss", loss, -1, 0)

    # ------------------------------------------------------------------ forward hooks
    def _pre_hook(self, name: str) -> PreHook:
        def pre(module: torch.nn.Module, args: Args, kwargs: Kwargs) -> None:
            if not self.hold and not self.recomputing and not torch.is_grad_enabled():
                # a forward with gradients disabled: perhaps a reentrant checkpoint's first
                # run, whose backward accumulates the parameters again (module docstring)
                self.hold = True
            parent = self.stack[-1] if self.stack else -1
            rec = CallRecord(len(self.calls), name, type(module).__name__, len(self.stack), parent)
            self.calls.append(rec)
            self.stack.append(rec.call)
            if self.exact:
                with torch.no_grad():  # see measure(): the hooks save nothing for autograd
                    self._inputs_exact(rec, args, kwargs)
            for tname, t in named_tensors((args, kwargs), "input"):
                if t.requires_grad and t.is_floating_point():
                    self._hook_grad(t, rec.call, EventKind.GRAD_INPUT, _input_name(tname))
            return None

        return pre

    def _inputs_exact(self, rec: CallRecord, args: Args, kwargs: Kwargs) -> None:
        for _, t in named_tensors((args, kwargs), "input"):
            s = self._slot_for(t)
            if s < 0:
                fin = not has_nonfinite(t)
                s = self.new_slot(t, rec.parent, fin, not fin and has_nan(t))
            slot = self.slots[s]
            slot.consumers.append(rec.call)
            rec.input_slots.append(s)
            if not slot.finite:
                rec.inputs_finite = False
                rec.inputs_has_nan = rec.inputs_has_nan or slot.has_nan
        if (
            self.capture
            and not rec.inputs_has_nan
            and not self.capture_closed
            and not self.recomputing
        ):
            # before the call: a call may extend its arguments in place (a cache)
            rec.capture = CallCapture.take(args, kwargs)

    def _post_hook(self, name: str) -> PostHook:
        def post(module: torch.nn.Module, args: Args, kwargs: Kwargs, output: object) -> None:
            call = self.stack.pop()
            rec = self.calls[call]
            rec.done = True
            if self.recomputing:
                # activation checkpointing re-runs the forward inside the backward: no
                # forward events then, but the recomputed tensors carry the gradients
                for oname, t in named_tensors(output, "output"):
                    if t.requires_grad:
                        self._hook_grad(t, call, EventKind.GRAD_OUTPUT, oname)
                return None
            any_bad = False
            for oname, t in named_tensors(output, "output"):
                if name in self.keep:
                    self.keep_output(name, oname, t)
                key = (id(t), t._version)
                hit = self._measured.get(key)
                if hit is not None and hit[0]() is t:  # a container returning a child's output
                    vector, samples = hit[1], hit[2]
                else:
                    vector, samples = self.measure(t)
                    self._measured[key] = (weakref.ref(t), vector, samples)
                s = -1
                if self.exact:
                    fin = vector_is_finite(host(vector))
                    any_bad = any_bad or not fin
                    s = self._slot_for(t)
                    if s >= 0:
                        self.slots[s].producer = call
                    else:
                        s = self.new_slot(t, call, fin, nan_count(host(vector)) > 0)
                    self.slots[s].from_output = True
                    rec.output_slots.append(s)
                i = self.record(
                    EventKind.OUTPUT, name, oname, t, call, rec.depth, (vector, samples), s
                )
                rec.output_events.append(i)
                if t.requires_grad:
                    self._hook_grad(t, call, EventKind.GRAD_OUTPUT, oname)
            if self.exact:
                self._settle_capture(
                    rec, any_bad, any(self.slots[x].has_nan for x in rec.output_slots)
                )
            return None

        return post

    def _settle_capture(self, rec: CallRecord, output_bad: bool, output_nan: bool) -> None:
        """Keep the input copies of the calls that turned NaN-free inputs into a
        non-finite output (the forward origin candidates, masks still to be told apart);
        stop copying once a call made NaN from NaN-free inputs."""
        if output_bad and self.first_bad_call < 0:
            self.first_bad_call = rec.call
        if not output_bad or rec.inputs_has_nan:
            rec.capture = None
        elif output_nan:
            self.capture_closed = True

    # ------------------------------------------------------------------ backward hooks
    def _hook_grad(self, t: torch.Tensor, call: int, kind: EventKind, name: str) -> None:
        """One tensor hook per tensor version; each module that produced (``grad_output``)
        or consumed (``grad_input``) the tensor owns an event when its gradient arrives."""
        key = (id(t), t._version)
        hit = self._grad_hooked.get(key)
        if hit is not None and hit[0]() is t:
            if all((o[0], o[1]) != (call, kind) for o in hit[1]):
                hit[1].append((call, kind, name))
            return
        owners: list[Owner] = [(call, kind, name)]
        slot = self._slot_for(t) if self.exact else -1
        self._grad_hooked[key] = (weakref.ref(t), owners)
        self._hooks.tensor_hook(t, self._grad_hook(owners, slot))

    def _grad_hook(self, owners: list[Owner], slot: int) -> Callable[[torch.Tensor | None], None]:
        def hook(grad: torch.Tensor | None) -> None:
            if grad is None:  # no gradient reached this tensor (an unused output)
                return None
            vector, samples = self.measure(grad)
            # the gradient leaves its consumers (grad_input), then reaches its producers
            # from the outermost container inwards (grad_output)
            ordered = [o for o in owners if o[1] == EventKind.GRAD_INPUT]
            ordered += [o for o in reversed(owners) if o[1] == EventKind.GRAD_OUTPUT]
            measured = (vector, samples)
            for call, kind, name in ordered:
                rec = self.calls[call]
                i = self.record(kind, rec.module, name, grad, call, rec.depth, measured, slot)
                if slot >= 0 and self.slots[slot].grad_event < 0:
                    self.slots[slot].grad_event = i
            return None

        return hook

    def _param_hook(
        self, module: str, short: str, qual: str, param: torch.Tensor
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            if self.hold:
                self._hold(param, grad)
                return None
            if self.exact:
                self.record_param(module, short, qual, grad)
                return None
            # quick mode under (Distributed)DataParallel or FSDP2: only the event's place
            # here; its statistics are taken from ``.grad`` once the backward is over (off
            # its critical path, and no reference to ``grad`` held, which would make
            # autograd copy it into ``.grad``)
            i = self.record_param(module, short, qual, grad, -1)
            self._pending_grads.append((i, param))
            return None

        return hook

    def _accumulated(self, param: torch.Tensor) -> Callable[[torch.Tensor], None]:
        """Quick mode, the hook autograd calls right after it wrote ``param.grad``: the
        event, measured from ``.grad``, which is then dropped (``.grad`` was ``None``
        before the pass: what was accumulated is this contribution, as the exact pass
        records it)."""
        module, short, qual = self.param_names[id(param)]

        def hook(p: torch.Tensor) -> None:
            if self.hold:
                self._held.setdefault(id(p), p)
                return None
            g = p.grad
            if g is None:  # pragma: no cover - autograd calls the hook after writing it
                return None
            vector = self.engine.measure(g)
            self.record_param(module, short, qual, g, vector)
            p.grad = None
            return None

        return hook

    def _hold(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        """A parameter's gradient accumulated while gradients are held: noted; in the exact
        pass, the parameter's event is placed at the first non-finite contribution."""
        self._held.setdefault(id(param), param)
        if self.exact and id(param) not in self._early:
            with torch.no_grad():
                bad = has_nonfinite(grad)
            if bad:
                self._early[id(param)] = self.record_param(*self.param_names[id(param)], grad)

    def finish_backward(self) -> None:
        """After the backward: the events of the held parameter gradients (module
        docstring), each measured from the whole ``.grad``."""
        held, self._held = self._held, {}
        grads = [(p, g) for p in held.values() if (g := p.grad) is not None]
        gs = [g for _, g in grads]
        ids: list[Vector] = (
            [self.measure(g, rows=False)[0] for g in gs]
            if self.exact
            else [*self.engine.measure_many([g for g in gs])]
        )
        for (p, g), v in zip(grads, ids):
            i = self._early.get(id(p), -1)
            if i >= 0:
                self.raw.set_vector(i, v)
            else:
                self.record_param(*self.param_names[id(p)], g, v)

    def split_grads(self) -> bool:
        """Whether a parameter's gradient was accumulated more than once in this pass
        while it was not held: its event is one contribution (the quick pass dropped the
        others), so the pass must be run again holding gradients."""
        if self.hold:
            return False
        quals = [row[_PARAM] for row in self.raw.rows if row[0] is EventKind.PARAM_GRAD]
        return len(set(quals)) < len(quals)

    def measure_param_grads(self) -> None:
        """Quick mode: measure the parameter gradients whose hooks fired and that are not
        measured yet, from their ``.grad`` (the backward is over): one call of the engine
        for all of them."""
        ids = self.engine.measure_many([p.grad for _, p in self._pending_grads])
        for (i, _), v in zip(self._pending_grads, ids):
            self.raw.set_vector(i, v)
        self._pending_grads = []

    def keep_output(self, module: str, name: str, t: torch.Tensor) -> None:
        """A detached copy of a module output named by ``keep=`` (later in-place changes
        do not reach it)."""
        key = module if name in ("output", "output[0]") else f"{module}:{name}"
        if key in self.kept:  # the module's next call: "block#2", "block#3", ...
            n = 2
            while f"{key}#{n}" in self.kept:
                n += 1
            key = f"{key}#{n}"
        self.kept[key] = t.detach().clone()

    # ------------------------------------------------------------------ results
    def host_vectors(self) -> np.ndarray:
        """All statistics vectors on the host, one row per event: one transfer per device."""
        if self.exact:
            if not self.raw:
                return np.zeros((0, VECTOR_LEN))
            return np.vstack(self.raw.vectors())
        self.measure_param_grads()
        # events sharing one measurement share its row
        ids = cast("list[int]", self.raw.vectors())  # quick pass: measurement ids
        out: np.ndarray = self.engine.host_rows()[ids]
        out[:, IDX_NUMEL] = [_numel(shape) for shape in self.raw.shapes()]
        return out


def select_modules(
    model: torch.nn.Module, patterns: str | Sequence[str] | None, option: str
) -> set[str] | None:
    """Names of the modules of ``model`` matching any of the ``fnmatch`` ``patterns``
    (``"transformer.h.3.*"``; a pattern ending in ``.*`` also matches the module it names,
    and ``""`` the model itself). None when ``patterns`` is None; a ValueError naming
    ``option`` when a pattern matches nothing."""
    if patterns is None:
        return None
    if isinstance(patterns, str):
        pats = [patterns]
    elif isinstance(patterns, (list, tuple, set, frozenset)):
        pats = list(patterns)
    else:
        raise TypeError(
            f"{option}= expects module name patterns (a str or a list of str), got "
            f"{type(patterns).__name__} {patterns!r}."
        )
    if not pats:
        raise ValueError(
            f"{option}= got an empty {type(patterns).__name__}: give at least one module name "
            f"pattern (e.g. {option}='encoder.*'), or leave {option}=None."
        )
    bad = [p for p in pats if not isinstance(p, str)]
    if bad:
        raise TypeError(
            f"{option}= expects module name patterns (str), got {type(bad[0]).__name__} "
            f"{bad[0]!r} among them."
        )
    names = [n for n, _ in hookable_named_modules(model)]
    chosen: set[str] = set()
    for pat in pats:
        hit = [
            n
            for n in names
            if fnmatch.fnmatchcase(n, pat) or (pat.endswith(".*") and n == pat[:-2])
        ]
        if not hit:
            sample = ", ".join(repr(n) for n in names[1:6]) or "''"
            raise ValueError(
                f"{option}={pat!r} matches no module of {type(model).__name__}: its "
                f"{len(names)} module names look like {sample} (fnmatch patterns such as "
                f"{names[-1]!r} or '{names[-1].rpartition('.')[0] or names[-1]}.*')"
            )
        chosen.update(hit)
    return chosen


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _depth(module: str) -> int:
    return module.count(".") + 1 if module else 0


def _input_name(tname: str) -> str:
    # "input[0][0]" -> "input[0]", "input[1]['mask']" -> "input['mask']"
    if tname.startswith("input[0]"):
        return "input" + tname[len("input[0]") :]
    if tname.startswith("input[1]"):
        return "input" + tname[len("input[1]") :]
    return tname
