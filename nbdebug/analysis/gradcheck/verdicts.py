"""Gradcheck verdicts: their names, the tolerance, and how a failing pair is judged and told.

An element passes when ``|analytic - numerical| <= atol + rtol * |numerical|``
(:func:`tolerance`, the one place that rule is written). A pair that fails is re-measured
at its worst columns with a smaller and a larger step and with one-sided differences
(:func:`explain`), which tells apart

* :data:`BACKWARD_WRONG`: the finite differences are stable across steps and the backward
  disagrees with them;
* :data:`NON_DIFFERENTIABLE`: a kink at (or within ``eps`` of) the point;
* :data:`FLOAT32_PRECISION`: the finite-difference error shrinks as the step grows.

Figures and widgets name verdicts through these constants, never as repeated strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol

import numpy as np
import torch

if TYPE_CHECKING:
    from .layout import Layout
    from .problem import Problem

Verdict = Literal["ok", "backward is wrong", "non-differentiable point", "float32 precision"]

OK: Final = "ok"
BACKWARD_WRONG: Final = "backward is wrong"
NON_DIFFERENTIABLE: Final = "non-differentiable point"
FLOAT32_PRECISION: Final = "float32 precision"
#: every verdict a pair can get
VERDICTS: Final[tuple[Verdict, ...]] = (OK, BACKWARD_WRONG, NON_DIFFERENTIABLE, FLOAT32_PRECISION)
#: how serious a verdict is: the worst pair of a result is the most serious one
SEVERITY: Final[dict[str, int]] = {
    OK: 0,
    FLOAT32_PRECISION: 1,
    NON_DIFFERENTIABLE: 2,
    BACKWARD_WRONG: 3,
}
#: the module sweep's verdict for a module it did not check (not a pair verdict)
SKIPPED: Final = "skipped"

#: how many of a failing pair's worst columns are re-checked with other steps
ANALYZED_COLUMNS: Final = 8

# what the re-measurement of one column found, and the verdict each finding gives
_WRONG, _PRECISION, _KINK, _NEAR_KINK, _NOT_FINITE = (
    "wrong",
    "precision",
    "kink",
    "near kink",
    "not finite",
)
_KIND_VERDICT: dict[str, Verdict] = {
    _WRONG: BACKWARD_WRONG,
    _PRECISION: FLOAT32_PRECISION,
    _KINK: NON_DIFFERENTIABLE,
    _NEAR_KINK: NON_DIFFERENTIABLE,
    _NOT_FINITE: NON_DIFFERENTIABLE,
}


class PairCheck(Protocol):
    """What the verdicts read and write of one measured (output, input) pair (the fields of
    :class:`nbdebug.analysis.gradcheck.result.PairCheck`, which the result module defines)."""

    output: str
    input: str
    analytic: np.ndarray
    numerical: np.ndarray
    cols: np.ndarray
    mode: str
    atol: float
    rtol: float
    max_abs_error: float
    max_rel_error: float
    worst: tuple[int, int]
    close: bool
    verdict: Verdict
    message: str

    @property
    def label(self) -> str: ...

    @property
    def worst_output_index(self) -> tuple[int, ...] | None: ...

    @property
    def worst_input_index(self) -> tuple[int, ...] | None: ...


# --------------------------------------------------------------------------- the tolerance


def tolerance(numerical: np.ndarray, atol: float, rtol: float) -> np.ndarray:
    """``atol + rtol * |numerical|``: how far the backward may be from the finite difference.

    Parameters
    ----------
    numerical : numpy.ndarray
        Finite-difference Jacobian entries, any shape.
    atol, rtol : float

    Returns
    -------
    numpy.ndarray
        The allowed ``|analytic - numerical|``, same shape as ``numerical``.
    """
    return atol + rtol * np.abs(numerical)


def out_of_tolerance(
    analytic: np.ndarray, numerical: np.ndarray, atol: float, rtol: float
) -> np.ndarray:
    """The elements that fail, ``~(|analytic - numerical| <= tolerance)`` (NaN fails)."""
    return ~(np.abs(analytic - numerical) <= tolerance(numerical, atol, rtol))


def tolerance_ratio(p: PairCheck) -> np.ndarray:
    """``|a - n| / tolerance`` per element of a pair (``inf`` where the difference is not
    finite); above 1 is out of tolerance. Shape (R, C)."""
    diff = np.abs(p.analytic - p.numerical)
    tol = tolerance(p.numerical, p.atol, p.rtol)
    return np.where(np.isfinite(diff), diff / np.maximum(tol, 1e-300), np.inf)


def index_text(index: tuple[int, ...] | None) -> str:
    """``(1, 2)`` -> ``"[1, 2]"``; ``()`` or ``None`` -> ``""``."""
    if not index:
        return ""
    return "[" + ", ".join(str(i) for i in index) + "]"


# --------------------------------------------------------------------------- first verdict


def score(p: PairCheck) -> None:
    """Fill in a freshly measured pair's errors, worst element, ``close``, and the first
    verdict (``"ok"`` or ``"backward is wrong"``; :func:`explain` refines the latter)."""
    a, n = p.analytic, p.numerical
    if a.size == 0:
        p.message = f"{OK}: {p.label} has no elements to check."
        return
    diff = np.abs(a - n)
    ratio = tolerance_ratio(p)
    r, c = np.unravel_index(int(np.argmax(ratio)), a.shape)
    p.worst = (int(r), int(c))
    p.max_abs_error = float(np.max(np.where(np.isnan(diff), np.inf, diff)))
    rel = diff / np.maximum(np.abs(n), max(p.atol, 1e-300))
    p.max_rel_error = float(np.max(np.where(np.isnan(rel), np.inf, rel)))
    p.close = not bool(out_of_tolerance(a, n, p.atol, p.rtol).any())
    p.verdict = OK if p.close else BACKWARD_WRONG
    p.message = (
        f"{OK}: {p.label}: backward and finite differences agree (max abs error "
        f"{p.max_abs_error:.2g})."
        if p.close
        else f"{BACKWARD_WRONG}: {p.label} disagrees (max abs error {p.max_abs_error:.2g})."
    )


def native_precision_message(p: PairCheck, name: str, native_error: float, eps: float) -> str:
    """A pair that passes in float64 but fails in its own dtype ``name``."""
    return (
        f"{FLOAT32_PRECISION}: {p.label} passes in float64 (max abs error {p.max_abs_error:.2g}) "
        f"but fails in {name} (max abs error {native_error:.2g}, eps={eps:g}): rounding in the "
        f"{name} finite differences, not the backward."
    )


# --------------------------------------------------------------------------- re-measuring


@dataclass
class _Column:
    """Re-measurements of one checked column with other steps."""

    n_small: list[np.ndarray]  # per output k, over rows
    n_large: list[np.ndarray]
    left: list[np.ndarray]
    right: list[np.ndarray]


def explain(
    pairs: Sequence[PairCheck],
    lay: Layout,
    problem: Problem,
    xs0: list[torch.Tensor],
    *,
    eps: float,
    no_graph: bool,
) -> None:
    """Re-check the worst columns of every failing pair with other steps and give it its
    final verdict and message (in place)."""
    failing = [p for p in pairs if not p.close]
    if not failing:
        return
    h_small, h_large = eps / 100, eps * 100
    index_of_input = {n: i for i, n in enumerate(problem.names)}
    index_of_output = {n: k for k, n in enumerate(problem.out_names or [])}
    wanted: dict[int, set[int]] = {}
    for p in failing:
        wanted.setdefault(index_of_input[p.input], set()).update(_worst_columns(p))
    measured = {
        (i, c): _remeasure(lay, i, c, eps=eps, h_small=h_small, h_large=h_large)
        for i, cs in wanted.items()
        for c in sorted(cs)
    }
    for p in failing:
        i, k = index_of_input[p.input], index_of_output[p.output]
        kinds = {
            c: _classify(p, c, measured[(i, c)], k, h_small=h_small) for c in _worst_columns(p)
        }
        found = [kind for kind, _ in kinds.values()]
        if _WRONG in found:
            p.verdict = BACKWARD_WRONG
        elif all(f == _PRECISION for f in found):
            p.verdict = FLOAT32_PRECISION
        else:
            p.verdict = NON_DIFFERENTIABLE
        # the worst column of the chosen kind speaks for the pair
        c = next(c for c in _worst_columns(p) if _KIND_VERDICT[kinds[c][0]] == p.verdict)
        kind, info = kinds[c]
        p.worst = (int(info["row"]), c)
        p.message = _message(
            p, kind, info, xs0[i], eps=eps, h_small=h_small, h_large=h_large, no_graph=no_graph
        )


def _remeasure(
    lay: Layout, i: int, c: int, *, eps: float, h_small: float, h_large: float
) -> _Column:
    d = lay.direction(i, c)
    fs_p, fs_m = lay.shifted(i, d, h_small), lay.shifted(i, d, -h_small)
    fp, fm = lay.shifted(i, d, eps), lay.shifted(i, d, -eps)
    fl_p, fl_m = lay.shifted(i, d, h_large), lay.shifted(i, d, -h_large)
    col = _Column([], [], [], [])
    for k in range(len(lay.f0)):
        m0 = lay.measure(k, c, lay.f0[k])
        col.n_small.append(
            (lay.measure(k, c, fs_p[k]) - lay.measure(k, c, fs_m[k])) / (2 * h_small)
        )
        col.n_large.append(
            (lay.measure(k, c, fl_p[k]) - lay.measure(k, c, fl_m[k])) / (2 * h_large)
        )
        col.right.append((lay.measure(k, c, fp[k]) - m0) / eps)
        col.left.append((m0 - lay.measure(k, c, fm[k])) / eps)
    return col


def _worst_columns(p: PairCheck) -> list[int]:
    col_score = tolerance_ratio(p).max(axis=0)
    order = np.argsort(-col_score, kind="stable")
    return [int(c) for c in order[:ANALYZED_COLUMNS] if col_score[c] > 1]


def _classify(
    p: PairCheck, c: int, col: _Column, k: int, *, h_small: float
) -> tuple[str, dict[str, Any]]:
    a_all, n_all = p.analytic[:, c], p.numerical[:, c]
    tol_all = tolerance(n_all, p.atol, p.rtol)
    bad = out_of_tolerance(a_all, n_all, p.atol, p.rtol)
    a, n0, tol = a_all[bad], n_all[bad], tol_all[bad]
    ns, nl = col.n_small[k][bad], col.n_large[k][bad]
    left, right = col.left[k][bad], col.right[k][bad]
    r = int(np.argmax(tolerance_ratio(p)[:, c]))  # the element furthest out in this column
    info: dict[str, Any] = {
        "row": r,
        "a": a_all[r],
        "n": n_all[r],
        "left": col.left[k][r],
        "right": col.right[k][r],
        "ns": col.n_small[k][r],
        "nl": col.n_large[k][r],
    }
    if not all(np.isfinite(v).all() for v in (a, n0, ns, nl, left, right)):
        return _NOT_FINITE, info
    e_s, e_0, e_l = (float(np.max(np.abs(a - v))) for v in (ns, n0, nl))
    info.update(e_s=e_s, e_0=e_0, e_l=e_l)
    if (
        e_s > 3 * e_0
        and e_0 > 3 * e_l
        and bool(np.all(np.abs(a - nl) <= tolerance(nl, p.atol, p.rtol) + 0.1 * e_0))
    ):
        return _PRECISION, info
    if not out_of_tolerance(a, ns, p.atol, p.rtol).any():
        return _NEAR_KINK, info
    jump = np.abs(right - left)
    lo, hi = np.minimum(left, right), np.maximum(left, right)
    between = (a >= lo - tol) & (a <= hi + tol)
    if bool(np.all((jump > tol) & (jump >= 0.25 * np.abs(a - n0)) & between)):
        return _KINK, info
    return _WRONG, info


# --------------------------------------------------------------------------- the text


def _message(
    p: PairCheck,
    kind: str,
    info: dict[str, Any],
    x: torch.Tensor,
    *,
    eps: float,
    h_small: float,
    h_large: float,
    no_graph: bool,
) -> str:
    c = p.worst[1]
    if p.mode == "elements":
        out_at, in_at = index_text(p.worst_output_index), index_text(p.worst_input_index)
        where = f"d {p.output}{out_at} / d {p.input}{in_at}"
        xval = float(x.reshape(-1)[int(p.cols[c])])
        at = f"{p.input}{in_at} = {xval:.4g}"
    else:
        where = f"{p.label}, random projection {c}"
        at = f"{p.input} (along random direction {c})"
    a, n = float(info["a"]), float(info["n"])
    if kind == _WRONG:
        hint = _wrong_hint(p, no_graph)
        return (
            f"{BACKWARD_WRONG}: {where} is {a:.4g} from the backward but {n:.4g} by finite "
            f"differences (max abs error {p.max_abs_error:.2g} over the pair); the finite "
            f"differences are stable from eps={h_small:g} to {h_large:g}, so the function is "
            "smooth there and the backward is to blame" + (f" — {hint}" if hint else "") + "."
        )
    if kind == _PRECISION:
        return (
            f"{FLOAT32_PRECISION}: at {where} the finite-difference error shrinks as eps grows "
            f"({info['e_s']:.2g} at eps={h_small:g}, {info['e_0']:.2g} at {eps:g}, "
            f"{info['e_l']:.2g} at {h_large:g}): rounding inside {p.output}'s computation, not "
            "the backward."
        )
    if kind == _NEAR_KINK:
        return (
            f"{NON_DIFFERENTIABLE}: a kink lies within eps={eps:g} of {at}: with eps={h_small:g} "
            f"the finite difference ({float(info['ns']):.4g}) agrees with the backward "
            f"({a:.4g}); re-checked with eps={h_small:g} and {h_large:g}."
        )
    if kind == _KINK:
        return (
            f"{NON_DIFFERENTIABLE}: at {at} the function has a kink (one-sided slopes "
            f"{float(info['left']):.4g} and {float(info['right']):.4g} for {where}); the "
            f"backward's {a:.4g} is one of the one-sided values, the central difference "
            f"{n:.4g} averages them; the same at eps={h_small:g} and {h_large:g}."
        )
    return (
        f"{NON_DIFFERENTIABLE}: the function or its derivative is not finite near {at} "
        f"(backward {a:.4g}, finite difference {n:.4g})."
    )


def _wrong_hint(p: PairCheck, no_graph: bool) -> str:
    if no_graph:
        return (
            "the output has no autograd graph at all (fn detaches it, or leaves torch via "
            ".item()/.numpy()/no_grad)"
        )
    a, n = p.analytic, p.numerical
    tol = tolerance(n, p.atol, p.rtol)
    bad = out_of_tolerance(a, n, p.atol, p.rtol)
    if np.all(np.abs(a[bad]) <= p.atol):
        if np.all(np.abs(a) <= p.atol):
            return f"the backward gives no gradient for {p.input} where it should (zero or None)"
        return (
            f"the backward gives 0 at {int(bad.sum())} of {a.size} Jacobian entries for "
            f"{p.input} where the finite difference is not"
        )
    if np.all(np.abs(a + n) <= tol):
        return "the backward has the wrong sign"
    big = np.abs(n) > max(p.atol, 1e-8 * float(np.max(np.abs(n))))
    if big.sum() >= 1:
        q = a[big] / n[big]
        m = float(np.median(q))
        if (
            m != 0
            and np.all(np.abs(q - m) <= 1e-3 * abs(m) + 1e-9)
            and np.all(np.abs(a[~big]) <= tol[~big])
        ):
            return (
                f"the backward is {m:.4g} times the true gradient everywhere (a missing or "
                "extra constant factor)"
            )
    return ""
