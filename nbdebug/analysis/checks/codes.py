"""The check codes: one table (:data:`CODES`), the one home of each code's existence, family,
severities and meaning.

A :class:`~nbdebug.analysis.checks.base.Finding` names its code by a :class:`CheckCode`
member, and its severity must be one the table lists for that code. The table of codes in
the :func:`nbdebug.check` docstring and in ``docs/checks.md`` is generated from
:data:`CODES` (:func:`rst_table`, :func:`markdown_table`; :func:`write_docs` rewrites both),
and ``tests/test_checks.py`` fails when either is stale.

Adding a code: one row at the end of :data:`CODES` (``since``: the version that first
gives it) and a member of :class:`CheckCode`; then ``python -m nbdebug.analysis.checks.codes``
regenerates the two tables.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Literal

from ...core.vocab import Vocab

#: How serious a finding is: ``"error"`` (already non-finite, or will crash), ``"warning"``
#: (a documented threshold was crossed), ``"info"`` (context, or a check that could not apply).
Severity = Literal["error", "warning", "info"]
SEVERITIES: Final[tuple[Severity, ...]] = ("error", "warning", "info")


class CheckCode(Vocab):
    """What a finding found (``Finding.code``); one row of :data:`CODES` each.

    A ``str`` enum: ``CheckCode.DEAD_RELU == "dead_relu"``. Its family, severities,
    one-line meaning and the version it appeared in are in :data:`CODES` (the table that
    ``docs/checks.md`` and the :func:`nbdebug.check` docstring are generated from).

    Examples
    --------
    >>> [f for f in nbdebug.check(tr) if f.code is nbdebug.CheckCode.DEAD_RELU]
    """

    NONFINITE_INPUT = "nonfinite_input"
    LABEL_OUT_OF_RANGE = "label_out_of_range"
    CONSTANT_FEATURE = "constant_feature"
    UNSCALED_INPUT = "unscaled_input"
    EXP_OVERFLOW_RISK = "exp_overflow_risk"
    FP16_OVERFLOW_RISK = "fp16_overflow_risk"
    BF16_PRECISION_LOSS = "bf16_precision_loss"
    DEAD_RELU = "dead_relu"
    SATURATED_ACTIVATION = "saturated_activation"
    LOG_OF_NONPOSITIVE = "log_of_nonpositive"
    DIVISION_BY_ZERO = "division_by_zero"
    NONFINITE_ORIGIN = "nonfinite_origin"
    NONFINITE_WEIGHT = "nonfinite_weight"
    NONFINITE_GRADIENT = "nonfinite_gradient"
    VANISHING_GRADIENT = "vanishing_gradient"
    EXPLODING_GRADIENT = "exploding_gradient"
    UNUSED_PARAMETER = "unused_parameter"
    ADAM_STATE_OUTLIER = "adam_state_outlier"
    LR_SPIKE = "lr_spike"
    LR_SCHEDULE_BOUNDARY = "lr_schedule_boundary"
    GRAD_CLIP_ALWAYS_ON = "grad_clip_always_on"
    GRAD_CLIP_NEVER_ON = "grad_clip_never_on"
    GRAD_SCALER_COLLAPSE = "grad_scaler_collapse"
    STATE_DICT_MISMATCH = "state_dict_mismatch"
    DTYPE_DOWNCAST = "dtype_downcast"
    TRACE_ERROR = "trace_error"
    CHECK_SKIPPED = "check_skipped"


class CheckGroup(Vocab):
    """Which part of the checklist a code belongs to (the module that gives it)."""

    DATA = "data"  # checks/data.py
    FORWARD = "forward"  # checks/origin.py, checks/forward.py
    PRECISION = "precision"  # checks/precision.py
    GRADIENT = "gradient"  # checks/grad.py
    OPTIMIZER = "optimizer"  # checks/optim.py
    CHECKPOINT = "checkpoint"  # checks/state.py (check_state_dict)
    RUN = "run"  # checks/api.py: the check itself (the traced step raised, a check skipped)


@dataclass(frozen=True)
class Code:
    """One row of :data:`CODES`.

    Parameters
    ----------
    code : CheckCode
    family : CheckGroup
    severities : tuple of Severity
        The severities a finding of this code may have, the usual one first.
    meaning : str
        One line: what triggers it, with the threshold.
    since : str
        The nbdebug version that first gives it.
    """

    code: CheckCode
    family: CheckGroup
    severities: tuple[Severity, ...]
    meaning: str
    since: str = "0.1.0"

    def __post_init__(self) -> None:
        bad = [s for s in self.severities if s not in SEVERITIES]
        if not self.severities or bad:
            raise ValueError(f"check code {self.code}: severities must be some of {SEVERITIES}.")


_D, _F, _P, _G = CheckGroup.DATA, CheckGroup.FORWARD, CheckGroup.PRECISION, CheckGroup.GRADIENT
_O, _C, _R = CheckGroup.OPTIMIZER, CheckGroup.CHECKPOINT, CheckGroup.RUN
_E: Severity = "error"
_W: Severity = "warning"
_I: Severity = "info"
C = CheckCode

#: Every check code, in the order of the checklist.
CODES: Final[tuple[Code, ...]] = (
    Code(C.NONFINITE_INPUT, _D, (_E,), "any NaN/Inf in the batch (rows listed)"),
    Code(
        C.LABEL_OUT_OF_RANGE,
        _D,
        (_E,),
        "class label < 0 or >= C outputs (`ignore_index` aside); binary target outside [0, 1]",
    ),
    Code(
        C.CONSTANT_FEATURE,
        _D,
        (_W,),
        "std across the batch <= 1e-6 x max(1, abs(mean)), batch >= 8 rows",
    ),
    Code(C.UNSCALED_INPUT, _D, (_W,), "max - min of a floating input > 1e4"),
    Code(
        C.EXP_OVERFLOW_RISK,
        _F,
        (_E, _W),
        "first Inf made by exp / input to Softmax, or logits into a hand-written loss, above "
        "half the exp limit (44.36 in float32, 5.55 in float16)",
    ),
    Code(
        C.FP16_OVERFLOW_RISK,
        _F,
        (_E, _W),
        "first Inf made in float16 / float16 activations above 0.5 x 65504 (float32 ones too "
        "with a GradScaler)",
    ),
    Code(
        C.BF16_PRECISION_LOSS,
        _P,
        (_W,),
        "a bfloat16 module output whose std < 2**-8 x abs(mean), or a loss computed in bfloat16",
    ),
    Code(C.DEAD_RELU, _F, (_W,), "share of exact zeros after a ReLU > 0.9"),
    Code(
        C.SATURATED_ACTIVATION,
        _F,
        (_W,),
        "tanh/sigmoid outputs within 1e-3 of the bounds for > 50% of elements (a lower bound "
        "from the recorded statistics)",
    ),
    Code(
        C.LOG_OF_NONPOSITIVE,
        _F,
        (_E, _W),
        "first NaN/Inf made by log/sqrt (input <= 0, or sqrt'(0)) / probabilities of 0 or 1 "
        "into binary_cross_entropy",
    ),
    Code(C.DIVISION_BY_ZERO, _F, (_E,), "first NaN/Inf made by a division"),
    Code(C.NONFINITE_ORIGIN, _F, (_E,), "any other first NaN/Inf"),
    Code(C.NONFINITE_WEIGHT, _F, (_E,), "a parameter, buffer or checkpoint tensor holding NaN/Inf"),
    Code(C.NONFINITE_GRADIENT, _G, (_E,), "parameters whose gradient holds NaN/Inf (listed)"),
    Code(
        C.VANISHING_GRADIENT,
        _G,
        (_W,),
        "grad/weight norm ratio < 1e-5 (weights with ndim >= 2, embeddings aside)",
    ),
    Code(
        C.EXPLODING_GRADIENT,
        _G,
        (_W,),
        "that ratio > 100, or total grad norm > 10 x the median of the last 100 history rows",
    ),
    Code(C.UNUSED_PARAMETER, _G, (_I,), "no gradient reached a parameter that requires grad"),
    Code(
        C.ADAM_STATE_OUTLIER,
        _O,
        (_E, _W),
        "float16 `exp_avg_sq` zeros with an eps that rounds to 0 in float16 / a moment's RMS "
        "> 3 sigma (log10) off its recorded history",
    ),
    Code(
        C.LR_SPIKE,
        _O,
        (_W,),
        "lr grows > 2x between steps from a steady or falling value (not a warm-up)",
    ),
    Code(
        C.LR_SCHEDULE_BOUNDARY,
        _O,
        (_I, _W),
        "warm-up end, decay start, step decay, restart / and the loss rises > 1.5x within 20 steps",
    ),
    Code(C.GRAD_CLIP_ALWAYS_ON, _O, (_W,), "grad norm >= max_norm in > 90% of >= 20 steps"),
    Code(C.GRAD_CLIP_NEVER_ON, _O, (_I,), "grad norm below max_norm in all of >= 20 steps"),
    Code(
        C.GRAD_SCALER_COLLAPSE,
        _O,
        (_W, _E),
        "5 scale decreases in a row or 5 skipped of the last 20 steps / scale < 1",
    ),
    Code(
        C.STATE_DICT_MISMATCH,
        _C,
        (_E,),
        "missing / unexpected keys, shape changes (`check_state_dict`)",
    ),
    Code(
        C.DTYPE_DOWNCAST,
        _C,
        (_W,),
        "float32 weights from a float16/bfloat16 checkpoint (max round-off = eps/2 x largest "
        "value)",
    ),
    Code(
        C.TRACE_ERROR,
        _R,
        (_E,),
        "the model or the loss raised (the partial trace is still checked)",
    ),
    Code(
        C.CHECK_SKIPPED,
        _R,
        (_I,),
        "a check could not apply, and why (no parameters, frozen layers, no optimizer, no "
        "history, no batch, ...)",
    ),
)

#: The row of each code.
BY_CODE: Final[dict[CheckCode, Code]] = {c.code: c for c in CODES}


def _check_table() -> None:
    missing = [c for c in CheckCode if c not in BY_CODE]
    if missing or len(BY_CODE) != len(CODES):
        raise ValueError(f"every CheckCode needs exactly one row of CODES; missing {missing}.")


_check_table()


def code_of(code: str) -> CheckCode | None:
    """The member for a code string (``None`` for a code that is not in the table)."""
    try:
        return CheckCode(code)
    except ValueError:
        return None


def allowed_severities(code: str) -> tuple[Severity, ...]:
    """The severities a finding of ``code`` may have (all three for an unknown code)."""
    known = code_of(code)
    return BY_CODE[known].severities if known is not None else SEVERITIES


# --------------------------------------------------------------------------- generated docs
_COLUMNS = ("code", "family", "severity", "meaning", "since")


def _cells(c: Code) -> tuple[str, ...]:
    return (c.code.value, c.family.value, " / ".join(c.severities), c.meaning, c.since)


def markdown_table() -> str:
    """The table of codes for ``docs/checks.md``."""
    head = "| " + " | ".join(_COLUMNS) + " |\n|" + "---|" * len(_COLUMNS)
    rows = []
    for c in CODES:
        code, *rest = _cells(c)
        rows.append("| " + " | ".join([f"`{code}`", *rest]) + " |")
    return "\n".join([head, *rows])


def rst_table(indent: str = "    ") -> str:
    """The table of codes for the :func:`nbdebug.check` docstring (an RST simple table)."""
    width = [20, 10, 15, 38, 5]
    rule = indent + "  ".join("=" * w for w in width)
    lines = [rule, indent + "  ".join(h.ljust(w) for h, w in zip(_COLUMNS, width)).rstrip(), rule]
    for c in CODES:
        code, family, sev, meaning, since = _cells(c)
        text = textwrap.wrap(meaning.replace("`", "``"), width[3]) or [""]
        first = [code.ljust(width[0]), family.ljust(width[1]), sev.ljust(width[2])]
        lines.append(indent + "  ".join([*first, text[0].ljust(width[3]), since]).rstrip())
        pad = " " * (sum(width[:3]) + 6)
        lines += [indent + pad + t for t in text[1:]]
    lines.append(rule)
    return "\n".join(lines)


#: The generated part of a file lies between these two lines.
BEGIN, END = "<!-- check codes: generated by nbdebug.analysis.checks.codes -->", "<!-- end -->"
_RST_BEGIN, _RST_END = "    .. check codes (generated by nbdebug.analysis.checks.codes)", "    .."


def _replace(text: str, begin: str, end: str, table: str) -> str:
    pattern = re.compile(re.escape(begin) + r"\n.*?\n" + re.escape(end) + r"\n", re.S)
    if not pattern.search(text):
        raise ValueError(f"no generated section ({begin!r} ... {end!r}) found.")
    return pattern.sub(lambda _: f"{begin}\n\n{table}\n\n{end}\n", text, count=1)


def generated(text: str, kind: Literal["markdown", "docstring"]) -> str:
    """``text`` (``docs/checks.md`` or ``checks/api.py``) with its table of codes regenerated."""
    if kind == "markdown":
        return _replace(text, BEGIN, END, markdown_table())
    return _replace(text, _RST_BEGIN, _RST_END, rst_table())


def doc_files(root: Path) -> dict[Path, Literal["markdown", "docstring"]]:
    """The files holding a generated table, in a checkout at ``root``."""
    return {
        root / "docs" / "checks.md": "markdown",
        root / "nbdebug" / "analysis" / "checks" / "api.py": "docstring",
    }


def write_docs(root: Path) -> list[Path]:
    """Regenerate the tables of codes under ``root``; returns the files that changed."""
    changed = []
    for path, kind in doc_files(root).items():
        text = path.read_text()
        new = generated(text, kind)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


if __name__ == "__main__":  # pragma: no cover
    for p in write_docs(Path(__file__).resolve().parents[3]):
        print(f"rewrote {p}")
