"""Checkpoint checks: :func:`check_state_dict` compares a ``state_dict`` with a model
before ``load_state_dict`` (which it never calls)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...core.batch import check_model
from ...core.stats import count_nonfinite
from ...core.text import count_text, dtype_name
from .base import Finding, Findings, sort_findings
from .codes import CheckCode

_PREFIXES = ("module.", "_orig_mod.", "model.")


def check_state_dict(model: torch.nn.Module, state_dict: Mapping[str, object]) -> Findings:
    """Compare ``state_dict`` with ``model.state_dict()`` without loading it.

    Parameters
    ----------
    model : torch.nn.Module
        Read only.
    state_dict : mapping of str to Tensor
        A checkpoint (e.g. ``torch.load(path, weights_only=True)``); nothing in it is changed.

    Returns
    -------
    Findings (a list of Finding)
        ``state_dict_mismatch`` (error): missing keys, unexpected keys and shape changes,
        listed (with a hint when a ``module.`` / ``_orig_mod.`` prefix explains them);
        ``dtype_downcast`` (warning): floating tensors stored in a narrower float dtype
        than the model's (float16/bfloat16 into float32), with the largest round-off the
        narrower dtype implies (half a unit in the last place of the largest value), and
        how many values fell to 0 or to subnormals; ``nonfinite_weight`` (error): NaN/Inf
        stored in the checkpoint.

    Raises
    ------
    TypeError
        ``model`` is not a module or ``state_dict`` is not a mapping.
    """
    check_model(model)
    if not isinstance(state_dict, Mapping):
        raise TypeError(
            f"state_dict must be a mapping of parameter names to tensors (model.state_dict()); got "
            f"{type(state_dict).__qualname__}."
        )
    own = model.state_dict()
    sd = {k: v for k, v in state_dict.items() if isinstance(k, str)}
    out = _mismatch(own, sd)
    for k, v in sd.items():
        w = own.get(k)
        if not isinstance(v, torch.Tensor) or not isinstance(w, torch.Tensor):
            continue
        if v.is_floating_point() or v.is_complex():
            out += _nonfinite_tensor(k, v)
        if v.is_floating_point() and w.is_floating_point():
            out += _downcast(k, v, w)
    return sort_findings(out)


def _mismatch(own: Mapping[str, object], sd: Mapping[str, object]) -> list[Finding]:
    """``state_dict_mismatch``: missing and unexpected keys, shape changes."""
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own and not k.endswith("._extra_state")]
    shapes = {}
    for k in own:
        a, b = sd.get(k), own[k]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape != b.shape:
            shapes[k] = [list(a.shape), list(b.shape)]
    if not (missing or unexpected or shapes):
        return []
    hint, fix = _prefix_hint(list(own), list(sd))
    parts = []
    if missing:
        parts.append(
            f"{len(missing)} missing ({', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''})"
        )
    if unexpected:
        parts.append(
            f"{len(unexpected)} unexpected "
            f"({', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''})"
        )
    if shapes:
        k0 = next(iter(shapes))
        parts.append(
            f"{len(shapes)} shape change(s) ({k0}: checkpoint "
            f"{tuple(shapes[k0][0])} vs model {tuple(shapes[k0][1])})"
        )
    evidence = {
        "missing": missing,
        "unexpected": unexpected,
        "shapes": shapes,
        "n_missing": len(missing),
        "n_unexpected": len(unexpected),
        "n_shape": len(shapes),
        "threshold": 0,
    }
    advice = hint or (
        "the checkpoint does not fit this model: load it into the architecture it was saved "
        "from, or load with strict=False only for keys you expect to differ (and "
        "re-initialise them)."
    )
    first = next(iter(missing or list(shapes)), None)
    code = CheckCode.STATE_DICT_MISMATCH
    return [Finding(code, "error", "; ".join(parts), evidence, advice, fix=fix, param=first)]


def _nonfinite_tensor(k: str, v: torch.Tensor) -> list[Finding]:
    """``nonfinite_weight``: NaN/Inf stored in the checkpoint."""
    n_nan, n_inf = count_nonfinite(v)
    if not n_nan + n_inf:
        return []
    return [
        Finding(
            CheckCode.NONFINITE_WEIGHT,
            "error",
            f"checkpoint tensor {k}",
            # the keys a live weight's finding has (checks/forward.py)
            {"n_nan": n_nan, "n_inf": n_inf, "numel": v.numel(), "threshold": 0},
            "the checkpoint stores NaN/Inf in this tensor: it was saved "
            "after the run diverged; "
            "load an earlier checkpoint.",
            param=k,
        )
    ]


def _downcast(k: str, v: torch.Tensor, w: torch.Tensor) -> list[Finding]:
    """``dtype_downcast``: a floating tensor stored narrower than the model's."""
    fv, fw = torch.finfo(v.dtype), torch.finfo(w.dtype)
    if fv.bits >= fw.bits and fv.eps <= fw.eps:
        return []
    x = v.detach()
    fin = x[torch.isfinite(x)]
    absmax = float(fin.abs().max()) if fin.numel() else 0.0
    ulp_half = fv.eps / 2
    tiny = fv.tiny
    n_flushed = int((fin.abs() < tiny).sum()) - int((fin == 0).sum()) if fin.numel() else 0
    n_zero = int((fin == 0).sum()) if fin.numel() else 0
    ev: dict[str, Any] = {
        "checkpoint_dtype": dtype_name(v.dtype),
        "model_dtype": dtype_name(w.dtype),
        "max_roundoff": absmax * ulp_half,
        "relative_roundoff": ulp_half,
        "absmax": absmax,
        "n_subnormal": max(n_flushed, 0),
        "n_zero": n_zero,
        "threshold": f"finfo({dtype_name(v.dtype)}).eps / 2 = {ulp_half:.3g}",
    }
    if tuple(w.shape) == tuple(x.shape):
        # when the model already holds these weights at full precision: the actual error
        diff = (w.detach().to(torch.float64) - x.to(torch.float64)).abs()
        fin_d = diff[torch.isfinite(diff)]
        if fin_d.numel() and float(fin_d.max()) <= 2 * max(absmax * ulp_half, tiny):
            ev["max_abs_error_vs_model"] = float(fin_d.max())
    lost = (
        f" and {count_text(ev['n_subnormal'], 'value')} near 0 lost "
        f"{'its' if ev['n_subnormal'] == 1 else 'their'} precision"
        if ev["n_subnormal"]
        else ""
    )
    advice = (
        f"these {ev['model_dtype']} weights come from a {ev['checkpoint_dtype']} checkpoint: "
        f"up to {ev['max_roundoff']:.3g} round-off ({ulp_half:.2g} relative){lost}; save "
        "full-precision checkpoints (master weights) for training."
    )
    where = f"{k}: {ev['checkpoint_dtype']} -> {ev['model_dtype']}"
    return [Finding(CheckCode.DTYPE_DOWNCAST, "warning", where, ev, advice, param=k)]


def _prefix_hint(own: list[str], sd: list[str]) -> tuple[str, str]:
    """(advice, fix) when a wrapper prefix explains the mismatch."""
    for p in _PREFIXES:
        if sd and all(k.startswith(p) for k in sd) and any(k[len(p) :] in own for k in sd):
            return (
                f"every checkpoint key starts with '{p}' (saved from a wrapper such as DDP or "
                "torch.compile): strip it before loading.",
                f"model.load_state_dict({{k.removeprefix('{p}'): v for k, v in sd.items()}})",
            )
        if own and all(k.startswith(p) for k in own) and any(p + k in own for k in sd):
            inner = p.rstrip(".")
            return (
                f"every model key starts with '{p}': load into the wrapped module instead.",
                f"model.{inner}.load_state_dict(sd)",
            )
    return "", ""
