"""Row blame: each batch row's loss and share of the gradient norm at a spike or NaN step
(:func:`row_blame` -> :class:`RowBlame`).

One module per job: :mod:`~.api` (:func:`row_blame`), :mod:`~.scope` (which parameters,
the memory rule), :mod:`~.grads` (per-row gradients: vmap, a loop, or each row's term of
the batch), :mod:`~.rows` (a batch cut into rows), :mod:`~.join` (labels and drift
joined on dataset indices), :mod:`~.result` (:class:`RowBlame`), :mod:`~.options`
(:class:`BlameOptions`).
"""

from .api import row_blame
from .grads import BlameMethod
from .options import BlameOptions
from .result import RowBlame

__all__ = ["BlameMethod", "BlameOptions", "RowBlame", "row_blame"]
