"""Two recordings compared: the first record whose values differ by more than the dtype
explains (:func:`compare_recordings`), and the result type :class:`ReplayComparison`.

"More than the dtype explains": the norm of the difference over the finite elements,
relative to the norm of the higher-precision side, is above ``k * eps`` of the
lower-precision side's dtype (``k`` = :data:`EPS_FACTOR`, or the caller's ``rtol``); a NaN
or Inf where the other side is finite (or the other kind of non-finite) is always a
difference, and so is a shape that differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...core.display import show as show_result
from ...core.text import fmt_num
from ...core.vocab import Phase
from .record import MODULE, OP, OpRecord, Recording

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["EPS_FACTOR", "Difference", "ReplayComparison", "compare_recordings", "differs"]

#: the relative difference a dtype explains, in units of its machine epsilon
EPS_FACTOR = 16.0


@dataclass(frozen=True)
class Difference:
    """The first record where the two replays differ.

    Attributes
    ----------
    index : int
        Its place among the compared records.
    phase : Phase
        forward, loss or backward.
    level : str
        ``"op"`` (one torch operation) or ``"module"`` (a module's output or a gradient).
    module, op, source : str, str, str or None
        Where: the innermost module, the operation (``Tensor.div``, ``output``,
        ``grad of weight``) and the user's line (``file.py:line``).
    a, b : float
        Both values at the element that differs most (the first non-finite mismatch).
    dtype_a, dtype_b : str
    relative : float
        The norm of the difference relative to the higher-precision side's (inf for a
        non-finite mismatch).
    tolerance : float
        What the dtype explains (``k * eps``).
    reason : str
        In words: ``"NaN vs finite"``, ``"relative difference 3.1e-01 > 1.6e-02"``.
    """

    index: int
    phase: Phase
    level: str
    module: str
    op: str
    source: str | None
    a: float
    b: float
    dtype_a: str
    dtype_b: str
    relative: float
    tolerance: float
    reason: str

    def where(self) -> str:
        """``Tensor.mul in '2' at model.py:6 (forward)``, ``the output of '1' (forward)``."""
        at = f" at {self.source}" if self.source else ""
        module = repr(self.module) if self.module else "the model"
        if self.op == "output" or self.op.startswith("output["):
            return f"the {self.op} of {module}{at} ({self.phase})"
        return f"{self.op} in {module}{at} ({self.phase})"


@dataclass
class ReplayComparison:
    """What :func:`nbdebug.compare_replays` found.

    Attributes
    ----------
    a, b : str
        The two configurations' names.
    first : Difference or None
        The first record whose values differ beyond the dtype (None: none does).
    level : str
        ``"op"`` when both replays were recorded op by op, ``"module"`` when one was
        compiled (compared at module boundaries).
    compared : int
        How many records were compared.
    notes : list of str
        What limited the comparison (a compiled replay, runs whose op sequences part).
    errors : dict of str to str
        A replay that raised, by name.
    rows : list of dict
        One per compared record (see :meth:`to_frame`).
    recordings : tuple of Recording
        The two replays as recorded: ``recordings[0].save("reference.pt")`` keeps this
        machine's for ``compare_replays(..., b="reference.pt")`` elsewhere.
    """

    a: str
    b: str
    first: Difference | None
    level: str
    compared: int
    notes: list[str] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list, repr=False)
    recordings: tuple[Recording, ...] = field(default=(), repr=False)

    @property
    def ok(self) -> bool:
        """Both replays ran and no record differs beyond what the dtypes explain."""
        return self.first is None and not self.errors

    def summary(self) -> str:
        """One sentence: the first difference, with both values, or that there is none."""
        if self.errors:
            who = ", ".join(f"{k} raised {v}" for k, v in self.errors.items())
            return f"{self.a} vs {self.b}: {who}."
        d = self.first
        if d is None:
            return (
                f"{self.a} vs {self.b}: the {self.compared} {_what(self.level)} agree within "
                "what the dtypes explain."
            )
        level = "first module output" if d.level == MODULE else "first op"
        return (
            f"{self.a} vs {self.b}: the {level} that differs beyond the dtype is "
            f"{d.where()}: {fmt_num(d.a)} ({d.dtype_a}) vs {fmt_num(d.b)} ({d.dtype_b}), "
            f"{d.reason}."
        )

    def to_frame(self) -> pd.DataFrame:
        """One row per compared record: ``index``, ``phase``, ``level``, ``module``,
        ``op``, ``source``, ``relative``, ``tolerance``, ``differs``."""
        import pandas as pd

        return pd.DataFrame(self.rows)

    def show(self, **options: object) -> Any:
        """The panel of this comparison (``ImportError`` until a viewer is registered)."""
        return show_result(self, **options)

    def __repr__(self) -> str:
        return f"ReplayComparison({self.summary().removesuffix('.')})"


def _what(level: str) -> str:
    return (
        "module outputs and gradients" if level == MODULE else "ops, module outputs and gradients"
    )


def differs(
    x: torch.Tensor, y: torch.Tensor, rtol: float | None, floor: float = 0.0
) -> tuple[str, float, float, int]:
    """``(reason, relative, tolerance, element)``: reason ``""`` when ``x`` and ``y`` agree
    within the lower precision's ``rtol`` (default ``EPS_FACTOR * eps``), relative to the
    higher-precision side's norm or ``floor`` (the magnitude of the values of that phase so
    far), whichever is larger."""
    eps = max(_eps(x.dtype), _eps(y.dtype))
    tol = rtol if rtol is not None else EPS_FACTOR * eps
    if x.shape != y.shape:
        return f"shapes {tuple(x.shape)} vs {tuple(y.shape)}", float("inf"), tol, -1
    a, b = x.double().flatten(), y.double().flatten()
    for kind, fa, fb in (("NaN", a.isnan(), b.isnan()), ("Inf", a.isinf(), b.isinf())):
        bad = fa != fb
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            return f"{kind} vs finite", float("inf"), tol, i
    inf_sign = a.isinf() & (a != b)
    if bool(inf_sign.any()):
        return "Inf of the other sign", float("inf"), tol, int(inf_sign.nonzero()[0])
    fin = a.isfinite()
    da, db = a[fin], b[fin]
    ref = db if _eps(y.dtype) <= _eps(x.dtype) else da
    diff = (da - db).abs()
    scale = float(torch.linalg.vector_norm(ref))
    rel = float(torch.linalg.vector_norm(diff)) / max(scale, floor, torch.finfo(torch.float64).tiny)
    if diff.numel() == 0 or rel <= tol:
        return "", rel, tol, -1
    i = int(fin.nonzero().flatten()[int(diff.argmax())])
    return f"relative difference {rel:.1e} > {tol:.1e}", rel, tol, i


def _finite_norm(t: torch.Tensor) -> float:
    v = t.double()
    return float(torch.linalg.vector_norm(v[v.isfinite()]))


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) if dtype.is_floating_point else 0.0


def compare_recordings(
    ra: Recording, rb: Recording, rtol: float | None
) -> tuple[Difference | None, int, list[str], list[dict[str, Any]]]:
    """The first difference of two recordings, how many records were compared, notes, and
    one row per compared record. Op records are compared when both replays have them
    (in call order, as long as the two sequences name the same ops), module records
    otherwise."""
    notes: list[str] = []
    level = OP if not (ra.compiled or rb.compiled) else MODULE
    if level == MODULE:
        which = ra.label if ra.compiled else rb.label
        notes.append(
            f"{which} ran compiled: the ops inside its graph are not visible, so the replays "
            "are compared at module boundaries (each module's output, then the gradients)"
        )
    xs, ys = _aligned(ra.records, level, notes), _aligned(rb.records, level, notes)
    rows: list[dict[str, Any]] = []
    magnitude: dict[Phase, float] = {}  # the largest norm of each phase so far (ref side)
    for i, (x, y) in enumerate(zip(xs, ys)):
        if x.key() != y.key():
            notes.append(
                f"the replays part at record {i}: {x.op} in {x.module!r} vs {y.op} in "
                f"{y.module!r}; nothing after it is compared"
            )
            break
        reason, rel, tol, at = differs(x.value, y.value, rtol, magnitude.get(x.phase, 0.0))
        ref = y.value if _eps(y.value.dtype) <= _eps(x.value.dtype) else x.value
        magnitude[x.phase] = max(magnitude.get(x.phase, 0.0), _finite_norm(ref))
        rows.append(_row(i, x, rel, tol, bool(reason)))
        if reason:
            return _difference(i, x, y, (reason, rel, tol, at)), len(rows), notes, rows
    return None, len(rows), notes, rows


def _aligned(records: list[OpRecord], level: str, notes: list[str]) -> list[OpRecord]:
    if level == MODULE:
        return [r for r in records if r.level == MODULE]
    # op by op in the forward and the loss; the gradients are module records
    return [r for r in records if r.level == OP or r.phase is Phase.BACKWARD]


def _row(i: int, r: OpRecord, rel: float, tol: float, bad: bool) -> dict[str, Any]:
    return {
        "index": i,
        "phase": str(r.phase),
        "level": r.level,
        "module": r.module,
        "op": r.op,
        "source": r.source,
        "relative": rel,
        "tolerance": tol,
        "differs": bad,
    }


def _difference(
    i: int, x: OpRecord, y: OpRecord, found: tuple[str, float, float, int]
) -> Difference:
    reason, rel, tol, at = found
    fa, fb = x.value.flatten(), y.value.flatten()
    k = at if at >= 0 else 0
    va = float(fa[k]) if fa.numel() > k else float("nan")
    vb = float(fb[k]) if fb.numel() > k else float("nan")
    return Difference(
        index=i,
        phase=x.phase,
        level=x.level,
        module=x.module,
        op=x.op,
        source=x.source or y.source,
        a=va,
        b=vb,
        dtype_a=str(x.value.dtype).removeprefix("torch."),
        dtype_b=str(y.value.dtype).removeprefix("torch."),
        relative=rel,
        tolerance=tol,
        reason=reason,
    )
