"""The rewind window's copies (:mod:`.rewind`): the state copy allocated once and refilled in
place (:class:`StateCopy`), the batch buffers reused from window to window
(:class:`BatchBuffers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..batch import iter_tensors

if TYPE_CHECKING:  # pragma: no cover
    from ..snapshot.rewind import RewindWindow

__all__ = ["BatchBuffers", "StateCopy", "tensor_bytes"]


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in ``obj`` (dicts, lists, tuples of them)."""
    return sum(t.numel() * t.element_size() for t in iter_tensors(obj))


class BatchBuffers:
    """The CPU buffers a window's batches are copied into: those of the window before,
    reused (a step's batch copy then allocates nothing: fresh memory costs a page fault
    per 4 KiB, and freeing a window's batches at once lets the allocator hand memory back
    to the system, which the training step then faults in again)."""

    def __init__(self) -> None:
        self._free: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}

    def take(self, t: torch.Tensor) -> torch.Tensor | None:
        """A spare buffer of ``t``'s shape and dtype (``None``: none, or ``t`` is not a
        dense tensor)."""
        if t.layout != torch.strided:
            return None
        free = self._free.get((tuple(t.shape), t.dtype))
        return free.pop() if free else None

    def reuse(self, window: RewindWindow) -> None:
        """The batches of ``window`` (dropped) are the spares now (the earlier spares go)."""
        self._free = {}
        seen: set[int] = set()
        for step in window.steps:
            for t in iter_tensors([step.inputs, step.target]):
                if id(t) not in seen and t.layout == torch.strided:
                    seen.add(id(t))
                    self._free.setdefault((tuple(t.shape), t.dtype), []).append(t)


class StateCopy:
    """Host copies of a list of tensors, allocated once and refilled in place while the
    tensors keep their shapes and dtypes (``allocations`` counts the allocations).

    ``cuda``: the copies are pinned and filled on a side stream (``non_blocking``), the
    ``volatile`` tensors (buffers the next forward writes) on the current stream, ordered
    before it; :attr:`done` is the event to wait for."""

    def __init__(self, *, cuda: bool = False) -> None:
        self.cuda = cuda
        self.buffers: list[torch.Tensor] = []
        self.allocations = 0
        self._nbytes = 0
        self.done: Any = None  # torch.cuda.Event of the last CUDA copy
        self.held = True  # the current stream waits for it
        self._signature: list[tuple[tuple[int, ...], torch.dtype]] = []
        self._stream: Any = None

    @property
    def nbytes(self) -> int:
        """The bytes of the copies."""
        return self._nbytes

    def fill(self, steady: list[torch.Tensor], volatile: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copy ``steady + volatile`` into the buffers (reallocated only when a shape or
        dtype changed); the buffers, in that order."""
        sources = steady + volatile
        signature = [(tuple(t.shape), t.dtype) for t in sources]
        if signature != self._signature:
            self.buffers = [
                torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.cuda)
                for t in sources
            ]
            self._signature = signature
            self._nbytes = sum(b.numel() * b.element_size() for b in self.buffers)
            self.allocations += 1
        with torch.no_grad():
            if self.cuda:
                self._fill_cuda(steady, volatile)
            elif sources:
                torch._foreach_copy_(self.buffers, sources)
        return self.buffers

    def _fill_cuda(self, steady: list[torch.Tensor], volatile: list[torch.Tensor]) -> None:
        main = torch.cuda.current_stream()
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        n = len(steady)
        for dst, src in zip(self.buffers[n:], volatile):  # ordered before the next forward
            dst.copy_(src, non_blocking=True)
        side = self._stream
        side.wait_stream(main)  # the optimizer step's writes come first
        with torch.cuda.stream(side):
            for dst, src in zip(self.buffers[:n], steady):
                dst.copy_(src, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(side)
        self.held = False

    def wait(self) -> None:
        """Block the host until the last copy is complete (CUDA; nothing on the CPU)."""
        if self.done is not None:
            self.done.synchronize()

    def hold(self) -> None:
        """Make the current CUDA stream wait for the last copy (once per copy): the
        update that follows writes the tensors it reads."""
        if self.done is not None and not self.held:
            torch.cuda.current_stream().wait_event(self.done)
            self.held = True
