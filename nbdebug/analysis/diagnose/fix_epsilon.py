"""The ``epsilon`` fix: an epsilon or a clamp on the root operation, inside one module (or
the loss), and its snippet: the user's source line with the epsilon written in."""

from __future__ import annotations

import ast
import linecache
from collections.abc import Iterator
from contextlib import contextmanager

from ...core.optable import OpFamily
from ...core.vocab import FixKind
from .fix import LOCALITY, Fix, Replay
from .rewrite import FAMILIES, RewriteMode, op_family

__all__ = ["EpsilonFix", "rewrite_line"]

_TEMPLATES: dict[OpFamily, str] = {
    OpFamily.DIV: "x / (d + eps)",
    OpFamily.LOG: "torch.log(x.clamp_min(eps))",
    OpFamily.SQRT: "torch.sqrt(x.clamp_min(eps))",
    OpFamily.EXP: "torch.exp(x - x.amax(dim=-1, keepdim=True))  # or torch.logsumexp / F.softmax",
    OpFamily.SOFTMAX: "p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # fully masked rows -> 0",
}
_CHANGES: dict[OpFamily, str] = {
    OpFamily.DIV: "an epsilon in the denominator of the division",
    OpFamily.LOG: "log(x.clamp_min(eps))",
    OpFamily.SQRT: "sqrt(x.clamp_min(eps))",
    OpFamily.EXP: "exp(x - max)",
    OpFamily.SOFTMAX: "softmax with fully masked rows zeroed",
}
_METHODS = (OpFamily.LOG, OpFamily.SQRT, OpFamily.EXP)


class _Rewriter(ast.NodeTransformer):
    """Writes the epsilon into every operation of ``family`` of a parsed line."""

    def __init__(self, family: OpFamily, eps: float):
        self.family = family
        self.eps = ast.Constant(eps)
        self.done = False

    def visit_BinOp(self, node: ast.BinOp) -> ast.AST:
        self.generic_visit(node)
        div = self.family == OpFamily.DIV and isinstance(node.op, ast.Div)
        if div and not isinstance(node.right, ast.Constant):
            node.right = ast.BinOp(node.right, ast.Add(), self.eps)
            self.done = True
        return node

    def visit_Call(self, node: ast.Call) -> ast.AST:
        self.generic_visit(node)
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if self.family == OpFamily.DIV and name == "normalize":  # F.normalize(x, eps=0): its eps
            node.keywords = [k for k in node.keywords if k.arg != "eps"]
            node.args = node.args[:3]  # input, p, dim (eps is the fourth)
            node.keywords.append(ast.keyword("eps", self.eps))
            self.done = True
            return node
        family = self.family
        if family not in _METHODS or op_family(name) != family:
            return node
        base = node.args[0] if node.args else getattr(f, "value", None)
        if base is None:
            return node
        shifted: ast.expr
        if family == OpFamily.EXP:
            amax = ast.parse("_.amax(dim=-1, keepdim=True)").body[0].value  # type: ignore[attr-defined]
            amax.func.value = base
            shifted = ast.BinOp(base, ast.Sub(), amax)
        else:
            shifted = ast.Call(ast.Attribute(base, "clamp_min"), [self.eps], [])
        if node.args:
            node.args[0] = shifted
        elif isinstance(f, ast.Attribute):
            f.value = shifted
        self.done = True
        return node


def rewrite_line(line: str, family: OpFamily | str, eps: float) -> str | None:
    """The source ``line`` with every operation of ``family`` on it rewritten (the epsilon
    in place), or ``None`` when the line cannot be parsed or holds no such operation.
    Every one, as the replay patches them all: which of two ``log`` calls on a line got
    the 0 is not known from the line, and a pasted fix must make the step finite."""
    text = line.strip()
    indent = line[: len(line) - len(line.lstrip())]
    if text.endswith(":"):
        return None
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    rewriter = _Rewriter(OpFamily(family), eps)
    new = rewriter.visit(tree)
    if not rewriter.done:
        return None
    return indent + ast.unparse(ast.fix_missing_locations(new))


class EpsilonFix(Fix):
    """An epsilon or clamp on the root operation, inside one module (or the loss).

    Parameters
    ----------
    module : str or None
        The module whose forward is run under :class:`RewriteMode`; ``None``: the loss.
    family : {"div", "log", "sqrt", "exp", "softmax"}
    source : str, optional
        ``"file.py:line"`` of the operation (for the text and the snippet).
    filename : str, optional
        The file of ``source`` (to read the line for the snippet).
    eps : float, optional
        Default: 1e-6, or 1e-3 for half-precision tensors.
    module_type : str
        The module's class name, for the text.

    Examples
    --------
    >>> nbdebug.diagnose(snap, fixes=[nbdebug.EpsilonFix("norm", "div", eps=1e-5)])
    """

    kind = FixKind.EPSILON

    def __init__(
        self,
        module: str | None,
        family: OpFamily | str,
        *,
        source: str | None = None,
        filename: str | None = None,
        eps: float | None = None,
        module_type: str = "",
    ):
        super().__init__()
        if family not in FAMILIES:
            allowed = sorted(f.value for f in FAMILIES)
            raise ValueError(f"family must be one of {allowed}; got {family!r}.")
        self.module = module
        self.family = OpFamily(family)
        self.op = self.family
        self.source = source
        self.filename = filename
        self.eps = eps
        self.module_type = module_type
        self.rewritten = 0
        self.order = 0  # among the epsilons of one step: the root (first executed) is 0
        #: for an exp: whether it feeds a softmax or a log-sum-exp (``True``: the shift by
        #: the maximum cancels out there), ``None``: not known
        self.shift_safe: bool | None = None

    @property
    def rank_locality(self) -> float:
        if self.locality is not None:
            return float(self.locality)
        return LOCALITY[FixKind.EPSILON] + 0.01 * min(self.order, 50)

    @contextmanager
    def apply(self, replay: Replay) -> Iterator[None]:
        modes: list[RewriteMode] = []

        def make() -> RewriteMode:
            m = RewriteMode(self.family, self.eps)
            modes.append(m)
            return m

        ctx = (
            replay.around_loss(make)
            if self.module is None
            else replay.around_forward(self.module, make)
        )
        with ctx:
            try:
                yield
            finally:
                self.rewritten = sum(m.calls for m in modes)

    def place(self) -> str:
        """Where the operation is, in words: ``"norm (Normalize) at model.py:12"``."""
        if self.module is None:
            where = "the loss function"
        else:
            where = f"{self.module or '<model>'}" + (
                f" ({self.module_type})" if self.module_type else ""
            )
        return where + (f" at {self.source}" if self.source else "")

    def change(self) -> str:
        """The change alone, in words: ``"log(x.clamp_min(eps))"``."""
        # an exp's shift is the overflow-safe softmax only where it feeds one; elsewhere
        # (a softplus, a plain exp) it computes another function
        if self.family == OpFamily.EXP:
            if self.shift_safe:
                return "exp(x - max) (the overflow-safe softmax)"
            return "exp(x - max) (the same result only inside a softmax or a log-sum-exp)"
        return _CHANGES[self.family]

    def describe(self) -> str:
        return f"{self.change()} in {self.place()}"

    def snippet(self) -> str:
        eps = self.eps if self.eps is not None else 1e-6
        where = f"# {self.source}" if self.source else f"# in {self.place()}"
        template = _TEMPLATES[self.family].replace("eps", repr(eps))
        line = self._line()
        if not line:
            return f"{where}\n{template}"
        new = rewrite_line(line, self.family, eps) if self.family != OpFamily.SOFTMAX else None
        if new:
            return f"{where}\n# was: {line.strip()}\n{new.strip()}"
        return f"{where}: {line.strip()}\n{template}"

    def _line(self) -> str:
        if not self.filename or not self.source or ":" not in self.source:
            return ""
        try:
            n = int(self.source.rsplit(":", 1)[1])
        except ValueError:
            return ""
        return linecache.getline(self.filename, n)
