"""Each row's loss and gradient norm over a set of parameters, three ways:

- :attr:`BlameMethod.VMAP`: ``torch.func.vmap(grad(...))`` over chunks of rows, each row
  run as a batch of one through ``torch.func.functional_call`` (the fast path);
- :attr:`BlameMethod.LOOP`: one row at a time, each a batch of one, with
  ``torch.autograd.grad``: for models that vmap cannot run (BatchNorm in train mode,
  in-place writes to buffers, ``.item()`` in the forward, data-dependent branches);
- :attr:`BlameMethod.IN_BATCH`: one forward of the whole batch, then the gradient of each
  row's own loss term (the loss on that row of the output): for models that cannot run
  one row alone (a BatchNorm in train mode over a batch of one); the rows then share the
  batch's statistics, as in the step itself.

The caller keeps the model as it was (:func:`nbdebug.core.state.preserved`): the
gradients are returned, never accumulated into ``.grad``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...core.batch import LossFn, call_model, compute_loss
from ...core.text import first_line
from ...core.vocab import Vocab
from .rows import row_leaves, with_leaves

__all__ = ["BlameMethod", "RowGrads", "row_grads"]

#: torch's warning for an op that vmap runs row by row (no batching rule): still correct
SLOW_OP = "There is a performance drop because we have not yet implemented the batching rule"


class BlameMethod(Vocab):
    """How the per-row gradients were computed (see the module docstring)."""

    VMAP = "vmap"
    LOOP = "loop"
    IN_BATCH = "in_batch"


@dataclass
class RowGrads:
    """Per-row losses and gradient norms (float64, one per row), how they were computed
    and what was tried first (one sentence each)."""

    loss: np.ndarray
    grad_norm: np.ndarray
    method: BlameMethod
    notes: list[str] = field(default_factory=list)


def _args(inputs: object) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``functional_call``'s args and kwargs under the calling conventions."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _norm(grads: Sequence[torch.Tensor | None], rows: int) -> torch.Tensor:
    """``(rows,)`` norms of per-row gradients ``(rows, *shape)`` taken over all tensors."""
    parts = [
        torch.linalg.vector_norm(g.reshape(rows, -1).float(), dim=1) for g in grads if g is not None
    ]
    if not parts:
        return torch.zeros(rows)
    return torch.linalg.vector_norm(torch.stack(parts), dim=0).cpu()


def _vmap(
    model: torch.nn.Module,
    batch: Any,
    rows: int,
    loss_fn: LossFn | None,
    names: Sequence[str],
    chunk: int,
) -> tuple[np.ndarray, np.ndarray]:
    from torch.func import functional_call, grad, vmap

    params = dict(model.named_parameters())
    scope = {n: params[n].detach() for n in names}
    state = {n: p.detach() for n, p in params.items() if n not in scope}
    state.update(dict(model.named_buffers()))
    leaves = row_leaves(batch, rows)

    def one_row(p: dict[str, torch.Tensor], row: tuple[torch.Tensor, ...]) -> Any:
        inputs, target = with_leaves(batch, rows, iter(t.unsqueeze(0) for t in row))
        args, kwargs = _args(inputs)
        out = functional_call(model, {**state, **p}, args, kwargs, strict=False)
        loss = compute_loss(out, target, loss_fn)
        return loss, loss.detach()

    per_row = vmap(grad(one_row, has_aux=True), in_dims=(None, 0), randomness="different")
    losses, norms = [], []
    for start in range(0, rows, chunk):
        part = tuple(t[start : start + chunk] for t in leaves)
        with warnings.catch_warnings():  # an op without a batching rule runs row by row
            warnings.filterwarnings("ignore", message=SLOW_OP, category=UserWarning)
            g, loss = per_row(scope, part)
        n = part[0].shape[0]
        norms.append(_norm(list(g.values()), n))
        losses.append(loss.detach().float().reshape(n).cpu())
    return torch.cat(losses).double().numpy(), torch.cat(norms).double().numpy()


def _grad_norm(loss: torch.Tensor, params: Sequence[torch.Tensor], retain: bool) -> float:
    if not loss.requires_grad:
        return 0.0
    gs = torch.autograd.grad(loss, params, retain_graph=retain, allow_unused=True)
    return float(_norm([None if g is None else g.unsqueeze(0) for g in gs], 1)[0])


def _loop(
    model: torch.nn.Module, batch: Any, rows: int, loss_fn: LossFn | None, names: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    params = dict(model.named_parameters())
    scope = [params[n] for n in names]
    leaves = row_leaves(batch, rows)
    losses, norms = np.empty(rows), np.empty(rows)
    for i in range(rows):
        inputs, target = with_leaves(batch, rows, iter(t[i : i + 1] for t in leaves))
        with torch.enable_grad():
            loss = compute_loss(call_model(model, inputs), target, loss_fn)
        losses[i] = float(loss.detach())
        norms[i] = _grad_norm(loss, scope, retain=False)
    return losses, norms


def _in_batch(
    model: torch.nn.Module, batch: Any, rows: int, loss_fn: LossFn | None, names: Sequence[str]
) -> tuple[np.ndarray, np.ndarray]:
    params = dict(model.named_parameters())
    scope = [params[n] for n in names]
    inputs, target = batch
    with torch.enable_grad():
        out = call_model(model, inputs)
    pair = (out, target)
    leaves = row_leaves(pair, rows)
    if loss_fn is None or not row_leaves(out, rows):
        raise ValueError(
            "the model's output has no batch dimension to take each row's loss term from "
            "(a loss_fn over a per-row output is needed)."
        )
    losses, norms = np.empty(rows), np.empty(rows)
    for i in range(rows):
        o, t = with_leaves(pair, rows, iter(x[i : i + 1] for x in leaves))
        with torch.enable_grad():
            loss = compute_loss(o, t, loss_fn)
        losses[i] = float(loss.detach())
        norms[i] = _grad_norm(loss, scope, retain=True)
    return losses, norms


def row_grads(
    model: torch.nn.Module,
    batch: tuple[Any, Any],
    rows: int,
    loss_fn: LossFn | None,
    names: Sequence[str],
    *,
    chunk: int,
    reset: Callable[[], None],
) -> RowGrads:
    """Each row's loss and gradient norm over the parameters ``names``: vmap over chunks of
    ``chunk`` rows, else one row at a time, else each row's term of the batch's loss
    (``reset()`` puts buffers and RNG back before each try)."""
    notes: list[str] = []
    try:
        loss, norm = _vmap(model, batch, rows, loss_fn, names, chunk)
        return RowGrads(loss, norm, BlameMethod.VMAP, notes)
    except Exception as e:
        notes.append(f"vmap could not run the model ({first_line(e)}): one row at a time.")
    reset()
    try:
        loss, norm = _loop(model, batch, rows, loss_fn, names)
        return RowGrads(loss, norm, BlameMethod.LOOP, notes)
    except Exception as e:
        alone = e
    reset()
    try:
        loss, norm = _in_batch(model, batch, rows, loss_fn, names)
    except Exception:
        raise alone from None
    notes.append(
        f"a row cannot run alone ({first_line(alone)}): each row's gradient is that of its "
        "own loss term in the whole batch's forward (the rows share its statistics)."
    )
    return RowGrads(loss, norm, BlameMethod.IN_BATCH, notes)
