"""How one replay of :func:`nbdebug.compare_replays` runs: :class:`ReplayConfig`.

A configuration is a small frozen value, or a string shorthand: ``"eager"`` (the step as
it is), ``"compile"`` (``torch.compile`` with the inductor back end), ``"float64"``,
``"float32"``, ``"float16"``, ``"bfloat16"`` (the model's floating parameters, buffers and
batch cast to that dtype), or a path to a recording saved with
:meth:`~nbdebug.analysis.compare.record.Recording.save` (the same step recorded on another
machine: the reference).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ReplayConfig", "as_config", "cannot_run"]

_DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ReplayConfig:
    """One way of replaying the step.

    Attributes
    ----------
    dtype : torch.dtype, optional
        Cast the model's floating parameters and buffers, and the batch's floating tensors,
        to this dtype, without autocast. ``None``: the step as it ran, in the model's own
        dtypes and under the autocast state a snapshot recorded.
    compile : bool
        Run the model through ``torch.compile(model, backend=backend)``. The operations
        inside a compiled graph are not visible one by one: such a replay is compared at
        module boundaries (each module's output).
    backend : str
        The ``torch.compile`` back end (``"inductor"``; ``"eager"``/``"aot_eager"`` run the
        graph capture without code generation).
    reference : str or Path, optional
        A saved recording to compare with instead of running the step (the step as another
        machine ran it).
    name : str
        How results name this replay (default: made from the fields).
    """

    dtype: torch.dtype | None = None
    compile: bool = False
    backend: str = "inductor"
    reference: str | Path | None = None
    name: str = ""

    @property
    def label(self) -> str:
        """The name results use: ``name`` or one made from the fields."""
        if self.name:
            return self.name
        if self.reference is not None:
            return f"reference {Path(self.reference).name}"
        parts = []
        if self.compile:
            parts.append("compile" if self.backend == "inductor" else f"compile[{self.backend}]")
        if self.dtype is not None:
            parts.append(str(self.dtype).removeprefix("torch."))
        return "+".join(parts) or "eager"


def as_config(value: ReplayConfig | str | os.PathLike[str], option: str) -> ReplayConfig:
    """A :class:`ReplayConfig` from itself or a shorthand (module docs); a ValueError that
    names ``option`` and the shorthands for anything else."""
    if isinstance(value, ReplayConfig):
        return value
    if isinstance(value, os.PathLike) or (isinstance(value, str) and value.endswith(".pt")):
        return ReplayConfig(reference=Path(value))
    if isinstance(value, str):
        if value == "eager":
            return ReplayConfig(name="eager")
        if value == "compile":
            return ReplayConfig(compile=True, name="compile")
        if value in _DTYPES:
            return ReplayConfig(dtype=_DTYPES[value], name=value)
    raise ValueError(
        f"{option}={value!r} is not a replay configuration: give a ReplayConfig, one of "
        f"'eager', 'compile', {', '.join(repr(k) for k in _DTYPES)}, or the path of a saved "
        "recording ('reference.pt')."
    )


def cannot_run(config: ReplayConfig, device: torch.device) -> str | None:
    """Why ``config`` cannot run on ``device`` here, in one sentence; None when it can."""
    if config.reference is not None:
        path = Path(config.reference)
        return None if path.is_file() else f"the reference recording {str(path)!r} does not exist"
    if config.dtype is not None:
        reason = _dtype_problem(config.dtype, device)
        if reason:
            return reason
    if config.compile:
        return _compile_problem(config.backend, device)
    return None


def _dtype_problem(dtype: torch.dtype, device: torch.device) -> str | None:
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        return f"{name} is not supported by {torch.cuda.get_device_name(device)}"
    try:
        a = torch.ones(2, 2, dtype=dtype, device=device)
        (a @ a).sum().item()
    except (RuntimeError, TypeError) as e:
        return f"{name} cannot run on {device}: {str(e).splitlines()[0]}"
    return None


def _compile_problem(backend: str, device: torch.device) -> str | None:
    try:
        import torch._dynamo as dynamo
    except ImportError as e:  # pragma: no cover - a torch built without dynamo
        return f"torch.compile is not available in this PyTorch build ({e})"
    try:
        dynamo.eval_frame.check_if_dynamo_supported()
    except RuntimeError as e:
        return f"torch.compile cannot run here: {e}"
    if backend not in dynamo.list_backends(exclude_tags=()):
        known = ", ".join(dynamo.list_backends(exclude_tags=()))
        return f"the torch.compile back end {backend!r} is not installed (known: {known})"
    if backend == "inductor" and device.type == "cpu":
        cxx = os.environ.get("CXX", "")
        if not any(shutil.which(c) for c in (cxx, "c++", "g++", "clang++") if c):
            return (
                "the inductor back end needs a C++ compiler on CPU and none was found "
                "(set CXX, or install g++ or clang++)"
            )
    return None
