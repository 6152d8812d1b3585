"""The health of a model's weights (its parameters and floating buffers) as a step starts:
their norms, their NaN/Inf counts and the modules that own non-finite ones
(:class:`WeightHealth`). :func:`nbdebug.trace` measures it before its first pass: a
non-finite weight sends the step straight to the exact pass, and the norms fill the
parameter table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import numpy as np
import torch

from ..norms import fused_norms
from ..stats import count_nonfinite
from ..text import qualified_name

__all__ = ["WeightHealth", "owned_weights"]


def owned_weights(
    modules: Iterable[tuple[str, torch.nn.Module]],
) -> list[tuple[str, str, torch.Tensor]]:
    """``(module name, qualified name, tensor)`` for every parameter and every floating or
    complex buffer of ``modules`` (``model.named_modules()``), once under each module that
    owns it (a tied tensor under each)."""
    owned: list[tuple[str, str, torch.Tensor]] = []
    for mname, m in modules:
        for pname, p in m._parameters.items():
            if p is not None:
                owned.append((mname, qualified_name(mname, pname), p))
        for bname, b in m._buffers.items():
            if b is not None and (b.is_floating_point() or b.is_complex()):
                owned.append((mname, qualified_name(mname, bname), b))
    return owned


@dataclasses.dataclass
class WeightHealth:
    norms: dict[int, float]  # id(tensor) -> L2 norm
    counts: dict[int, tuple[int, int]]  # id(tensor) -> (NaN, Inf) of the non-finite ones
    bad: dict[str, list[str]]  # module -> its non-finite parameters and buffers

    @classmethod
    def measure(cls, owned: list[tuple[str, str, torch.Tensor]]) -> WeightHealth:
        """The health of the weights in ``owned`` (:func:`owned_weights`), each tensor
        read once (one fused read per device and dtype)."""
        unique: dict[int, torch.Tensor] = {}
        for _, _, t in owned:
            unique.setdefault(id(t), t)
        norms: dict[int, float] = {}
        if unique:
            values = fused_norms([t.detach() for t in unique.values()])
            norms.update(zip(unique, (float(v) for v in values)))
        counts: dict[int, tuple[int, int]] = {}
        bad: dict[str, list[str]] = {}
        for mname, qual, t in owned:
            key = id(t)
            if key not in counts and not np.isfinite(norms[key]):
                counts[key] = count_nonfinite(t)
                if not sum(counts[key]):  # finite, but its squares overflow its dtype
                    norms[key] = float(torch.linalg.vector_norm(t.detach(), dtype=torch.float64))
            if sum(counts.get(key, (0, 0))):
                bad.setdefault(mname, []).append(qual)
        return cls(norms, counts, bad)
