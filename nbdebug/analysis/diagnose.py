"""``nbdebug.diagnose()``: replay the failing step with candidate fixes and rank the causes
by what removes the non-finite value.

The algorithm:

1. resolve the source (a :class:`~nbdebug.Snapshot`, a snapshot path, or a model and a
   batch) into a :class:`Workbench`: copies of the model, the optimizer and the scaler
   holding the step's state, the batch, the loss and the step's RNG;
2. trace the step (:func:`nbdebug.trace`) to find where the NaN/Inf is produced;
3. choose the fix menu from the origin and the findings (:func:`~nbdebug.analysis.fixes.menu`)
   plus the user's fixes;
4. replay the whole step (forward, loss, backward, clipping, ``optimizer.step()``) once
   plainly and once per fix, each on freshly reset copies;
5. rank: a fix counts only when the loss, every gradient and the weights after the update
   are finite; among those the most local change first, then the smallest deviation of
   loss and gradient norm from the recent healthy history.
"""

from __future__ import annotations

import copy
import math
import os
import statistics
import time
from collections.abc import Sequence
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..core.batch import (
    batch_size,
    call_model,
    check_flag,
    check_inputs,
    check_model,
    compute_loss,
    named_tensors,
)
from ..core.origin_ops import composite_body
from ..core.result import Trace, TraceError
from ..core.snapshot import (
    Snapshot,
    SnapshotError,
    list_snapshots,
    load_snapshot,
    replay_contexts,
)
from ..core.snapshot_data import to_device
from ..core.state import PreservedState, RngState, unique_parameters
from ..core.text import cost_text, first_line, fmt_num, rows_text
from ..core.trace import trace_step
from .fixes import (
    KINDS,
    EpsilonFix,
    Fix,
    MenuContext,
    NotReproducible,
    Replay,
    WeightsCorrupted,
    caller_line,
    func_family,
    menu,
    underflows,
)

__all__ = ["Cause", "Diagnosis", "FixResult", "StepOutcome", "Workbench", "diagnose"]


# ---------------------------------------------------------------------- results
@dataclass
class StepOutcome:
    """What one replay of the step measured.

    ``forward``, ``loss_finite``, ``backward``, ``update``: whether the model output, the
    loss, every parameter gradient and the weights after ``optimizer.step()`` were finite
    (``update`` is ``None`` without an optimizer). ``grad_norm`` is the total gradient norm
    the update used (after unscaling and clipping).
    """

    forward: bool = False
    loss_finite: bool = False
    backward: bool = False
    update: bool | None = None
    loss: float | None = None
    grad_norm: float | None = None
    seconds: float = 0.0
    error: str | None = None
    skipped: str | None = None
    first_loss: float | None = None  # with several steps: the first one's loss
    steps: int = 1

    @property
    def finite(self) -> bool:
        return (
            self.error is None
            and self.skipped is None
            and self.loss_finite
            and self.backward
            and self.update is not False
        )


@dataclass
class FixResult:
    """One row of a :class:`Diagnosis`: a fix and what its replay measured."""

    fix: Fix
    outcome: StepOutcome
    rank: int = 0
    applies: bool = True
    note: str = ""
    deviation: float | None = None
    cost: float | None = None  # seconds / the plain replay's seconds

    @property
    def kind(self) -> str:
        return str(getattr(self.fix, "kind", "custom"))

    @property
    def module(self) -> str | None:
        return getattr(self.fix, "module", None)

    @property
    def rows(self) -> list[int]:
        return list(getattr(self.fix, "rows", []) or [])

    @property
    def finite(self) -> bool:
        return self.applies and self.outcome.finite

    def describe(self) -> str:
        return _safe(lambda: str(self.fix.describe()), type(self.fix).__name__)

    def snippet(self) -> str:
        fn = getattr(self.fix, "snippet", None)
        return _safe(lambda: str(fn()), "") if callable(fn) else ""


def _safe(f: Any, default: str) -> str:
    try:
        return f()
    except Exception as e:  # a user's describe() that raises: say so, keep going
        return f"{default} ({type(e).__name__}: {e})"


@dataclass
class Cause:
    """The diagnosed cause: the top-ranked row, in one sentence."""

    kind: str
    module: str | None
    rows: list[int]
    finite: bool
    statement: str
    fix: Fix | None = None
    op: str | None = None
    source: str | None = None

    def __str__(self) -> str:
        return self.statement


@dataclass
class Diagnosis:
    """The outcome of :func:`nbdebug.diagnose`.

    Attributes
    ----------
    cause : Cause
        The top row: ``kind``, ``module``, ``rows``, ``finite`` and a one-sentence
        ``statement``.
    results : list of FixResult
        Ranked rows (``rank`` 1 first); rows that did not make the step finite come after
        those that did.
    trace : Trace or None
        The trace of the failing step as it was (where the NaN is produced).
    origin : str
        That origin in words.
    plain : StepOutcome
        The plain replay of the step.
    reference : dict
        The recent healthy ``loss`` and ``grad_norm`` (medians of the history) or ``None``.
    notes : list of str
    """

    cause: Cause
    results: list[FixResult]
    trace: Trace | None
    origin: str
    plain: StepOutcome
    reference: dict[str, float | None] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    step: int | None = None
    workbench: Workbench | None = field(default=None, repr=False)

    def to_frame(self) -> Any:
        """One row per fix, ranked: ``rank``, ``kind``, ``module``, ``rows``, ``change``,
        ``finite``, ``forward``, ``loss_ok``, ``backward``, ``update``, ``loss``,
        ``grad_norm``, ``loss_ref``, ``grad_norm_ref``, ``seconds``, ``cost`` (x the plain
        replay), ``snippet``, ``note``."""
        import pandas as pd

        recs = []
        for r in self.results:
            o = r.outcome
            recs.append(
                {
                    "rank": r.rank,
                    "kind": r.kind,
                    "module": _module_label(r.module),
                    "rows": r.rows,
                    "change": r.describe(),
                    "finite": r.finite,
                    "forward": o.forward if r.applies and o.skipped is None else None,
                    "loss_ok": o.loss_finite if r.applies and o.skipped is None else None,
                    "backward": o.backward if r.applies and o.skipped is None else None,
                    "update": o.update if r.applies and o.skipped is None else None,
                    "loss": o.loss,
                    "grad_norm": o.grad_norm,
                    "loss_ref": self.reference.get("loss"),
                    "grad_norm_ref": self.reference.get("grad_norm"),
                    "seconds": o.seconds,
                    "cost": r.cost,
                    "snippet": r.snippet(),
                    "note": r.note or o.error or o.skipped or "",
                }
            )
        cols = [
            "rank",
            "kind",
            "module",
            "rows",
            "change",
            "finite",
            "forward",
            "loss_ok",
            "backward",
            "update",
            "loss",
            "grad_norm",
            "loss_ref",
            "grad_norm_ref",
            "seconds",
            "cost",
            "snippet",
            "note",
        ]
        return pd.DataFrame.from_records(recs, columns=cols)

    def table(self) -> str:
        """The ranked table as plain text (what the command line prints)."""
        df = self.to_frame()
        if df.empty:
            return "(no fixes)"
        show = df[
            ["rank", "kind", "module", "rows", "finite", "loss", "grad_norm", "cost", "change"]
        ]
        # formatted here, not by to_string's formatters (pandas skips them for NaN): a fix
        # whose replay never ran (no cost) reads "-", a replay's NaN loss reads "nan"
        ran = show["cost"].notna().tolist()
        shown = show.assign(
            rows=[",".join(map(str, v)) if v else "-" for v in show["rows"]],
            loss=[fmt_num(v) if r else "-" for v, r in zip(show["loss"], ran)],
            grad_norm=[fmt_num(v) if r else "-" for v, r in zip(show["grad_norm"], ran)],
            cost=[cost_text(v) for v in show["cost"]],
        )
        return shown.to_string(index=False, max_colwidth=70)

    def fix(self, which: int | str) -> Fix:
        """The fix of rank ``which`` (1 = top) or the first of kind ``which``."""
        for r in self.results:
            if (isinstance(which, int) and r.rank == which) or r.kind == which:
                return r.fix
        raise KeyError(f"no fix of rank or kind {which!r} in this diagnosis.")

    def trace_with(self, which: int | str | Fix) -> Trace:
        """Trace the failing step with one fix applied (rank, kind or the fix itself), on
        the diagnosis' own copies: what the debugger's *try* button shows."""
        if self.workbench is None:
            raise RuntimeError("this diagnosis keeps no copies of the step to replay.")
        fix = which if not isinstance(which, (int, str)) else self.fix(which)
        return self.workbench.trace(fix)

    def __repr__(self) -> str:
        head = f"Diagnosis(step {self.step}): " if self.step is not None else "Diagnosis: "
        lines = [head + self.cause.statement, f"origin: {self.origin}"]
        ref = self.reference
        if ref.get("loss") is not None or ref.get("grad_norm") is not None:
            lines.append(
                f"healthy history: loss {fmt_num(ref.get('loss'))}, "
                f"grad norm {fmt_num(ref.get('grad_norm'))}"
            )
        lines.append(self.table())
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _module_label(module: str | None) -> str:
    if module is None:
        return "-"
    return module or "<model>"


# ---------------------------------------------------------------------- the workbench
class Workbench:
    """Copies of one training step, reset before each replay.

    The model and optimizer are deep-copied together (so the copy's optimizer holds the
    copy's parameters); the copies' weights, buffers, gradients, train flags and the
    optimizer state are put back before every replay, and the RNG set to the step's.
    Nothing here holds a reference the user's objects could be written through.

    ``autocast`` is the step's recorded autocast state (a snapshot's ``autocast`` field):
    every replay's forward and loss (and every trace of the step) run under it, on the
    model's device type, as :meth:`nbdebug.Snapshot.trace` replays it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        inputs: Any,
        target: Any,
        loss_fn: Any,
        *,
        optimizer: Any = None,
        scaler_state: dict[str, Any] | None = None,
        rng: RngState | None = None,
        steps: int = 1,
        autocast: dict[str, Any] | None = None,
    ):
        try:
            self.model, self.optimizer = copy.deepcopy((model, optimizer))
        except Exception as e:
            raise TypeError(
                f"cannot copy the {type(model).__qualname__} (and its optimizer) for the replays: "
                f"{type(e).__name__}: {e}."
            ) from e
        self.inputs = _detached(inputs)
        self.target = _detached(target)
        self.loss_fn = loss_fn
        self.steps = steps
        self.batch_size = batch_size(inputs)
        self.scaler_state = scaler_state
        self.rng = rng if rng is not None else RngState.capture()
        self.params = unique_parameters(self.model)
        self.device = next((p.device for p in self.params), torch.device("cpu"))
        self.autocast = autocast
        # a dtype this machine lacks: one SnapshotError, now
        self.autocast_context, self.backward_context = replay_contexts(
            autocast, self.device, instead="call nbdebug.diagnose(..., autocast=False)"
        )
        self._saved_params = [p.detach().clone() for p in self.params]
        self._opt_saved = _OptimizerState.capture(self.optimizer)
        for p in self.params:
            p.grad = None
        self.rng.restore()
        self._state = PreservedState.capture(self.model)

    def reset(self) -> None:
        with torch.no_grad():
            for p, saved in zip(self.params, self._saved_params):
                if p.shape != saved.shape or p.dtype != saved.dtype:
                    p.data = saved.clone()
                else:
                    p.copy_(saved)
        self._state.restore()  # buffers, RNG, grads (None), requires_grad, train flags
        if self._opt_saved is not None:
            self._opt_saved.restore()

    def replay(self) -> Replay:
        return Replay(
            model=self.model,
            optimizer=self.optimizer,
            inputs=self.inputs,
            target=self.target,
            loss_fn=self.loss_fn,
            scaler=self._scaler(),
            batch_size=self.batch_size,
        )

    def contexts(self, r: Replay) -> tuple[Any, Any]:
        """The forward's and the backward's context factories for a replay: the step's
        autocast state, none when a fix turned it off (``r.autocast``)."""
        if not r.autocast:
            return nullcontext, nullcontext
        return self.autocast_context, self.backward_context

    def _scaler(self) -> Any:
        if self.scaler_state is None:
            return None
        dev = next((p.device.type for p in self.params), "cpu")
        s = torch.amp.GradScaler(dev)
        s.load_state_dict(copy.deepcopy(self.scaler_state))
        return s

    def run(self, fix: Any = None) -> StepOutcome:
        """Reset the copies and replay the whole step with ``fix`` applied."""
        t0 = time.perf_counter()
        out = StepOutcome()
        try:
            self.reset()
            r = self.replay()
            with ExitStack() as stack:
                if fix is not None:
                    stack.enter_context(fix.apply(r))
                if r.lr_factor != 1.0 and r.optimizer is not None:
                    _scale_lr(r.optimizer, r.lr_factor)
                amp = self.contexts(r)
                for _ in range(self.steps):
                    step_out = _step(r, *amp)
                    if out.loss is None:
                        out = step_out
                    else:  # later steps: all must stay finite; loss and norm are the last's
                        out.forward &= step_out.forward
                        out.loss_finite &= step_out.loss_finite
                        out.backward &= step_out.backward
                        if out.update is not None:
                            out.update = bool(out.update and step_out.update)
                        if out.first_loss is None:
                            out.first_loss = out.loss
                        out.loss, out.grad_norm = step_out.loss, step_out.grad_norm
                        out.steps += 1
        except Exception as e:
            out.error = first_line(e, 300)
        out.seconds = time.perf_counter() - t0
        return out

    def trace(self, fix: Any = None) -> Trace:
        """:func:`nbdebug.trace` of the step on the copies, with ``fix`` applied."""
        self.reset()
        r = self.replay()
        try:
            with fix.apply(r) if fix is not None else nullcontext():
                forward, backward = self.contexts(r)
                return trace_step(
                    r.model, r.inputs, r.target, r.loss_fn, forward=forward, backward=backward
                )
        finally:
            self.reset()

    def probe(
        self, module: str | None, families: Sequence[str]
    ) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
        """Run the forward (and the loss) once with ``module`` (``None``: the loss) watched:
        (family, ``"file.py:line"``, filename) of the fixable operations whose output holds
        a kind of non-finite value that their inputs did not hold, and the filename of
        every ``"file.py:line"`` that called a fixable operation (a backward origin's line
        made finite values in the forward: its snippet needs the file all the same)."""
        self.reset()
        r = self.replay()
        found: list[tuple[str, str, str]] = []
        sites: dict[str, str] = {}
        mode_cls = _ProbeMode
        try:
            with torch.no_grad(), self.autocast_context():
                if module is None:
                    with r.around_loss(lambda: mode_cls(found, families, sites)):
                        compute_loss(call_model(r.model, r.inputs), r.target, r.loss_fn)
                else:
                    with r.around_forward(module, lambda: mode_cls(found, families, sites)):
                        compute_loss(call_model(r.model, r.inputs), r.target, r.loss_fn)
        except Exception:
            pass  # a probe is a hint; the replays decide
        finally:
            self.reset()
        return found, sites


_PLAIN = (int, float, bool, str, type(None), tuple)


@dataclass
class _OptimizerState:
    """The optimizer's state and hyper-parameters, put back in place (no new tensors
    unless a shape or dtype changed) before each replay."""

    optimizer: Any
    state: list[tuple[Any, dict[str, Any]]]
    groups: list[dict[str, Any]]

    @classmethod
    def capture(cls, opt: Any) -> _OptimizerState | None:
        if opt is None:
            return None
        state = [(p, {k: _keep(v) for k, v in st.items()}) for p, st in opt.state.items()]
        groups = [{k: _keep(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        return cls(opt, state, groups)

    def restore(self) -> None:
        opt = self.optimizer
        saved = dict(self.state)
        for p in [p for p in opt.state if p not in saved]:
            del opt.state[p]
        with torch.no_grad():
            for p, st0 in self.state:
                st = opt.state[p]
                for k in [k for k in st if k not in st0]:
                    del st[k]
                for k, v in st0.items():
                    st[k] = _put(st.get(k), v)
            for g, g0 in zip(opt.param_groups, self.groups):
                for k, v in g0.items():
                    g[k] = _put(g.get(k), v)


def _keep(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    return v if isinstance(v, _PLAIN) else copy.deepcopy(v)


def _put(cur: Any, saved: Any) -> Any:
    if isinstance(saved, torch.Tensor):
        if (
            isinstance(cur, torch.Tensor)
            and cur.shape == saved.shape
            and cur.dtype == saved.dtype
            and cur.device == saved.device
        ):
            return cur.copy_(saved)
        return saved.clone()
    return saved if isinstance(saved, _PLAIN) else copy.deepcopy(saved)


class _ProbeMode(torch.overrides.TorchFunctionMode):
    def __init__(
        self, found: list[tuple[str, str, str]], families: Sequence[str], sites: dict[str, str]
    ):
        super().__init__()
        self.found = found
        self.families = set(families)
        self.sites = sites

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        fam = func_family(func)
        body = composite_body(func) if fam is None or fam not in self.families else None
        if body is not None:  # F.normalize, attention: the ops inside them, as the trace
            with self:
                return body(*args, **kwargs)
        out = func(*args, **kwargs)
        if fam is None or fam not in self.families:
            return out
        outs = [t for _, t in named_tensors(out) if t.is_floating_point()]
        if not outs:
            return out
        where = caller_line()
        if where is None:
            return out
        src = f"{os.path.basename(where[0])}:{where[1]}"
        self.sites.setdefault(src, where[0])
        ins = [t for _, t in named_tensors((args, kwargs)) if t.is_floating_point()]
        made = _kinds(outs) - _kinds(ins)
        if fam == "exp" and underflows(outs[0]):
            made.add("underflow")
        if made and (fam, src, where[0]) not in self.found:
            self.found.append((fam, src, where[0]))
        return out


def _kinds(ts: list[torch.Tensor]) -> set[str]:
    k: set[str] = set()
    for t in ts:
        if t.numel() == 0:
            continue
        if bool(torch.isnan(t).any()):
            k.add("nan")
        if bool(torch.isinf(t).any()):
            k.add("inf")
    return k


def _detached(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        items = [_detached(v) for v in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _total_norm(tensors: list[torch.Tensor]) -> float:
    """The L2 norm of many tensors, one host read; NaN when one holds a NaN, inf when one
    holds an Inf (a float32 sum that merely overflows is measured again in float64)."""
    if not tensors:
        return 0.0
    ts = [t.detach() for t in tensors]
    norms: Sequence[torch.Tensor]
    try:
        norms = torch._foreach_norm([t.float() if t.element_size() < 4 else t for t in ts])
    except (RuntimeError, TypeError):
        norms = [torch.linalg.vector_norm(t.float()) for t in ts]
    total = float(torch.linalg.vector_norm(torch.stack([n.double() for n in norms])))
    if math.isinf(total):
        per = [torch.linalg.vector_norm(t, dtype=torch.float64) for t in ts]
        total = float(torch.linalg.vector_norm(torch.stack(per)))
    return total


def _scale_lr(opt: Any, factor: float) -> None:
    for g in opt.param_groups:
        lr = g.get("lr")
        if isinstance(lr, torch.Tensor):
            lr.mul_(factor)
        elif isinstance(lr, (int, float)):
            g["lr"] = lr * factor


def _step(r: Replay, autocast: Any = nullcontext, backward: Any = nullcontext) -> StepOutcome:
    """One training step on the replay's copies; the forward and the loss run inside
    ``autocast()`` (the step's autocast state), the backward inside ``backward()`` (the
    same state when the step ran its backward in the block, else none), the update
    after it."""
    out = StepOutcome()
    params = unique_parameters(r.model)
    for p in params:
        p.grad = None
    with torch.enable_grad():
        with autocast():
            output = call_model(r.model, r.inputs)
            out.forward = all(
                bool(torch.isfinite(t).all())
                for _, t in named_tensors(output)
                if t.is_floating_point() and t.numel()
            )
            loss = compute_loss(output, r.target, r.loss_fn)
        out.loss = float(loss.detach().float())
        out.loss_finite = math.isfinite(out.loss)
        if loss.requires_grad:
            with backward():
                (r.scaler.scale(loss) if r.scaler is not None else loss).backward()
    opt = r.optimizer
    if r.scaler is not None and opt is not None:
        r.scaler.unscale_(opt)
    grads = [p.grad for p in params if p.grad is not None]
    gnorm = _total_norm(grads)
    out.backward = math.isfinite(gnorm)
    if r.clip_norm is not None and out.backward:
        torch.nn.utils.clip_grad_norm_(params, r.clip_norm)
        gnorm = min(gnorm, r.clip_norm)
    out.grad_norm = gnorm
    if opt is None:
        return out
    if r.scaler is not None:
        r.scaler.step(opt)
        r.scaler.update()
    else:
        opt.step()
    out.update = math.isfinite(_total_norm([p for p in params]))
    return out


# ---------------------------------------------------------------------- the source
@dataclass
class _Source:
    model: torch.nn.Module
    inputs: Any
    target: Any
    loss_fn: Any
    optimizer: Any
    scaler_state: dict[str, Any] | None
    rng: RngState
    history: list[dict[str, Any]]
    step: int | None
    recorded_failure: str | None  # the snapshot's reason, when it recorded one
    notes: list[str]
    snapshot: Snapshot | None = None
    autocast: dict[str, Any] | None = None  # the step's recorded autocast state


def _resolve(
    source: Any,
    inputs: Any,
    target: Any,
    loss_fn: Any,
    *,
    model: Any,
    optimizer: Any,
    scaler: Any,
    history: Any,
    trust_recipe: bool,
) -> _Source:
    notes: list[str] = []
    path = (
        getattr(source, "path", None)
        if not isinstance(source, (Snapshot, torch.nn.Module))
        else None
    )
    if isinstance(source, BaseException) and path is not None:
        source = path  # a NonFiniteError names its snapshot
    if isinstance(source, (str, os.PathLike)):
        if (
            model is None
            and inputs is not None
            and (isinstance(inputs, torch.nn.Module) or callable(inputs))
        ):
            model, inputs = inputs, None  # diagnose(path, factory)
        if inputs is not None:
            raise TypeError(
                "diagnose(path, ...) takes the batch from the snapshot: pass the model as "
                "model=, not a batch."
            )
        p = Path(source)
        if p.is_dir():
            df = list_snapshots(p)
            ok = df[df["error"].isna()]
            if ok.empty:
                raise SnapshotError(f"{p} holds no readable snapshot file.")
            p = Path(ok["path"].iloc[0])
            notes.append(f"diagnosed {p.name}, the earliest snapshot in {source}")
        source = load_snapshot(p, model, trust_recipe=trust_recipe)
    if isinstance(source, Snapshot):
        snap = source
        if inputs is not None or target is not None:
            raise TypeError(
                "a Snapshot carries its batch: diagnose(snapshot) takes no inputs or target."
            )
        if snap.model is None:
            if model is None or snap.path is None:
                raise SnapshotError(
                    "this snapshot was loaded without a model: give diagnose(snapshot, model=...) "
                    f"(a module or a zero-argument factory for {snap.model_class})."
                )
            snap = load_snapshot(snap.path, model, trust_recipe=snap.trust_recipe)
        m = snap.reset_model()
        loss_fn = snap.replay_loss_fn(loss_fn, "diagnose(snapshot, loss_fn=...)")
        if optimizer is not None:
            raise TypeError(
                "diagnose(snapshot, optimizer=...): a snapshot replays its own optimizer state; "
                "give diagnose(model, inputs, optimizer=...) to diagnose a live optimizer."
            )
        opt = None
        try:
            opt = snap.build_optimizer()
        except SnapshotError as e:
            notes.append(f"{str(e).rstrip('.')}: the weights after the update are not checked.")
        rng = RngState.capture()
        if snap.rng is not None:
            caller = RngState.capture()
            try:
                snap.restore_rng()
                rng = RngState.capture()
            finally:
                caller.restore()
        device = next((p.device for p in m.parameters()), torch.device("cpu"))
        hist = _history_rows(history) if history is not None else list(snap.history)
        reason = snap.recorded_failure
        return _Source(
            model=m,
            inputs=to_device(snap.inputs, device),
            target=to_device(snap.target, device),
            loss_fn=loss_fn,
            optimizer=opt,
            scaler_state=snap.scaler_state if scaler is None else scaler.state_dict(),
            rng=rng,
            history=hist,
            step=snap.step,
            recorded_failure=reason,
            notes=notes,
            snapshot=snap,
            autocast=snap.autocast,
        )
    if isinstance(source, torch.nn.Module):
        m = check_model(source)
        if inputs is None:
            raise TypeError("diagnose(model, inputs, ...) needs the batch: inputs is missing.")
        check_inputs(inputs)
        if model is not None:
            raise TypeError(
                "diagnose(model, inputs) takes no model=: the model is the first argument."
            )
        if optimizer is not None and not hasattr(optimizer, "param_groups"):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__qualname__}."
            )
        if optimizer is not None:
            own = {id(p) for p in m.parameters()}
            foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in own]
            if foreign:
                raise ValueError(
                    f"the optimizer holds {len(foreign)} parameter(s) that are not the model's: "
                    "pass the optimizer built over this model's parameters."
                )
        return _Source(
            model=m,
            inputs=inputs,
            target=target,
            loss_fn=loss_fn,
            optimizer=optimizer,
            scaler_state=None if scaler is None else scaler.state_dict(),
            rng=RngState.capture(),
            history=_history_rows(history),
            step=None,
            recorded_failure=None,
            notes=notes,
        )
    raise TypeError(
        "diagnose() expects a Snapshot, a snapshot path (with model=...), or a model and its "
        "batch; "
        f"got {type(source).__qualname__}."
    )


def _history_rows(history: Any) -> list[dict[str, Any]]:
    if history is None:
        return []
    rows = getattr(history, "history", history)  # a NaNGuard
    if hasattr(rows, "to_dict"):  # a DataFrame
        rows = rows.to_dict("records")
    try:
        out = [dict(r) for r in rows]
    except (TypeError, ValueError):
        raise TypeError(
            "history must be a NaNGuard, a list of dicts or a DataFrame with loss and grad_norm "
            f"columns; got {type(history).__qualname__}."
        ) from None
    return out


def _reference(history: list[dict[str, Any]], last: int = 20) -> dict[str, float | None]:
    """Medians of ``loss`` and ``grad_norm`` over the last healthy history rows."""
    good = [
        h
        for h in history
        if not h.get("skipped")
        and not h.get("nonfinite")
        and _finite(h.get("loss"))
        and _finite(h.get("grad_norm"))
    ][-last:]
    ref: dict[str, float | None] = {"loss": None, "grad_norm": None, "lr": None}
    if good:
        ref["loss"] = statistics.median(float(h["loss"]) for h in good)
        ref["grad_norm"] = statistics.median(float(h["grad_norm"]) for h in good)
        lrs = [float(h["lr"]) for h in good if _finite(h.get("lr"))]
        ref["lr"] = statistics.median(lrs) if lrs else None
    return ref


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _diverging(history: list[dict[str, Any]], last: int = 10) -> str:
    """Why the steps before this one point at the learning rate (the loss grew ``FAR``
    times over the last healthy rows), or ""."""
    losses = [
        (h.get("step"), float(h["loss"]))
        for h in history[-last:]
        if isinstance(h.get("loss"), (int, float)) and math.isfinite(h["loss"])
    ]
    if len(losses) < 2:
        return ""
    low = min(range(len(losses)), key=lambda i: abs(losses[i][1]))
    (s0, a), (s1, b) = losses[low], losses[-1]
    if low == len(losses) - 1 or abs(b) <= FAR * (abs(a) + 1e-12):
        return ""
    return (
        f"the loss grew from {fmt_num(a)} (step {s0}) to {fmt_num(b)} (step {s1}) before it: "
        "the weights diverged over those updates, so lower the learning rate (or warm it up) "
        "and resume from a checkpoint before the growth"
    )


def _earlier_step(history: list[dict[str, Any]], step: int | None) -> str:
    """Which earlier step to look at when the weights were already corrupted."""
    rows = [h for h in history if step is None or h.get("step") is None or h["step"] < step]
    if not rows:
        return (
            "the history holds no earlier step: the weights were corrupted before the guard's "
            "history began"
        )
    bad = next(
        (h for h in rows if not _finite(h.get("param_norm")) and h.get("param_norm") is not None),
        None,
    )
    if bad is None:
        bad = next(
            (h for h in rows if not _finite(h.get("loss")) or not _finite(h.get("grad_norm"))),
            None,
        )
    if bad is not None:
        prev = [h for h in rows if h.get("step") is not None and h["step"] < bad.get("step", 0)]
        at = prev[-1] if prev else bad
        return (
            f"look at step {at.get('step')}: the weights went bad at or before step "
            f"{bad.get('step')} "
            f"(last healthy grad norm {fmt_num(at.get('grad_norm'))}, lr {fmt_num(at.get('lr'))})"
        )
    last = rows[-1]
    return (
        f"look at what followed step {last.get('step')}, the last step in the history and a "
        f"healthy one (grad norm {fmt_num(last.get('grad_norm'))}, lr {fmt_num(last.get('lr'))}): "
        "its update, or a write to the weights outside the optimizer (a loaded checkpoint, "
        "code that edits them), made them non-finite"
    )


# ---------------------------------------------------------------------- diagnose
def diagnose(
    source: Any,
    inputs: Any = None,
    target: Any = None,
    loss_fn: Any = None,
    *,
    model: Any = None,
    optimizer: Any = None,
    scaler: Any = None,
    history: Any = None,
    fixes: Sequence[Any] | None = None,
    steps: int = 1,
    budget_s: float | None = None,
    trust_recipe: bool = False,
    progress: bool = True,
    autocast: bool = True,
) -> Diagnosis:
    """Replay the failing step with candidate fixes and rank the causes by what removes the
    NaN/Inf.

    Parameters
    ----------
    source : Snapshot, str/PathLike, or torch.nn.Module
        A loaded snapshot; a snapshot file (or a directory of them: the earliest is taken)
        with ``model=``; or the model itself, followed by its batch.
    inputs, target, loss_fn
        With a model: the batch and the loss, as :func:`nbdebug.trace` takes them
        (``model(x)``, ``model(*inputs)``, ``model(**inputs)``; ``loss_fn(output, target)``).
        With a snapshot: ``loss_fn`` overrides the recorded one.
    model : torch.nn.Module or callable, optional
        With a snapshot path: the architecture (a module, copied, or a factory).
    optimizer : torch.optim.Optimizer, optional
        With a model: the optimizer over its parameters (copied with its state; never
        stepped itself). A snapshot brings its own optimizer state.
    scaler : torch.amp.GradScaler, optional
        Its state is copied into the replays' scaler.
    history : NaNGuard, list of dict or DataFrame, optional
        Healthy rows (``loss``, ``grad_norm``) to compare the fixes with; a snapshot
        brings the guard's history.
    fixes : sequence, optional
        Fix objects (see :mod:`nbdebug.analysis.fixes`) to try, and/or kind names that
        select from the menu (``["epsilon", "drop_rows"]``). Default: the whole menu.
    steps : int
        Optimizer steps replayed on the batch per fix (all must stay finite); a row's
        ``loss`` and ``grad_norm`` are the last step's, so a fix that stays finite but
        still diverges is ranked after those near the healthy history.
    budget_s : float, optional
        Stop starting replays after this many seconds (the remaining rows say so).
    trust_recipe : bool
        With a snapshot path and no ``model``: build the model from the recorded recipe.
    progress : bool
        A ``tqdm.auto`` progress bar over the replays.
    autocast : bool
        With a snapshot of a step that ran under ``torch.autocast`` (``snap.autocast``):
        the trace and every replay (the plain one and each fix) run their forward and
        loss under the same dtype, as ``snap.trace()`` does. ``False``: in the model's
        own dtypes. (With a model, the replays run under whatever autocast is active
        around the call.)

    Returns
    -------
    Diagnosis
        ``.cause`` (kind, module, rows, finite, statement), ``.results``, ``.to_frame()``.

    Raises
    ------
    TypeError, ValueError
        A source of the wrong type, a missing batch, an optimizer over other parameters,
        an ``autocast`` that is not a bool.
    SnapshotError
        An unreadable snapshot, a model that does not fit it, no model to build, an
        autocast dtype this machine's device does not support (``autocast=False``
        replays without it).
    TraceError
        The step raises before any value is non-finite (e.g. a batch that does not fit
        the model): there is no NaN to diagnose. As :func:`nbdebug.trace` raises it: it
        names the module and carries the partial trace.

    Examples
    --------
    >>> d = nbdebug.diagnose("snapshots/step-000048213.nbsnap", model=make_model)
    >>> d.cause.kind, d.cause.module, d.cause.rows
    ('epsilon', 'norm', [3])
    >>> d.to_frame()
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an int >= 1; got {steps!r}.")
    if budget_s is not None and (
        isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or budget_s < 0
    ):
        raise ValueError(f"budget_s must be a number of seconds >= 0 or None; got {budget_s!r}.")
    check_flag(autocast, "autocast")
    chosen_kinds, user_fixes = _split_fixes(fixes)
    caller = RngState.capture()
    t_start = time.perf_counter()
    try:
        src = _resolve(
            source,
            inputs,
            target,
            loss_fn,
            model=model,
            optimizer=optimizer,
            scaler=scaler,
            history=history,
            trust_recipe=trust_recipe,
        )
        bench = Workbench(
            src.model,
            src.inputs,
            src.target,
            src.loss_fn,
            optimizer=src.optimizer,
            scaler_state=src.scaler_state,
            rng=src.rng,
            steps=steps,
            autocast=src.autocast if autocast else None,
        )
        notes = list(src.notes)
        try:
            tr: Trace | None = bench.trace()
        except TraceError as e:
            if e.trace is None or e.trace.first_nonfinite is None:
                # the step fails before any value is non-finite (a batch that does not fit
                # the model, a target of the wrong length): there is no NaN to diagnose
                raise
            tr = e.trace
            notes.append(f"the trace of the step raised: {e}")
        ref = _reference(src.history)
        plain_fix = NotReproducible()
        first = bench.run(plain_fix)  # also warms up (an optimizer's first step is slow)
        plain = bench.run(plain_fix)
        same_loss = first.loss == plain.loss or (
            first.loss != first.loss and plain.loss != plain.loss
        )
        if first.finite != plain.finite or not same_loss:
            notes.append(
                "two identical replays of the step disagree (loss "
                f"{fmt_num(first.loss)} vs {fmt_num(plain.loss)}): the step is not deterministic."
            )
        ctx = _menu_context(tr, bench, src, ref)
        candidates: list[Fix] = []
        if chosen_kinds is None or chosen_kinds:
            candidates = [
                f for f in menu(tr, ctx) if chosen_kinds is None or f.kind in chosen_kinds
            ]
        candidates += user_fixes
        results = [FixResult(plain_fix, plain)]
        results += _run_all(bench, tr, candidates, plain, budget_s, t_start, progress)
        for r in results:
            if plain.seconds > 0 and r.outcome.skipped is None and r.applies:
                r.cost = r.outcome.seconds / plain.seconds
        if plain.error:
            notes.append(f"the plain replay of the step raised: {plain.error}")
        origin = _origin_text(tr, plain)
        _rank(results, ref, plain, ctx)
        cause = _cause(results, tr, plain, src, origin, autocast)
        return Diagnosis(
            cause=cause,
            results=results,
            trace=tr,
            origin=origin,
            plain=plain,
            reference={"loss": ref["loss"], "grad_norm": ref["grad_norm"]},
            notes=notes,
            step=src.step,
            workbench=bench,
        )
    finally:
        caller.restore()


def _split_fixes(fixes: Sequence[Any] | None) -> tuple[set[str] | None, list[Any]]:
    if fixes is None:
        return None, []
    if isinstance(fixes, (str, Fix)) or not isinstance(fixes, Sequence):
        fixes = [fixes]  # type: ignore[list-item]
    kinds: set[str] = set()
    objs: list[Any] = []
    for f in fixes:
        if isinstance(f, str):
            if f not in KINDS:
                raise ValueError(f"unknown fix kind {f!r}; the kinds are {', '.join(KINDS)}.")
            kinds.add(f)
        elif callable(getattr(f, "apply", None)):
            objs.append(f)
        else:
            raise TypeError(
                "fixes must hold fix kinds (str) or fix objects with applies(), apply() and "
                f"describe(); got {type(f).__qualname__}."
            )
    return kinds, objs


def _menu_context(
    tr: Trace | None, bench: Workbench, src: _Source, ref: dict[str, Any]
) -> MenuContext:
    ctx = MenuContext(has_optimizer=bench.optimizer is not None)
    if bench.optimizer is not None and bench.optimizer.param_groups:
        lr = bench.optimizer.param_groups[0].get("lr")
        ctx.lr = float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None
    if src.scaler_state is not None:
        sc = src.scaler_state.get("scale")
        ctx.scaler_scale = float(sc) if isinstance(sc, (int, float, torch.Tensor)) else None
    ctx.grad_norm_ref = ref.get("grad_norm")
    ctx.corrupted = _nonfinite_state(bench)
    if ctx.corrupted:
        ctx.earlier = _earlier_step(src.history, src.step)
    if tr is not None:
        o = tr.origin
        if o is not None and o.phase in ("forward", "loss", "backward"):
            module = None if o.phase == "loss" else o.module
            families = ("div", "log", "sqrt", "exp", "softmax")
            found, ctx.sites = bench.probe(module, families)
            for fam, s, filename in found:
                ctx.probed.append((module, fam, s, filename))
    return ctx


def _nonfinite_state(bench: Workbench) -> list[str]:
    """Parameters and floating buffers of the step's weights that hold NaN/Inf."""
    bench.reset()
    named = [
        *bench.model.named_parameters(),
        *((n, b) for n, b in bench.model.named_buffers() if b.is_floating_point()),
    ]
    if not named:
        return []
    with torch.no_grad():
        flags = torch.stack([torch.isfinite(t).all() for _, t in named]).tolist()
    return [n for (n, _), ok in zip(named, flags) if not ok]


def _run_all(
    bench: Workbench,
    tr: Trace | None,
    candidates: list[Any],
    plain: StepOutcome,
    budget_s: float | None,
    t_start: float,
    progress: bool,
) -> list[FixResult]:
    from tqdm.auto import tqdm

    results: list[FixResult] = []
    bar = tqdm(candidates, desc="replaying fixes", disable=not progress, leave=False)
    try:
        for fix in bar:
            try:
                applies = getattr(fix, "applies", None)
                ok = bool(applies(tr)) if callable(applies) and tr is not None else True
            except Exception as e:
                results.append(
                    FixResult(
                        fix,
                        StepOutcome(error=f"applies() raised {type(e).__name__}: {e}"),
                        applies=False,
                    )
                )
                continue
            if not ok:
                text = _why_not(fix, tr)
                results.append(
                    FixResult(
                        fix,
                        StepOutcome(skipped="does not apply"),
                        applies=False,
                        note=text or "does not apply to this step.",
                    )
                )
                continue
            if isinstance(fix, WeightsCorrupted):
                results.append(FixResult(fix, copy.copy(plain), note=fix.earlier))
                continue
            if budget_s is not None and time.perf_counter() - t_start > budget_s:
                results.append(
                    FixResult(
                        fix, StepOutcome(skipped=f"not replayed: budget_s={budget_s:g} s spent")
                    )
                )
                continue
            out = bench.run(fix)
            note = ""
            if isinstance(fix, EpsilonFix) and fix.rewritten == 0 and out.error is None:
                note = f"no {fix.op} operation ran in {fix._place()}: nothing was rewritten."
            results.append(FixResult(fix, out, note=note))
    finally:
        bar.close()
    return results


def _why_not(fix: Any, tr: Trace | None) -> str:
    why = getattr(fix, "why_not", None)
    return _safe(lambda: str(why(tr)), "") if callable(why) else ""


def _deviation(o: StepOutcome, ref: dict[str, Any]) -> float:
    d = 0.0
    for key, v in (("loss", o.loss), ("grad_norm", o.grad_norm)):
        r = ref.get(key)
        if r is None or v is None or not math.isfinite(v):
            continue
        d += math.log1p(abs(v - r) / (abs(r) + 1e-12))
    return d


FAR = 100.0  # a finite fix whose loss or gradient norm is this many times off the history


def far_from_history(o: StepOutcome, ref: dict[str, Any]) -> str:
    """Why a finite replay is far from the healthy history ("loss 952 vs 0.067"), or
    still diverging over its replayed updates (``steps=``: the loss grew ``FAR`` times),
    or ""."""
    for key, label, v in (("loss", "loss", o.loss), ("grad_norm", "gradient norm", o.grad_norm)):
        r = ref.get(key)
        if r is None or v is None or not math.isfinite(v):
            continue
        if abs(v - r) > (FAR - 1.0) * (abs(r) + 1e-12):
            return f"finite, but far from the healthy history: {label} {fmt_num(v)} vs {fmt_num(r)}"
    first, last = o.first_loss, o.loss
    if (
        first is not None
        and last is not None
        and math.isfinite(last)
        and abs(last) > FAR * (abs(first) + 1e-12)
    ):
        return (
            f"finite, but diverging over the {o.steps} replayed updates: loss "
            f"{fmt_num(first)} -> {fmt_num(last)}"
        )
    return ""


def _rank(
    results: list[FixResult], ref: dict[str, Any], plain: StepOutcome, ctx: MenuContext
) -> None:
    for r in results:
        r.deviation = _deviation(r.outcome, ref) if r.finite else None
        far = far_from_history(r.outcome, ref) if r.finite else ""
        if far:
            r.note = "; ".join(x for x in (r.note, far) if x)

    def key(item: tuple[int, FixResult]) -> tuple[Any, ...]:
        i, r = item
        kind = r.kind
        loc = _locality(r.fix)
        if kind == "not_reproducible":
            # a finite plain re-run outranks everything: every fix is then finite too
            return (0, 0.0, 0.0, i) if r.finite else (3, 0.0, 0.0, i)
        if kind == "weights_corrupted":
            return (1, 0.0, 0.0, i)
        if r.finite:
            # more than FAR times off the history: after the fixes that stay close to it
            return (2 + 0.5 * bool(far_from_history(r.outcome, ref)), loc, r.deviation or 0.0, i)
        if not r.applies or r.outcome.skipped:
            return (5, loc, 0.0, i)
        if r.outcome.error:
            return (4, loc, 0.0, i)
        return (3, loc, 0.0, i)

    order = sorted(enumerate(results), key=key)
    results[:] = [r for _, r in order]
    for n, r in enumerate(results, 1):
        r.rank = n


def _locality(fix: Any) -> float:
    v = getattr(fix, "rank_locality", None)
    if isinstance(v, (int, float)):
        return float(v)
    loc = getattr(fix, "locality", None)
    return float(loc) if isinstance(loc, (int, float)) else 2.5


def _origin_text(tr: Trace | None, plain: StepOutcome) -> str:
    if tr is None:
        return "the step could not be traced"
    o = tr.origin
    if o is None:
        if tr.first_nonfinite is not None:
            return f"the first non-finite value is at {tr.first_nonfinite.label}"
        if plain.error:
            return f"the step raises ({plain.error})"
        if plain.update is False:
            return (
                "forward, loss and backward are finite; the optimizer step makes the weights "
                "non-finite"
            )
        return "forward, loss and backward are finite"
    what = "NaN" if o.stats.n_nan else "Inf"
    if o.phase == "input":
        held = "the target" if o.kind == "target" else "the batch itself"
        where = f"{held} holds {what} (`{o.name}`)"
    elif o.phase == "loss":
        where = f"the loss turns finite outputs into {what}"
    else:
        mt = f" ({o.module_type})" if o.module_type else ""
        stage = "forward" if o.phase == "forward" else "backward"
        where = f"{o.module or '<model>'}{mt} produces {what} in the {stage} pass"
    op = f" at {o.op}" if o.op else ""
    src = f" ({o.source})" if o.source else ""
    rows = f", batch {rows_text(o.samples)}" if o.samples else ""
    param = f"; parameter {o.param}" if o.param else ""
    return f"{where}{op}{src}{rows}{param}"


def _cause(
    results: list[FixResult],
    tr: Trace | None,
    plain: StepOutcome,
    src: _Source,
    origin: str,
    autocast: bool = True,
) -> Cause:
    top = results[0]
    o = tr.origin if tr is not None else None
    rows = top.rows
    if not rows and o is not None and top.kind in ("epsilon", "drop_rows", "float32", "custom"):
        rows = list(o.samples)
    op = getattr(top.fix, "op", None) or (o.op if o is not None else None)
    source = getattr(top.fix, "source", None) or (o.source if o is not None else None)
    kind = top.kind
    if kind == "not_reproducible" and top.finite:
        if src.recorded_failure and src.autocast is not None and not autocast:
            dtype = src.autocast.get("dtype", "its autocast dtype")
            s = (
                f"the step replayed in the model's own dtypes (autocast=False) is finite, "
                f"although the run recorded {src.recorded_failure}: the failure comes from "
                f"running under {dtype} autocast; diagnose with autocast=True to find where."
            )
        elif src.recorded_failure:
            s = (
                "the step replayed bit for bit is finite, although the run recorded "
                f"{src.recorded_failure}: the failure is not reproducible (non-determinism, a "
                "module with state between calls, or hardware)."
            )
        else:
            s = (
                "the step is finite end to end when run as it is: there is nothing to fix (or "
                "the failure is not reproducible)."
            )
    elif kind == "weights_corrupted":
        what = top.describe().replace("none possible: ", "")
        s = f"{what}: no replay of this step can fix it; {top.note or 'look at an earlier step'}."
    elif top.finite:
        others = [
            r
            for r in results[1:]
            if r.finite and r.kind not in ("not_reproducible",) and r.kind != kind
        ][:2]
        also = ""
        if others:
            also = ", as does " + " and ".join(_gerund(r) for r in others)
        s = f"{_sentence_start(origin)}; {top.describe()} makes the step finite end to end{also}."
    else:
        unrun = [r for r in results[1:] if r.applies and r.outcome.skipped]
        tried = [r for r in results[1:] if r.applies and not r.outcome.skipped]
        if unrun and not tried:
            n = f"{len(unrun)} candidate fix" + ("es" if len(unrun) > 1 else "")
            s = (
                f"{_sentence_start(origin)}; budget_s ran out before any of the {n} found was "
                "replayed: raise it to try them."
            )
        else:
            again = " the failure reproduces, and" if kind == "not_reproducible" else ""
            s = (
                f"{_sentence_start(origin)};{again} no candidate fix made the step finite "
                "end to end"
            )
            grew = _diverging(src.history)
            s += f"; {grew}." if grew else "."
    return Cause(
        kind=kind,
        module=top.module,
        rows=rows,
        finite=top.finite,
        statement=s,
        fix=top.fix,
        op=op,
        source=source,
    )


def _sentence_start(origin: str) -> str:
    return origin[:1].lower() + origin[1:] if origin else "the step is not finite"


def _gerund(r: FixResult) -> str:
    d = r.describe()
    for a, b in (
        ("drop ", "dropping "),
        ("run ", "running "),
        ("clip ", "clipping "),
        ("learning rate", "a learning rate"),
    ):
        if d.startswith(a):
            return b + d[len(a) :]
    return d
