"""The result of :func:`nbdebug.row_blame`: :class:`RowBlame`, and the rules it reads
the per-row values with (the heaviest rows, robust outliers, the summary sentence)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core.display import show as show_result
from ...core.text import count_text
from .grads import BlameMethod

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

__all__ = ["LISTED", "OUTLIER_Z", "RowBlame", "heaviest", "outliers"]

#: rows named one by one in the summary; a longer set is counted ("26 of 32 rows")
LISTED = 8
#: a row is an outlier when its modified z-score (Iglewicz and Hoaglin: 0.6745 times the
#: distance to the median over the median absolute deviation) of the gradient norm is above
OUTLIER_Z = 3.5
#: rows of the table that ``show()`` and ``_repr_html_`` list (the largest shares first)
SHOWN = 20


def heaviest(share: np.ndarray, fraction: float) -> tuple[list[int], float]:
    """The fewest rows whose shares add up to at least ``fraction`` (the largest first),
    and their sum; non-finite shares are left out."""
    ok = np.flatnonzero(np.isfinite(share))
    if not len(ok) or not share[ok].sum() > 0:
        return [], 0.0
    order = ok[np.argsort(-share[ok], kind="stable")]
    total = np.cumsum(share[order])
    k = int(np.searchsorted(total, fraction - 1e-12)) + 1
    k = min(k, len(order))
    return [int(r) for r in order[:k]], float(total[k - 1])


def outliers(norm: np.ndarray) -> list[int]:
    """Rows whose finite gradient norm lies far above the others' (:data:`OUTLIER_Z`);
    with a zero median absolute deviation, every row above the median."""
    ok = np.flatnonzero(np.isfinite(norm))
    if len(ok) < 3:
        return []
    med = float(np.median(norm[ok]))
    mad = float(np.median(np.abs(norm[ok] - med)))
    if mad == 0:
        return [int(r) for r in ok if norm[r] > med]
    z = 0.6745 * (norm[ok] - med) / mad
    return [int(r) for r in ok[z > OUTLIER_Z]]


def _and(items: Sequence[object]) -> str:
    words = [str(i) for i in items]
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


@dataclass(repr=False)
class RowBlame:
    """What :func:`nbdebug.row_blame` found: each batch row's loss and share of the
    gradient norm.

    Attributes
    ----------
    rows : int
        The batch size.
    loss, grad_norm : numpy.ndarray
        float64 ``(rows,)``: each row's loss and the norm of its gradient over the blamed
        parameters (NaN or inf where not finite).
    share : numpy.ndarray
        float64 ``(rows,)``: ``grad_norm`` over the sum of the finite ones (NaN for a row
        whose norm is not finite); the finite shares add up to 1.
    ids : list of int or None
        The dataset index of each row (``ids=``, or the snapshot's ``ids`` field).
    heavy : list of int
        The fewest batch rows whose shares add up to at least ``fraction``, largest first.
    carried : float
        Their combined share.
    outliers : list of int
        Rows whose gradient norm is far above the others' (modified z-score above 3.5).
    nonfinite : list of int
        Rows whose gradient norm (first) or loss is not finite.
    fraction : float
    method : BlameMethod
        ``"vmap"``, ``"loop"`` or ``"in_batch"`` (:mod:`nbdebug.analysis.blame.grads`).
    layer : str
        The module whose parameters were blamed (``""``: the whole model).
    scope : str
        Which parameters, and why (the memory rule), in words.
    joined : pandas.DataFrame or None
        Columns joined from ``labels=`` and ``drift=``, one row per batch row.
    step : int or None
    kind : str or None
        The snapshot's kind (``"spike"``, ``"loss"``, ...), ``None`` for a model and batch.
    notes : list of str

    Examples
    --------
    >>> blame = nbdebug.row_blame(snap)
    >>> blame.summary()
    'rows 17 and 203 carry 81% of the gradient norm (2 of 32 rows).'
    >>> blame.to_frame().sort_values("share", ascending=False).head()
    """

    loss: np.ndarray
    grad_norm: np.ndarray
    share: np.ndarray
    ids: list[int] | None
    heavy: list[int]
    carried: float
    outliers: list[int]
    nonfinite: list[int]
    fraction: float
    method: BlameMethod
    layer: str
    scope: str
    joined: pd.DataFrame | None = None
    step: int | None = None
    kind: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """The batch size."""
        return len(self.loss)

    @property
    def ok(self) -> bool:
        """Every row is finite and none carries a share far above the others'."""
        return not self.nonfinite and not self.outliers

    def names(self, rows: Sequence[int], of: int | None = None) -> str:
        """Batch rows as the summary names them: ``"rows 3 and 5"``, ``"samples 17 and
        203 (batch rows 3 and 5)"`` with dataset ids, ``"26 of 32 rows"`` when long (``of``:
        the rows counted, default all)."""
        rows = list(rows)
        if len(rows) > LISTED:
            return f"{len(rows)} of {of if of is not None else self.rows} rows"
        noun = "row" if len(rows) == 1 else "rows"
        if self.ids is None:
            return f"{noun} {_and(rows)}"
        ids = [self.ids[r] for r in rows]
        return f"sample{'s' if len(rows) > 1 else ''} {_and(ids)} (batch {noun} {_and(rows)})"

    def summary(self) -> str:
        """One sentence: the non-finite rows first, then the fewest rows carrying at least
        ``fraction`` of the gradient norm."""
        bad = [r for r in self.nonfinite if not math.isfinite(self.grad_norm[r])]
        lead = ""
        if bad:
            kinds = "NaN" if all(math.isnan(self.grad_norm[r]) for r in bad) else "non-finite"
            verb = "has a" if len(bad) == 1 else "have"
            grads = "gradient" if len(bad) == 1 else "gradients"
            lead = f"{self.names(bad)} {verb} {kinds} {grads}"
            if len(bad) == self.rows:
                return f"{lead}: no share of the gradient norm to compare."
            lead += f"; of the other {count_text(self.rows - len(bad), 'row')}, "
        if not self.heavy:
            return f"{lead}no row has a gradient (every row's gradient norm is 0)."
        of = self.rows - len(bad)
        listed = f" ({len(self.heavy)} of {of} rows)" if len(self.heavy) <= LISTED else ""
        verb = "carries" if len(self.heavy) == 1 else "carry"
        pct = f"{100 * self.carried:.0f}%"
        return f"{lead}{self.names(self.heavy, of)} {verb} {pct} of the gradient norm{listed}."

    def to_frame(self) -> pd.DataFrame:
        """One row per batch row (index ``row``): ``id`` (the dataset index, ``<NA>`` when
        not known), ``loss``, ``grad_norm``, ``share``, ``outlier`` and the columns joined
        from ``labels=`` / ``drift=``."""
        import pandas as pd

        ids = self.ids if self.ids is not None else [None] * self.rows
        df = pd.DataFrame(
            {
                "id": pd.array(ids, dtype="Int64"),
                "loss": self.loss,
                "grad_norm": self.grad_norm,
                "share": self.share,
                "outlier": np.isin(np.arange(self.rows), self.outliers),
            },
            index=pd.RangeIndex(self.rows, name="row"),
        )
        if self.joined is not None:
            df = df.join(self.joined)
        return df

    def show(self, **options: object) -> object:
        """The table with the summary sentence (a panel the widgets layer registers)."""
        return show_result(self, **options)

    def _repr_html_(self) -> str:
        from html import escape

        df = self.to_frame().sort_values("share", ascending=False, na_position="first")
        table = df.head(SHOWN).to_html(border=0, float_format=lambda v: f"{v:.3g}")
        more = self.rows - SHOWN
        tail = f"<p>{more} more rows: blame.to_frame()</p>" if more > 0 else ""
        notes = "".join(f"<li>{escape(n)}</li>" for n in [self.scope, *self.notes])
        return f"<p>{escape(self.summary())}</p>{table}{tail}<ul>{notes}</ul>"

    def __repr__(self) -> str:
        at = f"step {self.step}, " if self.step is not None else ""
        kind = f"{self.kind}, " if self.kind else ""
        return f"RowBlame({at}{kind}{self.rows} rows, {self.method}: {self.summary()})"


def blame_result(loss: np.ndarray, norm: np.ndarray, fraction: float, **fields: Any) -> RowBlame:
    """A :class:`RowBlame` of the per-row values (``fields``: its other attributes)."""
    finite = np.isfinite(norm)
    total = norm[finite].sum()
    share = np.full(len(norm), np.nan)
    share[finite] = norm[finite] / total if total > 0 else 0.0
    heavy, carried = heaviest(share, fraction)
    bad_grad = [int(r) for r in np.flatnonzero(~finite)]
    bad_loss = [int(r) for r in np.flatnonzero(finite & ~np.isfinite(loss))]
    return RowBlame(
        loss=loss,
        grad_norm=norm,
        share=share,
        heavy=heavy,
        carried=carried,
        outliers=outliers(norm),
        nonfinite=bad_grad + bad_loss,
        fraction=fraction,
        **fields,
    )
