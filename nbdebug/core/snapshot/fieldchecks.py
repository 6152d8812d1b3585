"""The checks of snapshot fields beyond their types (the ``check=`` of a
:class:`~nbdebug.core.snapshot.format.Field`): each raises ``ValueError("what is wrong")``,
read after "is corrupt: "."""

from __future__ import annotations

import datetime as _dt
from typing import Any

import torch

from ..state import RngState
from ..text import first_line
from .rngdata import rng_from_payload
from .tensorref import TensorRef


def check_time(value: Any) -> None:
    try:
        _dt.datetime.fromtimestamp(float(value))
    except (ValueError, OverflowError, OSError) as e:
        raise ValueError(f"its time stamp {value!r} is not a date ({e})") from e


def check_reason(value: dict[str, Any]) -> None:
    if not isinstance(value.get("kind"), str) or not isinstance(value.get("message"), str):
        raise ValueError("its reason lacks a 'kind' and a 'message' string")


def check_model_state(value: dict[Any, Any]) -> None:
    bad = [
        k
        for k, v in value.items()
        if not isinstance(k, str) or not isinstance(v, (torch.Tensor, TensorRef))
    ]
    if bad:
        raise ValueError(f"model_state entries {bad[:5]} are not named tensors")


def check_optimizer(value: dict[str, Any] | None) -> None:
    if value is not None and not isinstance(value.get("param_groups"), list):
        raise ValueError("its optimizer state has no param_groups list")


def check_rng(value: dict[str, Any] | None) -> None:
    if value is None:
        return
    try:
        st = rng_from_payload(value)
        st.cuda = None
        caller = RngState.capture()
        try:
            st.restore()  # the only full check of the generators' own formats
        finally:
            caller.restore()
    except Exception as e:
        raise ValueError(f"its RNG state cannot be read ({first_line(e)})") from e


def check_history(value: list[Any]) -> None:
    if not all(isinstance(h, dict) for h in value):
        raise ValueError("history rows are not dictionaries")


def check_recipe(value: dict[str, Any] | None) -> None:
    if value is not None and (
        not isinstance(value.get("factory"), str) or not isinstance(value.get("kwargs"), dict)
    ):
        raise ValueError("its recipe is not {'factory': str, 'kwargs': dict}")


def check_autocast(value: dict[str, Any] | None) -> None:
    if value is None:
        return
    if (
        not isinstance(value.get("device_type"), str)
        or not isinstance(value.get("dtype"), str)
        or not isinstance(value.get("backward", False), bool)
    ):
        raise ValueError(
            "its autocast state is not {'device_type': str, 'dtype': str[, 'backward': bool]}"
        )


def check_module_training(value: dict[Any, Any]) -> None:
    bad = [k for k, v in value.items() if not isinstance(k, str) or not isinstance(v, bool)]
    if bad:
        raise ValueError(f"maps submodule names to bools; got {bad[0]!r}: {value[bad[0]]!r}")
