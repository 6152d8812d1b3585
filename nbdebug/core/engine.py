"""The quick pass's statistics engine: every measured tensor's row in one preallocated
float64 buffer per device, read on the host once per trace.

A row is ``[sum, sum of squares, min, max, histogram counts, zeros, NaN/Inf, sample
size]`` (``ROW_LEN`` columns, the compiled kernel's layout); :func:`rows_to_vectors`
turns rows into the statistics vectors of :mod:`.stats`. With the compiled kernel
(:mod:`.kernels`) a dense CPU tensor's row is written straight into its buffer row, and
many tensors (the parameter gradients) in one call that spreads them over torch's
intra-op threads. Any other tensor (no kernel, ``NBDEBUG_KERNELS=eager``, CUDA, not
dense) keeps its eager parts (:func:`.measure.quick_parts`) on its device until
:meth:`QuickEngine.host_rows`, which writes them into their rows with device ops, then
reads each device's buffer once: one host read per device and trace.

>>> eng = QuickEngine(kernels.compiled())
>>> a, b = eng.measure(x), eng.measure(y)     # measurement ids, nothing read yet
>>> eng.host_rows()[a]                         # x's statistics vector (VECTOR_LEN)
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from .measure import (
    FLOATING,
    QuickParts,
    eager_rows,
    flat_view,
    kernel_args,
    quick_parts,
    rescue_tiny_norms,
    rows_to_vectors,
)
from .stats import HIST_BINS, as_real

__all__ = ["ROW_LEN", "QuickEngine", "RowBuffer"]

#: columns of a row: sum, sum of squares, min, max, then the histogram's ``HIST_BINS + 3``
ROW_LEN = 4 + HIST_BINS + 3


class RowBuffer:
    """Float64 rows of ``ROW_LEN`` columns on one device, handed out in order; the
    storage doubles when full (rows already written are copied along).

    Parameters
    ----------
    device : torch.device
        Where the rows live (the measured tensors' device).
    capacity : int, optional
        Rows allocated at first (default 256).
    """

    def __init__(self, device: torch.device, *, capacity: int = 256) -> None:
        if capacity < 1:
            raise ValueError(f"RowBuffer expects a capacity of at least 1, got {capacity}")
        self.data = torch.empty((capacity, ROW_LEN), dtype=torch.float64, device=device)
        self.used = 0

    def take(self, n: int = 1) -> int:
        """Hand out ``n`` consecutive rows; return the first one's index."""
        first = self.used
        if first + n > self.data.shape[0]:
            cap = self.data.shape[0]
            while cap < first + n:
                cap *= 2
            grown = torch.empty((cap, ROW_LEN), dtype=torch.float64, device=self.data.device)
            grown[:first].copy_(self.data[:first])
            self.data = grown
        self.used = first + n
        return first

    def host(self) -> np.ndarray:
        """The rows handed out, on the host: a view on CPU, one transfer otherwise."""
        return self.data[: self.used].cpu().numpy()


class QuickEngine:
    """The statistics of one quick pass: one row per measurement (see the module
    docstring). ``kernel``: the compiled kernel's module, or None for eager ops."""

    def __init__(self, kernel: ModuleType | None) -> None:
        self.kernel = kernel
        self._buffers: dict[torch.device, RowBuffer] = {}
        # per measurement: its buffer (None: an empty tensor), its row and its numel
        self._buf: list[RowBuffer | None] = []
        self._row: list[int] = []
        self._numel: list[int] = []
        self._eager: dict[int, QuickParts] = {}  # measurement -> eager parts on its device

    def __len__(self) -> int:
        return len(self._row)

    def _buffer(self, device: torch.device) -> RowBuffer:
        buf = self._buffers.get(device)
        if buf is None:
            buf = self._buffers[device] = RowBuffer(device)
        return buf

    def _real(self, t: torch.Tensor) -> torch.Tensor:
        # a floating strided tensor is read as it is (no detached copy of the tensor object)
        return t if t.layout == torch.strided and t.dtype in FLOATING else as_real(t)

    def _add(self, buf: RowBuffer | None, row: int, numel: int) -> int:
        self._buf.append(buf)
        self._row.append(row)
        self._numel.append(numel)
        return len(self._row) - 1

    def measure(self, t: torch.Tensor) -> int:
        """Measure ``t`` into a new row (no host sync); return the measurement's id."""
        x = self._real(t)
        n = x.numel()
        if n == 0:
            return self._add(None, -1, 0)
        buf = self._buffer(x.device)
        mid = self._add(buf, buf.take(), n)
        if self.kernel is not None and x.device.type == "cpu":
            flat = x if x.is_contiguous() else flat_view(x.detach())
            if flat is not None:
                self.kernel.quick_stats_row(flat, buf.data, self._row[mid], *kernel_args())
                return mid
        self._eager[mid] = quick_parts(x, None)
        return mid

    def measure_many(self, tensors: list[torch.Tensor | None]) -> list[int]:
        """Measure many tensors (None: nothing, an empty row); with the kernel, the dense
        CPU ones in one call on consecutive rows."""
        kernel = self.kernel
        ids: list[int] = [-1] * len(tensors)
        flats: list[torch.Tensor] = []
        where: list[int] = []
        for i, t in enumerate(tensors):
            if t is None:
                ids[i] = self._add(None, -1, 0)
                continue
            x = self._real(t)
            flat = None
            if kernel is not None and x.device.type == "cpu" and x.numel():
                flat = x if x.is_contiguous() else flat_view(x.detach())
            if flat is None:
                ids[i] = self.measure(x)
            else:
                flats.append(flat)
                where.append(i)
        if kernel is not None and flats:
            buf = self._buffer(torch.device("cpu"))
            first = buf.take(len(flats))
            kernel.quick_stats_into(flats, buf.data, first, *kernel_args())
            for j, i in enumerate(where):
                ids[i] = self._add(buf, first + j, flats[j].numel())
        return ids

    def host_rows(self) -> np.ndarray:
        """Every measurement's statistics vector (``VECTOR_LEN`` columns), one row per
        measurement id: the eager parts written into their rows on their devices, then
        one host read per device."""
        rows = np.zeros((len(self._row), ROW_LEN))
        live = [i for i, b in enumerate(self._buf) if b is not None]
        for buf in self._buffers.values():
            self._fill_eager(buf)
            mine = [i for i in live if self._buf[i] is buf]
            if mine:
                rows[mine] = buf.host()[[self._row[i] for i in mine]]
        dead = [i for i, b in enumerate(self._buf) if b is None]
        out = rows_to_vectors(rows, self._numel, dead)
        eager = sorted(self._eager)
        if eager:
            rescue_tiny_norms([self._eager[i] for i in eager], eager, out)
        return out

    def _fill_eager(self, buf: RowBuffer) -> None:
        """Write the eager parts of ``buf``'s measurements into their rows (device ops,
        one group per dtype: see :func:`.measure.eager_rows`)."""
        groups: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}
        for i, parts in self._eager.items():
            if self._buf[i] is buf:
                groups.setdefault((parts[0].dtype, parts[-1].dtype), []).append(i)
        for mids in groups.values():
            index = torch.tensor([self._row[i] for i in mids], device=buf.data.device)
            buf.data.index_copy_(0, index, eager_rows([self._eager[i] for i in mids]))
