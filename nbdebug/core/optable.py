"""The torch operations by family: one table, read by the checks (which cause an origin's
root op names) and by diagnose (which operations an epsilon or a clamp can fix).

An operation is looked up by its key (:func:`base_name`: ``"Tensor.__truediv__"`` ->
``"truediv"``, ``"torch.nn.functional.softmax"`` -> ``"softmax"``, ``"Tensor.log_"`` ->
``"log"``). Each row says the operation's :class:`OpFamily` and whether it is the
family's plain function of its input (``eps_fixable``): the one that an epsilon added to
its denominator, a clamp of its input, a shift by the row maximum (``exp``) or zeroed
fully masked rows (``softmax``) makes finite without changing what it computes.
``log1p``, ``cosh`` or ``fmod`` are in their families (a log, an exp and a division go
non-finite in the same way) but are not eps-fixable: clamping ``log1p``'s input at
``eps`` changes its valid negative inputs, and ``exp(x - max)`` is not ``cosh``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from .vocab import Vocab

__all__ = ["OP_TABLE", "OpFamily", "OpRow", "base_name", "op_family", "op_row"]


class OpFamily(Vocab):
    """How an operation makes a non-finite value from finite ones."""

    LOG = "log"  # a log or a log-like function at or below its domain's edge (0, -1, poles)
    SQRT = "sqrt"  # a root of a negative value (its derivative is infinite at 0)
    EXP = "exp"  # an exponential that overflows
    DIV = "div"  # a division by zero
    SOFTMAX = "softmax"  # a softmax over a fully masked row (0/0)
    CAST = "cast"  # a dtype cast whose target cannot hold the value
    MATMUL = "matmul"  # the products and convolutions float16 autocast runs in float16


@dataclass(frozen=True)
class OpRow:
    """One operation of :data:`OP_TABLE`."""

    family: OpFamily
    #: the family's plain function of its input: an epsilon or a clamp fixes it as it is
    eps_fixable: bool = False


def _rows(family: OpFamily, fixable: Iterable[str], other: Iterable[str] = ()) -> dict[str, OpRow]:
    rows = {name: OpRow(family, eps_fixable=True) for name in fixable}
    rows.update({name: OpRow(family) for name in other})
    return rows


#: Operation key (:func:`base_name`) -> its row.
OP_TABLE: Mapping[str, OpRow] = MappingProxyType(
    {
        **_rows(
            OpFamily.LOG,
            ("log", "log2", "log10"),
            ("log1p", "xlogy", "lgamma", "digamma", "acosh"),
        ),
        **_rows(OpFamily.SQRT, ("sqrt", "rsqrt")),
        **_rows(OpFamily.EXP, ("exp", "exp2"), ("expm1", "cosh", "sinh", "ldexp")),
        **_rows(
            OpFamily.DIV,
            (
                "div",
                "truediv",
                "rtruediv",
                "rdiv",
                "itruediv",
                "idiv",
                "true_divide",
                "divide",
                "reciprocal",
            ),
            ("floor_divide", "fmod", "remainder"),
        ),
        **_rows(OpFamily.SOFTMAX, ("softmax", "log_softmax", "scaled_dot_product_attention")),
        **_rows(OpFamily.CAST, (), ("to", "half", "type", "copy", "to_copy")),
        **_rows(
            OpFamily.MATMUL,
            (),
            (
                "linear",
                "matmul",
                "mm",
                "bmm",
                "mv",
                "addmm",
                "addmv",
                "addr",
                "addbmm",
                "baddbmm",
                "einsum",
                "chain_matmul",
                "multi_dot",
                "vecdot",
                "conv1d",
                "conv2d",
                "conv3d",
                "conv_tbc",
                "conv_transpose1d",
                "conv_transpose2d",
                "conv_transpose3d",
                "convolution",
                "prelu",
                "lstm_cell",
                "gru_cell",
                "rnn_tanh_cell",
                "rnn_relu_cell",
            ),
        ),
    }
)


def base_name(op: str | None) -> str:
    """An operation's key: the last dotted part of its name, without a call's arguments
    and without leading or trailing underscores (``"Tensor.__truediv__"`` ->
    ``"truediv"``, ``"Tensor.div_"`` -> ``"div"``, ``"Tensor.div(inf)"`` -> ``"div"``)."""
    if not op:
        return ""
    return op.split("(")[0].strip().rsplit(".", 1)[-1].strip("_")


def op_row(op: str | None) -> OpRow | None:
    """The row of an operation name (any spelling :func:`base_name` reads), or ``None``."""
    return OP_TABLE.get(base_name(op))


def op_family(op: str | None) -> OpFamily | None:
    """The family of an operation name, or ``None`` for an operation of none."""
    row = op_row(op)
    return row.family if row is not None else None
