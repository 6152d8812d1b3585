"""Two recordings compared: the first record whose values differ by more than the dtype
explains (:func:`compare_recordings`), and the result type :class:`ReplayComparison`.

"More than the dtype explains": the norm of the difference over the comparable elements,
relative to the norm of the higher-precision side (or to the largest such norm of the
phase so far, whichever is larger), is above ``k * eps`` (``k`` = :data:`EPS_FACTOR`, or
the caller's ``rtol``). A NaN or Inf where the other side is finite (or the other kind of
non-finite) is always a difference, and so is a shape that differs.

``eps`` is that of the lower of the two *precisions the values were computed in*
(:attr:`~nbdebug.analysis.compare.record.OpRecord.precision`: the coarsest floating dtype
along each value's history), not of the dtypes the values are stored in. A record is judged
by the error it adds, not the error it inherits: ``h.to(torch.float32)`` of a bfloat16
``h``, and the float32 statistics computed from it (the RMSNorm of T5 and LLaMA), hold
bfloat16's rounding, so they are judged at bfloat16's tolerance; a float32 op whose own
inputs were all computed in float32 keeps float32's. A value the lower precision cannot
hold (an overflow to Inf, a NaN) is named whatever the tolerance.

Stand-ins for infinity are the same value in every dtype: ``+inf`` and
``torch.finfo(dtype).max`` of the value's own dtype stand for plus infinity, ``-inf`` and
``torch.finfo(dtype).min`` for minus infinity (the additive attention masks that models
build from ``finfo(dtype).min``). Two elements that are stand-ins of the same sign are
equal, and they count in no norm; a stand-in against an ordinary finite value is compared
as a number (an Inf against it is a difference). NaN on both sides is equal too. The norms
are taken of the values divided by their largest magnitude, so that huge values never
overflow them: the relative difference is never NaN.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ...core.display import show as show_result
from ...core.text import dtype_name, fmt_num
from ...core.vocab import Phase
from .record import MODULE, OP, OpRecord, Recording, coarser, eps_of

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "EPS_FACTOR",
    "Difference",
    "ReplayComparison",
    "compare_recordings",
    "differs",
    "magnitude",
]

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
        What the dtype explains (``k * eps`` of the lower of the precisions the two values
        were computed in, module docs).
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
            parted = any(n.startswith(PART_NOTE) for n in self.notes)
            until = ", up to where their op sequences part (notes)" if parted else ""
            return (
                f"{self.a} vs {self.b}: the {self.compared} {_what(self.level)} agree within "
                f"what the dtypes explain{until}."
            )
        level = "first module output" if d.level == MODULE else "first op"
        return (
            f"{self.a} vs {self.b}: the {level} that differs beyond the dtype is "
            f"{d.where()}: {fmt_num(d.a)} ({d.dtype_a}) vs {fmt_num(d.b)} ({d.dtype_b}), "
            f"{d.reason}."
        )

    def to_frame(self) -> pd.DataFrame:
        """One row per compared record: ``index``, ``phase``, ``level``, ``module``,
        ``op``, ``source``, ``relative``, ``tolerance``, ``precision_a``, ``precision_b``
        (the dtypes each side's value was computed in, which set the tolerance),
        ``differs``."""
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
    x: torch.Tensor,
    y: torch.Tensor,
    rtol: float | None,
    floor: float = 0.0,
    precision: tuple[torch.dtype | None, torch.dtype | None] = (None, None),
) -> tuple[str, float, float, int]:
    """``(reason, relative, tolerance, element)``: reason ``""`` when ``x`` and ``y`` agree
    within the lower precision's ``rtol`` (default ``EPS_FACTOR * eps``), relative to the
    higher-precision side's norm or ``floor`` (the magnitude of the values of that phase so
    far), whichever is larger. ``precision``: the dtypes ``x`` and ``y`` were computed in
    (module docs; default, and never finer than, their own dtypes)."""
    pa, pb = coarser(precision[0], x.dtype), coarser(precision[1], y.dtype)
    tol = rtol if rtol is not None else EPS_FACTOR * max(eps_of(pa), eps_of(pb))
    if x.shape != y.shape:
        return f"shapes {tuple(x.shape)} vs {tuple(y.shape)}", float("inf"), tol, -1
    a, b = x.double().flatten(), y.double().flatten()
    mismatch = _non_finite_mismatch(a, b, x.dtype, y.dtype)
    if mismatch is not None:
        return mismatch[0], float("inf"), tol, mismatch[1]
    ordinary = a.isfinite() & b.isfinite() & ~_same_stand_in(a, b, x.dtype, y.dtype)
    da, db = a[ordinary], b[ordinary]
    s = max(_largest(da), _largest(db))
    if s == 0.0:  # nothing to compare, or zeros on both sides
        return "", 0.0, tol, -1
    da, db = da / s, db / s  # |values| <= 1: no norm below can overflow
    ref = db if eps_of(pb) <= eps_of(pa) else da
    diff = (da - db).abs()
    denominator = max(float(torch.linalg.vector_norm(ref)), floor / s, _TINY)
    rel = float(torch.linalg.vector_norm(diff)) / denominator
    if rel <= tol:
        return "", rel, tol, -1
    i = int(ordinary.nonzero().flatten()[int(diff.argmax())])
    computed = (pa if eps_of(pa) >= eps_of(pb) else pb) if rtol is None else None
    why = f"relative difference {rel:.1e} > {tol:.1e}"
    if computed is not None and computed not in (x.dtype, y.dtype):
        why += f" (the values were computed in {dtype_name(computed)})"
    return why, rel, tol, i


_TINY = float(torch.finfo(torch.float64).tiny)


def _stand_in(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where ``v`` (``dtype``'s values as float64) holds a stand-in for infinity: an Inf or
    its dtype's extreme finite value."""
    if not dtype.is_floating_point:
        return v.isinf()
    return v.isinf() | (v.abs() == float(torch.finfo(dtype).max))


def _same_stand_in(a: torch.Tensor, b: torch.Tensor, da: torch.dtype, db: torch.dtype) -> Any:
    """Where both sides stand for the same infinity (module docs)."""
    return _stand_in(a, da) & _stand_in(b, db) & (a.sign() == b.sign())


def _non_finite_mismatch(
    a: torch.Tensor, b: torch.Tensor, da: torch.dtype, db: torch.dtype
) -> tuple[str, int] | None:
    """``(reason, element)`` of the first NaN or Inf the other side does not share."""
    bad = a.isnan() != b.isnan()
    if bool(bad.any()):
        return "NaN vs finite", int(bad.nonzero()[0])
    sa, sb = _stand_in(a, da), _stand_in(b, db)
    bad = (a.isinf() & ~sb) | (b.isinf() & ~sa)
    if bool(bad.any()):
        return "Inf vs finite", int(bad.nonzero()[0])
    bad = (a.isinf() | b.isinf()) & sa & sb & (a.sign() != b.sign())
    if bool(bad.any()):
        return "Inf of the other sign", int(bad.nonzero()[0])
    return None


def _largest(v: torch.Tensor) -> float:
    return float(v.abs().max()) if v.numel() else 0.0


def magnitude(t: torch.Tensor) -> float:
    """The norm of the ordinary finite elements of ``t`` (no stand-ins for infinity),
    taken without overflow (inf only when the norm itself is past float64's range)."""
    v = t.double().flatten()
    v = v[v.isfinite() & ~_stand_in(v, t.dtype)]
    s = _largest(v)
    return s * float(torch.linalg.vector_norm(v / s)) if s > 0.0 else 0.0


def compare_recordings(
    ra: Recording, rb: Recording, rtol: float | None
) -> tuple[Difference | None, int, list[str], list[dict[str, Any]]]:
    """The first difference of two recordings, how many records were compared, notes, and
    one row per compared record. Op records are compared when both replays have them
    (in call order, as long as the two sequences name the same ops, :class:`_Pairing`),
    module records otherwise."""
    notes: list[str] = []
    level = OP if not (ra.compiled or rb.compiled) else MODULE
    if level == MODULE:
        which = ra.label if ra.compiled else rb.label
        notes.append(
            f"{which} ran compiled: the ops inside its graph are not visible, so the replays "
            "are compared at module boundaries (each module's output, then the gradients)"
        )
    xs, ys = _aligned(ra.records, level, notes), _aligned(rb.records, level, notes)
    pairing = _Pairing(xs, ys, (ra.label, rb.label))
    rows: list[dict[str, Any]] = []
    largest: dict[Phase, float] = {}  # the largest norm of each phase so far (ref side)
    found: Difference | None = None
    for i, (x, y) in enumerate(pairing.pairs()):
        floor = largest.get(x.phase, 0.0)
        reason, rel, tol, at = differs(x.value, y.value, rtol, floor, (x.precision, y.precision))
        ref = y.value if eps_of(y.precision) <= eps_of(x.precision) else x.value
        largest[x.phase] = max(floor, magnitude(ref))
        rows.append(_row(i, (x, y), rel, tol, bool(reason)))
        if reason:
            found = _difference(i, x, y, (reason, rel, tol, at))
            break
    notes.extend(pairing.notes())
    return found, len(rows), notes, rows


#: how far ahead :class:`_Pairing` looks for the two sequences to meet again, and how
#: many records must then agree in name
LOOKAHEAD, RESYNC = 16, 4
#: how the note of two replays whose op sequences part for good begins
PART_NOTE = "the replays part at record"


class _Pairing:
    """The records of two replays, paired in call order. Code that branches on the dtype
    (``if x.dtype == torch.float16: x = x.to(...)``, as T5 does) makes a few records on
    one side only: where the names part, the shortest run of one side's records (at most
    :data:`LOOKAHEAD`) after which :data:`RESYNC` names agree again is skipped and noted;
    where no such run exists, nothing after it is compared."""

    def __init__(self, xs: list[OpRecord], ys: list[OpRecord], labels: tuple[str, str]) -> None:
        self.xs, self.ys, self.labels = xs, ys, labels
        self.skipped: tuple[list[OpRecord], list[OpRecord]] = ([], [])
        self.parted: str | None = None

    def pairs(self) -> Iterator[tuple[OpRecord, OpRecord]]:
        i = j = 0
        while i < len(self.xs) and j < len(self.ys):
            if self.xs[i].key() != self.ys[j].key():
                skip = self._resync(i, j)
                if skip is None:
                    x, y = self.xs[i], self.ys[j]
                    self.parted = (
                        f"{PART_NOTE} {i}: {x.op} in {x.module!r} vs {y.op} in "
                        f"{y.module!r}; nothing after it is compared"
                    )
                    return
                self.skipped[0].extend(self.xs[i : i + skip[0]])
                self.skipped[1].extend(self.ys[j : j + skip[1]])
                i, j = i + skip[0], j + skip[1]
            yield self.xs[i], self.ys[j]
            i, j = i + 1, j + 1

    def _resync(self, i: int, j: int) -> tuple[int, int] | None:
        """``(records of a, records of b)`` to skip for the names to agree again."""
        for d in range(1, LOOKAHEAD + 1):
            for da, db in ((d, 0), (0, d)):
                n = min(RESYNC, len(self.xs) - i - da, len(self.ys) - j - db)
                xs, ys = self.xs[i + da : i + da + n], self.ys[j + db : j + db + n]
                if n > 0 and all(x.key() == y.key() for x, y in zip(xs, ys)):
                    return da, db
        return None

    def notes(self) -> list[str]:
        out = []
        for label, records in zip(self.labels, self.skipped):
            if records:
                r = records[0]
                out.append(
                    f"{len(records)} record(s) that only the {label} replay makes were "
                    f"skipped (code that branches on the configuration; the first: {r.op} "
                    f"in {r.module!r})"
                )
        return out + ([self.parted] if self.parted else [])


def _aligned(records: list[OpRecord], level: str, notes: list[str]) -> list[OpRecord]:
    if level == MODULE:
        return [r for r in records if r.level == MODULE]
    # op by op in the forward and the loss; the gradients are module records
    return [r for r in records if r.level == OP or r.phase is Phase.BACKWARD]


def _row(
    i: int, pair: tuple[OpRecord, OpRecord], rel: float, tol: float, bad: bool
) -> dict[str, Any]:
    r = pair[0]
    return {
        "index": i,
        "phase": str(r.phase),
        "level": r.level,
        "module": r.module,
        "op": r.op,
        "source": r.source,
        "relative": rel,
        "tolerance": tol,
        "precision_a": dtype_name(pair[0].precision),
        "precision_b": dtype_name(pair[1].precision),
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
        dtype_a=dtype_name(x.value.dtype),
        dtype_b=dtype_name(y.value.dtype),
        relative=rel,
        tolerance=tol,
        reason=reason,
    )
