"""``nbdebug.compare_replays``: the failing step replayed twice, under two configurations
(eager vs ``torch.compile``, float16/bfloat16 vs float64, this machine vs a saved
reference), and the first operation whose outputs differ by more than the dtype explains.

``config.py`` is the configuration value and its shorthands, ``record.py`` one recorded
replay, ``result.py`` the comparison and its result type, ``verdict.py`` whether a
compiled model's NaN is the compiler's (:func:`compiler_verdict`).
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.batch import LossFn
from ...core.snapshot import SnapshotError, resolve_step
from ...core.snapshot.load import ModelSource
from ...core.snapshot.resolve import ResolveOptions
from .config import ReplayConfig, as_config, cannot_run
from .record import OpRecord, Recording, autocast_of, record_step
from .result import EPS_FACTOR, Difference, ReplayComparison, compare_recordings
from .verdict import CompilerVerdict, compiler_verdict

__all__ = [
    "EPS_FACTOR",
    "CompilerVerdict",
    "Difference",
    "OpRecord",
    "Recording",
    "ReplayComparison",
    "ReplayConfig",
    "compare_replays",
    "compiler_verdict",
]


def compare_replays(
    source: object,
    inputs: Any = None,
    target: Any = None,
    *,
    a: ReplayConfig | str = "eager",
    b: ReplayConfig | str = "float64",
    loss_fn: LossFn | None = None,
    model: ModelSource | None = None,
    rtol: float | None = None,
) -> ReplayComparison:
    """Replay the step under ``a`` and under ``b`` and name the first operation whose
    outputs differ by more than the dtype explains.

    Parameters
    ----------
    source : Snapshot, str/PathLike, NonFiniteError, torch.nn.Module or tuple
        The step: a snapshot (or its path, with ``model=``), the guard's error, or a model
        followed by its batch (``(model, inputs[, target])`` as well).
    inputs, target : optional
        The batch of a model source, as :func:`nbdebug.trace` takes it.
    a, b : ReplayConfig or str
        The two configurations: a :class:`ReplayConfig` or ``"eager"``, ``"compile"``
        (inductor), ``"float64"``, ``"float32"``, ``"float16"``, ``"bfloat16"``, or the
        path of a recording saved with ``Recording.save`` (``"reference.pt"``).
    loss_fn : callable, optional
        The loss (a snapshot's recorded one by default).
    model : torch.nn.Module or callable, optional
        The architecture of a snapshot path.
    rtol : float, optional
        The relative difference (norm of the difference over the norm of the
        higher-precision side) that counts as a difference; default ``16 * eps`` of the
        lower precision the two values were computed in (a float32 value upcast from
        bfloat16 is judged as bfloat16). A NaN or Inf against a finite value always counts;
        ``finfo(dtype).min``/``max`` and ``-inf``/``inf`` of the same sign on both sides
        (the stand-ins for infinity of attention masks) are equal.

    Returns
    -------
    ReplayComparison
        ``.first`` (module, op, source, phase, both values), ``.ok``, ``.summary()``,
        ``.to_frame()`` (one row per compared record).

    Raises
    ------
    ValueError
        A configuration that cannot run here (a dtype the device does not support, a
        missing compiler back end or C++ compiler), named with the reason, before any
        replay.

    Examples
    --------
    >>> r = nbdebug.compare_replays(model, x, a="float16", b="float64", loss_fn=loss)
    >>> r.first.op, r.first.module, r.first.source, r.first.a, r.first.b
    """
    ca, cb = as_config(a, "a"), as_config(b, "b")
    step = resolve_step(
        source,
        inputs,
        target,
        loss_fn=loss_fn,
        model=model,
        options=ResolveOptions(caller="compare_replays"),
    )
    device = next((p.device for p in step.model.parameters()), torch.device("cpu"))
    for option, config in (("a", ca), ("b", cb)):
        why = cannot_run(config, device)
        if why is None and config.reference is None:
            try:
                autocast_of(step, config)
            except SnapshotError as e:
                why = str(e).rstrip(".")
        if why:
            raise ValueError(f"compare_replays({option}={config.label!r}) cannot run here: {why}.")
    ra, rb = record_step(step, ca), record_step(step, cb)
    errors = {r.label: r.error for r in (ra, rb) if r.error}
    first, compared, notes, rows = compare_recordings(ra, rb, rtol)
    level = "module" if (ra.compiled or rb.compiled) else "op"
    return ReplayComparison(
        ra.label, rb.label, first, level, compared, notes, errors, rows, recordings=(ra, rb)
    )
