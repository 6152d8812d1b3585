"""The op table (nbdebug.core.optable): the one home of which torch operation is a log, an
exp, a division, a cast...; the checks and diagnose read their families from it."""

from __future__ import annotations

import pytest

from nbdebug.analysis.diagnose.rewrite import FAMILIES
from nbdebug.analysis.diagnose.rewrite import op_family as fixable_family
from nbdebug.core.optable import OP_TABLE, OpFamily, base_name, op_family


@pytest.mark.parametrize(
    "op, key",
    [
        ("Tensor.__truediv__", "truediv"),
        ("Tensor.div_", "div"),
        ("torch.nn.functional.softmax", "softmax"),
        ("torch._C._nn.log_softmax", "log_softmax"),
        ("Tensor.div(inf)", "div"),
        ("", ""),
        (None, ""),
    ],
)
def test_an_op_is_looked_up_by_its_base_name(op: str | None, key: str) -> None:
    assert base_name(op) == key


def test_every_op_has_one_family_and_diagnose_fixes_only_eps_fixable_ones() -> None:
    for name, row in OP_TABLE.items():
        assert isinstance(row.family, OpFamily), name
        expected = row.family if row.eps_fixable else None
        assert fixable_family(f"torch.{name}") == expected, name
        if row.eps_fixable:
            assert row.family in FAMILIES, name
    # in their family for the checks, not rewritten by an epsilon fix
    for name, family in [("log1p", "log"), ("cosh", "exp"), ("fmod", "div")]:
        assert op_family(f"torch.{name}") == family
        assert fixable_family(f"torch.{name}") is None
    assert op_family("torch.nn.functional.linear") == OpFamily.MATMUL
    assert op_family("Tensor.half") == OpFamily.CAST
    assert op_family("torch.relu") is None
