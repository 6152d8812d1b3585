"""``nbdebug.row_blame()``: each batch row's loss and share of the gradient norm at a
spike or NaN snapshot, or for a model and its batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ...core.batch import batch_size, describe
from ...core.guard.skips import batch_ids
from ...core.snapshot import ResolvedStep, resolve_step
from ...core.snapshot.load import ModelSource
from ...core.snapshot.resolve import ResolveOptions
from ...core.state import preserved
from ...core.trace import Trace, TraceError, trace
from ...core.vocab import FailureKind
from .grads import row_grads
from .join import drift_columns, label_columns
from .options import BlameOptions
from .result import RowBlame, blame_result
from .scope import choose_scope

__all__ = ["row_blame"]


def row_blame(
    source: object,
    inputs: Any = None,
    target: Any = None,
    loss_fn: Callable[..., Any] | None = None,
    *,
    model: ModelSource | None = None,
    ids: Any = None,
    labels: Any = None,
    drift: Any = None,
    **options: Any,
) -> RowBlame:
    """Each batch row's loss and its share of the gradient norm, from per-sample
    gradients (``torch.func``): which rows drove a spike or a NaN.

    Each row is run as a batch of its own: its loss is ``loss_fn`` on that row alone
    (with ``reduction="mean"`` or ``"sum"`` this is the row's loss, and the batch's loss
    the mean or sum of the rows': a loss that couples rows, such as a contrastive loss or
    a mean weighted over the batch, is blamed as if each row were a batch of one). The
    gradient is taken over the whole model's trainable parameters when ``min(rows, 8)``
    rows' gradients fit in ``memory`` bytes, else over the origin layer's (at a spike, the
    first layer to cross its threshold in the guard's per-layer signals; else the module
    where :func:`nbdebug.trace` finds the first NaN produced; else the module with the
    largest gradient norm); ``layer=`` chooses.
    Rows go through ``torch.func.vmap`` in chunks that fit; a model that vmap cannot run
    (BatchNorm in train mode, in-place writes) is run one row at a time, and one whose
    rows cannot run alone (BatchNorm over a batch of one) gives each row the gradient of
    its own loss term in the batch's forward (``RowBlame.method`` says which).
    A row's share is its gradient norm over the sum of the finite rows' norms.

    Parameters
    ----------
    source : Snapshot, str/PathLike, NonFiniteError or torch.nn.Module
        A snapshot (a spike or NaN step; a path with ``model=``; a directory: the
        earliest), the guard's error, or a model followed by its batch.
    inputs, target, loss_fn
        With a model: the batch and the loss as :func:`nbdebug.trace` takes them. With a
        snapshot: ``loss_fn`` overrides the recorded one.
    model : torch.nn.Module or callable, optional
        With a snapshot path: the architecture (a module, copied, or a factory).
    ids : sequence of int or Tensor, optional
        The dataset index of each batch row (default: the snapshot's, recorded from the
        guard's ``check(..., ids=...)``).
    labels : pandas.DataFrame, optional
        The table of :func:`nbdebug.find_label_issues` (indexed by dataset index): its
        ``is_issue``, ``given_label``, ``suggested_label`` and ``label_quality`` are
        joined on the rows' dataset indices (on the batch rows without ids).
    drift : DriftReport, optional
        A report of :func:`nbdebug.drift` whose current data holds these samples (at
        their dataset indices, or the batch itself without ids): each row's cluster, its
        change in share and the row's SHAP on the drifted features are joined.
    fraction : float
        The summary names the fewest rows carrying at least this share (default 0.5).
    layer : str, optional
        Blame this module's parameters (``""``: the whole model).
    memory : int
        Bytes the per-row gradients may take at once (default 512 MiB).
    trust_recipe : bool
        With a snapshot path and no ``model``: build the model from the recorded recipe.
    options : BlameOptions, optional
        The keyword options above as one value; keywords given as well replace its fields.

    Returns
    -------
    RowBlame
        ``.summary()`` ("rows 17 and 203 carry 81% of the gradient norm (2 of 32
        rows)."), ``.to_frame()``, ``.heavy``, ``.outliers``, ``.nonfinite``, ``.show()``.

    Raises
    ------
    TypeError, ValueError
        A source of the wrong kind, a batch without a batch dimension, ``ids`` that are
        not one integer per row, ``labels``/``drift`` of the wrong kind, an unknown
        option or layer.
    SnapshotError
        An unreadable snapshot, or one without a model.

    Examples
    --------
    >>> blame = nbdebug.row_blame("snapshots/step-000000040.nbsnap", model=make_model)
    >>> blame.summary()
    'samples 17 and 203 (batch rows 3 and 9) carry 81% of the gradient norm (2 of 32 rows).'
    >>> nbdebug.row_blame(model, x, y, F.cross_entropy, labels=issues).to_frame()
    """
    opts = BlameOptions.of(options)
    how = ResolveOptions(trust_recipe=opts.trust_recipe, caller="row_blame")
    step = resolve_step(source, inputs, target, loss_fn=loss_fn, model=model, options=how)
    rows = batch_size(step.inputs)
    if not rows:
        raise ValueError(
            "row_blame() needs a batch of at least one row (a tensor with a batch "
            f"dimension); got {describe(step.inputs)}."
        )
    snap = step.snapshot
    recorded = snap.ids if snap is not None else None
    row_ids = batch_ids(ids if ids is not None else recorded, step.inputs)
    notes = list(step.notes)
    if snap is not None and snap.autocast:
        notes.append("replayed in the model's own dtypes (the step ran under autocast).")
    with preserved(step.model) as kept:

        def reset() -> None:
            kept.reset_buffers()
            step.rng.restore()

        reset()
        scope = choose_scope(step.model, rows, opts.memory, opts.layer, lambda: _origin(step))
        batch = (step.inputs, step.target)
        grads = row_grads(
            step.model, batch, rows, step.loss_fn, scope.names, chunk=scope.chunk, reset=reset
        )
    keys = row_ids if row_ids is not None else list(range(rows))
    joined = [label_columns(labels, keys)] if labels is not None else []
    joined += [drift_columns(drift, keys)] if drift is not None else []
    return blame_result(
        grads.loss,
        grads.grad_norm,
        opts.fraction,
        ids=row_ids,
        method=grads.method,
        layer=scope.layer,
        scope=scope.why,
        joined=None if not joined else joined[0] if len(joined) == 1 else joined[0].join(joined[1]),
        step=step.step,
        kind=str(snap.kind) if snap is not None else None,
        notes=notes + grads.notes,
    )


def _origin(step: ResolvedStep) -> str | None:
    """The module where the step went wrong: a spike snapshot's origin (the module of the
    parameter whose gradient norm crossed its threshold first, from the guard's per-layer
    signals: :func:`nbdebug.core.flow.flow_data`), the module where the first NaN is
    produced, else the one whose parameter's gradient norm is largest (``None`` when the
    step cannot be traced)."""
    model = step.model
    modules = dict(model.named_modules())
    owns = {n for n, m in modules.items() if any(p.requires_grad for p in m.parameters())}
    snap = step.snapshot
    if snap is not None and snap.kind == FailureKind.SPIKE:
        from ...core.flow import flow_data  # the guard's per-layer signals, when it kept them

        for o in flow_data(snap).origins:
            layer = o.parameter.rsplit(".", 1)[0] if "." in o.parameter else ""
            if o.spike_step == snap.step and layer in owns:
                return layer
    tr: Trace | None
    try:
        tr = trace(model, step.inputs, step.target, step.loss_fn)
    except TraceError as e:
        tr = e.trace
    if tr is None:
        return None
    if tr.origin is not None and tr.origin.module in owns:
        return tr.origin.module
    frame = tr.params_frame()
    norms = frame["grad_norm"].astype(float)
    norms = norms[norms.notna() & (norms != float("inf"))]
    if norms.empty:
        return None
    best = frame.loc[norms.idxmax(), "module"]
    return str(best) if best in owns else None
