"""The ``rng`` field of a snapshot: an :class:`~nbdebug.core.state.RngState` as plain
data (tensors, ints, floats) and back."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ..state import RngState

__all__ = ["rng_from_payload", "rng_to_payload"]


def rng_to_payload(rng: RngState) -> dict[str, Any]:
    """An :class:`RngState` as plain data (tensors, ints, floats): the ``rng`` field."""
    name, keys, pos, has_gauss, cached = rng.numpy
    version, state, gauss_next = rng.python
    return {
        "torch": rng.torch_cpu.clone(),
        "cuda": [t.clone() for t in rng.cuda] if rng.cuda is not None else None,
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": [int(version), [int(v) for v in state], gauss_next],
    }


def rng_from_payload(d: Mapping[str, Any]) -> RngState:
    """The inverse of :func:`rng_to_payload`."""
    npd = d["numpy"]
    keys = np.asarray(npd["keys"].numpy(), dtype=np.uint32)
    version, state, gauss_next = d["python"]
    return RngState(
        torch_cpu=d["torch"].to(torch.uint8).cpu(),
        cuda=[t.to(torch.uint8).cpu() for t in d["cuda"]] if d.get("cuda") is not None else None,
        numpy=(
            str(npd["name"]),
            keys,
            int(npd["pos"]),
            int(npd["has_gauss"]),
            float(npd["cached_gaussian"]),
        ),
        python=(int(version), tuple(int(v) for v in state), gauss_next),
    )
