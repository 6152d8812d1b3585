"""The keyword options of :func:`nbdebug.row_blame`, checked once into a frozen
:class:`BlameOptions`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace

from ...core.batch import check_flag
from ...core.options import refuse_unknown

__all__ = ["DEFAULT_MEMORY", "BlameOptions"]

#: the default memory budget of the per-row gradients, in bytes (512 MiB)
DEFAULT_MEMORY = 512 * 2**20


@dataclass(frozen=True)
class BlameOptions:
    """The keyword options of :func:`nbdebug.row_blame` (each described there), checked.

    ``row_blame(source, ..., fraction=0.8)`` and ``row_blame(source, ...,
    options=BlameOptions(fraction=0.8))`` are the same call.

    Attributes
    ----------
    fraction : float
        In (0, 1]: the summary names the fewest rows whose shares add up to at least this.
    layer : str or None
        The module whose parameters the gradients are taken over (``""``: the whole
        model; ``None``: the memory rule of :func:`nbdebug.row_blame`).
    memory : int
        Bytes the per-row gradients may take at once.
    trust_recipe : bool
        A snapshot path without ``model=``: build the model with the recorded recipe.

    Examples
    --------
    >>> nbdebug.row_blame(snap, options=nbdebug.BlameOptions(fraction=0.9, layer="head"))
    """

    fraction: float = 0.5
    layer: str | None = None
    memory: int = DEFAULT_MEMORY
    trust_recipe: bool = False

    def __post_init__(self) -> None:
        f = self.fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
            raise ValueError(f"fraction must be a number in (0, 1]; got {f!r}.")
        if self.layer is not None and not isinstance(self.layer, str):
            raise TypeError(
                "layer must be a module name as in model.named_modules() (or None); got "
                f"{type(self.layer).__qualname__}."
            )
        m = self.memory
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"memory must be a number of bytes >= 1; got {m!r}.")
        check_flag(self.trust_recipe, "trust_recipe")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The option names, in order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def of(cls, keywords: Mapping[str, object]) -> BlameOptions:
        """The options of ``keywords`` (an ``options=`` among them is the base the others
        replace fields of); a ``TypeError`` naming an unknown keyword."""
        given = dict(keywords)
        base = given.pop("options", None)
        if base is not None and not isinstance(base, BlameOptions):
            raise TypeError(f"options must be a BlameOptions; got {type(base).__qualname__}.")
        listed = ("inputs", "target", "loss_fn", "model", "ids", "labels", "drift", "options")
        refuse_unknown(given, cls.names(), where="row_blame()", listed=listed)
        start = base if base is not None else cls()
        return replace(start, **given) if given else start  # type: ignore[arg-type]
