"""Gradcheck result types: :class:`PairCheck` (one (output, input) pair) and
:class:`GradcheckResult` (all of them), with their text, table and display.

Jacobians are stored as ``(rows, cols)`` numpy arrays with ``J[r, c] = d out[rows[r]] /
d in[cols[c]]`` (flat indices into the output and the input).
"""

from __future__ import annotations

import html
import math
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core.display import show as show_result
from .verdicts import BACKWARD_WRONG, OK, SEVERITY, Verdict

if TYPE_CHECKING:
    import pandas as pd


@dataclass(repr=False)
class PairCheck:
    """The check of one (output, input) pair.

    Attributes
    ----------
    output, input : str
        Names: ``"output"``, ``"output[0]"``; ``"input[1]"`` or a parameter name.
    analytic, numerical : numpy.ndarray, float64, shape (R, C)
        ``J[r, c] = d output.flat[rows[r]] / d input.flat[cols[c]]`` from the backward and
        from central finite differences. In ``fast`` mode ``R == 1`` and column ``c`` is the
        random projection ``u_c^T J v_c``.
    rows, cols : numpy.ndarray, int64, shapes (R,) and (C,)
        Flat indices into the output and the input that were checked.
    output_shape, input_shape : tuple of int
    order : int
        1, or 2 for the check of the backward itself (``second_order=True``).
    mode : str
        ``"elements"`` or ``"projections"`` (``fast=True``).
    max_abs_error, max_rel_error : float
        ``max |a - n|`` and ``max |a - n| / max(|n|, atol)``.
    worst : tuple of int
        ``(r, c)`` position in the arrays of the element furthest out of tolerance.
    close : bool
        Every checked element satisfies ``|a - n| <= atol + rtol * |n|``.
    verdict : str
        One of :data:`VERDICTS`.
    message : str
        The verdict in words.
    sampled : bool
        Only a random subset of the input's (or output's) elements was checked.
    native_dtype : str or None
        The inputs' own dtype when it is not float64.
    native_max_abs_error : float or None
        The same check run in that dtype.
    """

    output: str
    input: str
    analytic: np.ndarray
    numerical: np.ndarray
    rows: np.ndarray
    cols: np.ndarray
    output_shape: tuple[int, ...]
    input_shape: tuple[int, ...]
    order: int = 1
    mode: str = "elements"
    atol: float = 1e-5
    rtol: float = 1e-3
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    worst: tuple[int, int] = (0, 0)
    close: bool = True
    verdict: Verdict = OK
    message: str = ""
    sampled: bool = False
    native_dtype: str | None = None
    native_max_abs_error: float | None = None

    def __repr__(self) -> str:
        return (
            f"PairCheck({self.label!r}, verdict={self.verdict!r}, "
            f"max_abs_error={self.max_abs_error:.3g}, checked={self.analytic.shape})"
        )

    @property
    def label(self) -> str:
        """``"d output / d input[1]"`` (``"2nd order: ..."`` for ``order == 2``)."""
        text = f"d {self.output} / d {self.input}"
        return f"2nd order: {text}" if self.order == 2 else text

    @property
    def difference(self) -> np.ndarray:
        """``|analytic - numerical|``, shape (R, C)."""
        return np.abs(self.analytic - self.numerical)

    @property
    def worst_output_index(self) -> tuple[int, ...] | None:
        """Index into the output of the worst element (``None`` in fast mode)."""
        if self.mode != "elements" or self.analytic.size == 0:
            return None
        return element_index(int(self.rows[self.worst[0]]), self.output_shape)

    @property
    def worst_input_index(self) -> tuple[int, ...] | None:
        """Index into the input of the worst element (``None`` in fast mode)."""
        if self.mode != "elements" or self.analytic.size == 0:
            return None
        return element_index(int(self.cols[self.worst[1]]), self.input_shape)

    @property
    def ok(self) -> bool:
        """No evidence that the backward is wrong."""
        return self.verdict != BACKWARD_WRONG


@dataclass(repr=False)
class GradcheckResult:
    """What :func:`gradcheck` found.

    Attributes
    ----------
    pairs : list of PairCheck
        One per (output, input) pair; second-order pairs (``order == 2``) after them.
    fn_name : str
    wrt : str
        ``"inputs"``, ``"params"`` or ``"both"``.
    eps, atol, rtol : float
    dtype : str
        The dtype the check ran in (``"float64"`` unless ``fn`` does not run in it).
    fast : bool
        Random projections instead of elements.
    second_order : bool
    sampled : bool
        Some input or output had more than ``max_elements`` elements and only a seeded
        random subset was checked (see :attr:`notes`).
    notes : list of str
    seconds : float
    second_order_error : str or None
        Why the second-order check could not run (a backward that is not differentiable).
    """

    pairs: list[PairCheck]
    fn_name: str = "fn"
    wrt: str = "inputs"
    eps: float = 1e-6
    atol: float = 1e-5
    rtol: float = 1e-3
    dtype: str = "float64"
    fast: bool = False
    second_order: bool = False
    sampled: bool = False
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    second_order_error: str | None = None

    @property
    def ok(self) -> bool:
        """True when no backward was found wrong: every pair agrees, or disagrees only at a
        non-differentiable point or by float precision (see each pair's verdict)."""
        return self.second_order_error is None and all(p.ok for p in self.pairs)

    @property
    def verdict(self) -> str:
        """The most serious verdict over all pairs."""
        if self.second_order_error is not None:
            return BACKWARD_WRONG
        return max((p.verdict for p in self.pairs), key=SEVERITY.__getitem__, default=OK)

    @property
    def worst(self) -> PairCheck | None:
        """The pair with the most serious verdict (ties: the largest error)."""
        if not self.pairs:
            return None
        return max(self.pairs, key=lambda p: (SEVERITY[p.verdict], _nan_big(p.max_abs_error)))

    @property
    def failures(self) -> list[PairCheck]:
        """Pairs whose backward is wrong."""
        return [p for p in self.pairs if p.verdict == BACKWARD_WRONG]

    @property
    def max_abs_error(self) -> float:
        return max((p.max_abs_error for p in self.pairs), key=_nan_big, default=0.0)

    @property
    def message(self) -> str:
        """The verdict in words (of the worst pair)."""
        if self.second_order_error is not None:
            return self.second_order_error
        w = self.worst
        return w.message if w is not None else "ok: nothing to check."

    def summary(self) -> str:
        """One sentence: the verdict, the pairs checked and the worst one."""
        n = len(self.pairs)
        head = f"gradcheck of {self.fn_name}: {self.verdict}"
        if self.second_order_error is not None:
            return f"{head} (the second order cannot be checked), {n} pairs checked."
        w = self.worst
        if w is None:
            return f"{head}, nothing to check."
        if w.verdict == OK:
            return f"{head}, {n} pairs agree (max abs error {self.max_abs_error:.2g})."
        return f"{head} at {w.label} (max abs error {w.max_abs_error:.2g}), {n} pairs checked."

    def pair(
        self, output: str | None = None, input: str | None = None, *, order: int = 1
    ) -> PairCheck:
        """The pair with these names (``None`` matches any)."""
        for p in self.pairs:
            if p.order == order and output in (None, p.output) and input in (None, p.input):
                return p
        have = [p.label for p in self.pairs]
        raise KeyError(
            f"no pair with output={output!r}, input={input!r}, order={order}; pairs: {have}."
        )

    def to_frame(self) -> pd.DataFrame:
        """One row per pair: order, output, input, verdict, close, errors, the worst element's
        indices and values, what was checked, and the message."""
        import pandas as pd

        rows = []
        for p in self.pairs:
            r, c = p.worst
            has = p.analytic.size > 0
            rows.append(
                {
                    "order": p.order,
                    "output": p.output,
                    "input": p.input,
                    "verdict": p.verdict,
                    "close": p.close,
                    "max_abs_error": p.max_abs_error,
                    "max_rel_error": p.max_rel_error,
                    "worst_output": p.worst_output_index
                    if p.mode == "elements"
                    else f"projection {c}",
                    "worst_input": p.worst_input_index
                    if p.mode == "elements"
                    else f"projection {c}",
                    "analytic": float(p.analytic[r, c]) if has else math.nan,
                    "numerical": float(p.numerical[r, c]) if has else math.nan,
                    "checked": checked_text(p),
                    "native_max_abs_error": p.native_max_abs_error,
                    "message": p.message,
                }
            )
        return pd.DataFrame(rows)

    def show(self, *, backend: str | None = None) -> Any:
        """The gradcheck panel for this result (an ``ipywidgets`` widget)."""
        return show_result(self, backend=backend)

    def __repr__(self) -> str:
        n1 = sum(p.order == 1 for p in self.pairs)
        n2 = len(self.pairs) - n1
        head = f"GradcheckResult(ok={self.ok}, verdict={self.verdict!r}, {n1} pairs"
        if n2:
            head += f" + {n2} second-order"
        w = self.worst
        if w is not None and w.verdict != OK:
            head += f", worst: {w.label!r} (max abs error {w.max_abs_error:.3g})"
        return head + (", sampled" if self.sampled else "") + f", {self.seconds:.2f}s)"

    def _repr_html_(self) -> str:
        head = (
            f"<p><b>gradcheck of {html.escape(self.fn_name)}</b>: {html.escape(self.message)}</p>"
        )
        frame = self.to_frame().drop(columns=["message"])
        return head + frame.to_html(index=False)

    def _repr_mimebundle_(self, include: object = None, exclude: object = None) -> dict[str, Any]:
        # in a kernel, displaying the result shows the panel; elsewhere text and a table
        bundle: dict[str, Any] = {"text/plain": repr(self), "text/html": self._repr_html_()}
        if _in_kernel():
            try:
                widget = self.show()
                bundle.update(widget._repr_mimebundle_())
                bundle["text/plain"] = repr(self)
            except ImportError:
                pass
        return bundle


def element_index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index into a tensor of ``shape`` of its flat element ``flat`` (``()`` for a
    scalar)."""
    if not shape:
        return ()
    return tuple(int(v) for v in np.unravel_index(flat, shape))


def checked_text(p: PairCheck) -> str:
    """What was checked of a pair: ``"3 of 12 outputs x 5 of 5 inputs"`` or ``"4 random
    projections"``."""
    if p.mode == "projections":
        return f"{p.analytic.shape[1]} random projections"
    n_out = int(np.prod(p.output_shape)) if p.output_shape else 1
    n_in = int(np.prod(p.input_shape)) if p.input_shape else 1
    return f"{p.rows.size} of {n_out} outputs x {p.cols.size} of {n_in} inputs"


def _nan_big(v: float) -> float:
    return math.inf if math.isnan(v) else v


def _in_kernel() -> bool:
    ip_mod = sys.modules.get("IPython")
    if ip_mod is None:
        return False
    ip = ip_mod.get_ipython()  # type: ignore[attr-defined]
    return ip is not None and getattr(ip, "kernel", None) is not None
