"""core/options.py: the one home of "an entry point's keyword options", and every public
entry point that takes ``**options`` refusing an unknown name through it."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, dataclass, field

import pytest
import torch

import nbdebug
from nbdebug.core.options import grouped_options, options_from, refuse_unknown


@dataclass(frozen=True)
class Inner:
    alpha: float = 0.05
    beta: int = 3


@dataclass(frozen=True)
class Outer:
    inner: Inner = field(default_factory=Inner)
    seed: int = 0


def test_flat_options_are_built_and_frozen() -> None:
    o = options_from(Inner, {"beta": 5}, where="f()")
    assert o == Inner(beta=5)
    with pytest.raises(FrozenInstanceError):
        o.beta = 6  # type: ignore[misc]
    assert options_from(Inner, {}, where="f()", base=o) is o
    assert options_from(Inner, {"alpha": 0.1}, where="f()", base=o) == Inner(0.1, 5)


def test_an_unknown_name_is_one_sentence_with_the_closest_name_and_all_names() -> None:
    with pytest.raises(TypeError) as e:
        options_from(Inner, {"betta": 1}, where="f()", also=("x",))
    msg = str(e.value)
    assert msg.startswith("f() got an unexpected keyword argument 'betta' (did you mean 'beta'?)")
    assert msg.endswith("its keyword arguments are: x, alpha, beta.")
    with pytest.raises(TypeError, match=r"'zzz'; its keyword arguments are: alpha, beta\.$"):
        refuse_unknown(["zzz"], ["alpha", "beta"], where="f()")


def test_a_base_of_another_type_is_refused() -> None:
    with pytest.raises(TypeError, match="options must be a Inner; got Outer"):
        options_from(Inner, {}, where="f()", base=Outer())  # type: ignore[type-var]


def test_grouped_options_put_each_name_in_its_group() -> None:
    o = grouped_options(Outer(), {"inner": Inner}, {"beta": 9, "seed": 2}, where="g()")
    assert o == Outer(inner=Inner(beta=9), seed=2)
    with pytest.raises(TypeError, match=r"'inner'.*alpha, beta|'gamma'"):
        grouped_options(Outer(), {"inner": Inner}, {"gamma": 1}, where="g()")


@pytest.mark.parametrize(
    "call",
    [
        lambda: nbdebug.NaNGuard(torch.nn.Linear(2, 2), patiense=3),
        lambda: nbdebug.gradcheck(torch.sin, torch.zeros(2, dtype=torch.float64), epz=1e-6),
        lambda: nbdebug.check(torch.nn.Linear(2, 2), inputs=torch.zeros(1, 2), los_fn=None),
        lambda: nbdebug.find_label_issues([0, 1], pred_probs=[[0.9, 0.1], [0.2, 0.8]], methd="x"),
        lambda: nbdebug.diagnose(torch.nn.Linear(2, 2), torch.zeros(1, 2), stepz=2),
    ],
    ids=["NaNGuard", "gradcheck", "check", "find_label_issues", "diagnose"],
)
def test_public_entry_points_refuse_a_misspelt_option_with_a_hint(call) -> None:
    with pytest.raises(TypeError, match=r"unexpected keyword argument '\w+' \(did you mean"):
        call()
