"""The dataset indices of each training batch, as the trainer's ``DataLoader`` fetched them:
what the callbacks pass to ``NaNGuard.check(ids=...)`` (the snapshot's ``ids``, row blame,
``skip_batches.json``).

:class:`SamplerIds` arms a training ``DataLoader`` for its next iterator: the loader's
``_get_iterator`` is wrapped (an attribute of that loader alone, taken off again as it is
called), and while it makes the iterator the loader's ``batch_sampler`` is a recording
pass-through, which the iterator keeps (the loader's own attribute is back at once). The
pass-through yields the very lists the batch sampler yields, in the same order, with the
same random draws; it appends each one to a FIFO as the ``DataLoader`` takes it (in the main
process, also with workers: ahead of the batch being trained, by the workers' prefetch, the
trainer's prefetching fetcher, gradient accumulation), and the callback takes one entry per
batch the training loop consumes. A new iterator (a new epoch) starts the FIFO afresh.

Where the indices cannot be known (no torch ``DataLoader``, an ``IterableDataset``, no
``batch_sampler``, batches out of order, a sampler that yields no integer lists, rows that do
not match the batch) no ids are passed and :attr:`SamplerIds.note` says why, once.
"""

from __future__ import annotations

import logging
import numbers
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..core.guard.skips import batch_ids

__all__ = ["SamplerIds"]

_log = logging.getLogger("nbdebug")


def _index_list(indices: Any) -> list[int] | None:
    """``indices`` (one batch's, as a batch sampler yields them) as a list of ints; ``None``
    when they are not integer indices (a generator is never consumed here)."""
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1 or indices.dtype.is_floating_point or indices.is_complex():
            return None
        indices = indices.tolist()
    if not isinstance(indices, (list, tuple, range)):
        return None
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in indices):
        return None
    return [int(i) for i in indices]


def _unsupported(loader: Any, dl: Any) -> str | None:
    """Why the batches of ``loader`` (its torch ``DataLoader``: ``dl``) have no sampler
    indices to record; ``None`` when they have."""
    if isinstance(getattr(dl, "dataset", None), IterableDataset):
        return "the training loader's dataset is an IterableDataset (no sampler indices)"
    if type(loader).__name__ == "DataLoaderDispatcher":
        return "accelerate dispatches the batches from one process (dispatch_batches)"
    if not isinstance(dl, DataLoader):
        return f"the training loader is a {type(loader).__qualname__}, not a torch DataLoader"
    if dl.batch_sampler is None:
        return "the training loader has no batch_sampler (batch_size=None)"
    if dl.num_workers > 0 and getattr(dl, "in_order", True) is False:
        return "the training loader yields batches out of order (in_order=False)"
    return None


class _Recording:
    """A batch sampler that yields what ``inner`` yields and records each batch's indices
    in ``owner``'s FIFO (every other attribute is ``inner``'s)."""

    def __init__(self, inner: Any, owner: SamplerIds) -> None:
        self.inner = inner
        self.owner = owner

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.inner)  # where the DataLoader would call it: the same random draws
        self.owner.restart()
        return self._through(it)

    def _through(self, it: Iterator[Any]) -> Iterator[Any]:
        for indices in it:
            self.owner.record(indices)
            yield indices

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name in ("inner", "owner"):  # not set yet (unpickling, copying)
            raise AttributeError(name)
        return getattr(self.inner, name)


class SamplerIds:
    """The dataset indices of the training batches, for a trainer callback.

    Parameters
    ----------
    enabled : bool
        ``False``: record nothing (:meth:`arm` does nothing, every batch has no ids).

    Attributes
    ----------
    note : str or None
        Why some batch had no ids (the first reason), else ``None``.
    """

    def __init__(self, *, enabled: bool = True) -> None:
        if not isinstance(enabled, bool):
            raise TypeError(f"sampler_ids must be True or False; got {enabled!r}.")
        self.enabled = enabled
        self.note: str | None = None
        self._open = enabled
        self._fifo: deque[list[int] | None] = deque()
        self._kept: list[int] | None = None
        # id -> (the DataLoader whose next iterator records, the hook on it)
        self._armed: dict[int, tuple[Any, Any]] = {}
        # (DataLoader, recorder) of persistent-workers loaders, whose iterator keeps it
        self._recorders: list[tuple[Any, _Recording]] = []

    def say(self, reason: str) -> None:
        """Record why a batch has no ids (the first reason is kept, and logged once)."""
        if self.note is None:
            self.note = reason
            _log.info("nbdebug: no dataset ids for some training batches: %s", reason)

    # -- recording ------------------------------------------------------------------

    def arm(self, loader: Any, *, active: Callable[[], bool] | None = None) -> None:
        """Record the batches of ``loader``'s next iterator (a torch ``DataLoader``, or
        accelerate's wrapper of one); say why not when its indices cannot be known.
        ``active``: whether the iterator being made is the training loop's (one made after
        training stopped on an error records nothing, and takes the hook off)."""
        if not self._open or loader is None:
            return
        dl = vars(loader).get("base_dataloader", loader) if hasattr(loader, "__dict__") else loader
        reason = _unsupported(loader, dl)
        if reason is not None:
            self.say(reason)
            return
        if id(dl) in self._armed:
            return
        if "_get_iterator" in vars(dl):  # not ours: left as it is
            self.say("the training loader has a _get_iterator of its own")
            return

        def get_iterator() -> Any:
            self._disarm_one(dl)
            if not self._open or (active is not None and not active()):
                return type(dl)._get_iterator(dl)
            original = dl.batch_sampler
            recorder = _Recording(original, self)
            object.__setattr__(dl, "batch_sampler", recorder)  # past DataLoader's own check
            try:
                return type(dl)._get_iterator(dl)
            finally:
                object.__setattr__(dl, "batch_sampler", original)
                if dl.persistent_workers:  # its iterator, kept by the loader, is reset later
                    self._recorders.append((dl, recorder))

        dl._get_iterator = get_iterator
        self._armed[id(dl)] = (dl, get_iterator)

    def restart(self) -> None:
        """A new iterator over the recorded loader: what was fetched before is gone."""
        self._fifo.clear()

    def record(self, indices: Any) -> None:
        """One batch's indices, as the loader fetched them."""
        if not self._open:
            return
        found = _index_list(indices)
        if found is None:
            shown = repr(indices)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            self.say(f"the batch sampler yields {shown}, not a list of integer indices")
        self._fifo.append(found)

    def take(self, *, kept: bool) -> None:
        """The training loop consumed the next batch: ``kept`` when it is the one the
        step's snapshot holds (its ids are then the step's)."""
        entry = self._fifo.popleft() if self._fifo else None
        if kept:
            self._kept = entry

    def step_ids(self, inputs: Any) -> list[int] | None:
        """The ids of the step's kept batch, when they give one index per row of
        ``inputs`` (else ``None``, and :attr:`note` says so)."""
        if self._kept is None:
            return None
        try:
            return batch_ids(self._kept, inputs)
        except ValueError as error:
            self.say(f"a batch's rows do not match its sampler indices ({error})")
            return None

    def end_step(self) -> None:
        """The optimizer step is over: its ids are no one's."""
        self._kept = None

    # -- restoring ------------------------------------------------------------------

    def _disarm_one(self, dl: Any) -> None:
        _, hook = self._armed.pop(id(dl), (None, None))
        if hook is not None and vars(dl).get("_get_iterator") is hook:
            del vars(dl)["_get_iterator"]

    def disarm(self) -> None:
        """Take the hook off every loader that has not made its iterator yet."""
        for dl, _ in list(self._armed.values()):
            self._disarm_one(dl)

    def close(self, reason: str | None = None) -> None:
        """Stop recording and leave every loader as it was (a persistent-workers iterator
        gets its batch sampler back); ``reason``: why no batch has ids from now on."""
        if reason is not None:
            self.say(reason)
        self._open = False
        self.disarm()
        for dl, recorder in self._recorders:
            iterator = getattr(dl, "_iterator", None)
            if iterator is not None and getattr(iterator, "_index_sampler", None) is recorder:
                iterator._index_sampler = recorder.inner
        self._recorders.clear()
        self._fifo.clear()
        self._kept = None
