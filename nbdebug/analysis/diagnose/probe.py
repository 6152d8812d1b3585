"""The probe: one forward (and loss) of the step with a module (or the loss) watched, for
the fixable operations whose output holds a kind of non-finite value their inputs did not
hold (the epsilon candidates beyond the trace's root op)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...core.batch import named_tensors
from ...core.optable import OpFamily
from ...core.stats import count_nonfinite
from ...core.trace.frames import source_text
from ...core.trace.ops import composite_body
from .menu import Probed
from .rewrite import caller_line, func_family, underflows

__all__ = ["ProbeMode", "nonfinite_kinds"]


def nonfinite_kinds(tensors: Sequence[torch.Tensor]) -> set[str]:
    """Which kinds of non-finite value the tensors hold: a subset of ``{"nan", "inf"}``."""
    k: set[str] = set()
    for t in tensors:
        n_nan, n_inf = count_nonfinite(t)
        if n_nan:
            k.add("nan")
        if n_inf:
            k.add("inf")
    return k


class ProbeMode(torch.overrides.TorchFunctionMode):
    """Records into ``found`` each fixable operation (of ``families``) that makes a new
    kind of non-finite value (or, for ``exp``, an all-zero row), and into ``sites`` the
    filename of every ``"file.py:line"`` that called a fixable operation."""

    def __init__(
        self,
        module: str | None,
        found: list[Probed],
        families: Sequence[OpFamily],
        sites: dict[str, str],
    ):
        super().__init__()
        self.module = module
        self.found = found
        self.families = set(families)
        self.sites = sites

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        fam = func_family(func)
        body = composite_body(func) if fam is None or fam not in self.families else None
        if body is not None:  # F.normalize, attention: the ops inside them, as the trace
            with self:
                return body(*args, **kwargs)
        out = func(*args, **kwargs)
        if fam is None or fam not in self.families:
            return out
        outs = [t for _, t in named_tensors(out) if t.is_floating_point()]
        if not outs:
            return out
        where = caller_line()
        if where is None:
            return out
        src = source_text(*where)
        self.sites.setdefault(src, where[0])
        ins = [t for _, t in named_tensors((args, kwargs)) if t.is_floating_point()]
        made = nonfinite_kinds(outs) - nonfinite_kinds(ins)
        if fam == OpFamily.EXP and underflows(outs[0]):
            made.add("underflow")
        seen = Probed(self.module, fam, src, where[0])
        if made and seen not in self.found:
            self.found.append(seen)
        return out
