"""``%load_ext nbdebug`` and the ``%nbdebug`` line magic.

Everything UI-related (IPython, ipywidgets, plotly) is imported inside functions: importing
this module costs nothing until the extension is loaded.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from IPython.core.interactiveshell import InteractiveShell

MAGIC = "nbdebug"
USAGE = (
    "usage: %nbdebug MODEL BATCH [TARGET] [--loss NAME] | %nbdebug PATH.nbsnap [--model NAME] | "
    "%nbdebug (the last NonFiniteError's snapshot)"
)
_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class MagicUsageError(Exception):
    """A bad ``%nbdebug`` line: printed as one line, never as a traceback."""


@dataclass
class _State:
    """What the extension added to one shell, so that unloading removes exactly that."""

    shell: InteractiveShell | None = None
    callbacks: list[tuple[str, Any]] = field(default_factory=list)
    cell_id: str | None = None
    # cell id (or the magic's line outside Jupyter) -> debuggers it opened
    open: dict[str, list[Any]] = field(default_factory=dict)


_STATE = _State()


def open_debuggers() -> list[Any]:
    """The debuggers ``%nbdebug`` opened and that are still open (newest last)."""
    return [d for ds in _STATE.open.values() for d in ds]


def load_ipython_extension(ipython: InteractiveShell) -> None:
    """``%load_ext nbdebug``: register ``%nbdebug`` and pre/post-run-cell callbacks that
    close the debuggers a cell opened when that cell runs again. Loading twice is harmless."""
    if _STATE.shell is not None:
        if _STATE.shell is ipython:
            return
        unload_ipython_extension(_STATE.shell)

    def nbdebug(line: str) -> None:
        return _magic(line)

    nbdebug.__doc__ = _magic.__doc__
    # IPython wraps this method in a decorator whose type mypy cannot see through
    ipython.register_magic_function(  # type: ignore[call-arg]
        nbdebug,  # type: ignore[arg-type]
        magic_kind="line",
        magic_name=MAGIC,
    )

    def pre_run_cell(info: object) -> None:
        cell_id = getattr(info, "cell_id", None)
        _STATE.cell_id = cell_id
        if cell_id is not None:
            _close(cell_id)

    def post_run_cell(_result: object) -> None:
        _STATE.cell_id = None

    ipython.events.register("pre_run_cell", pre_run_cell)
    ipython.events.register("post_run_cell", post_run_cell)
    _STATE.shell = ipython
    _STATE.callbacks = [("pre_run_cell", pre_run_cell), ("post_run_cell", post_run_cell)]


def unload_ipython_extension(ipython: InteractiveShell) -> None:
    """``%unload_ext nbdebug``: remove the magic and the callbacks, close every debugger
    the magic opened."""
    mm = ipython.magics_manager
    mm.magics["line"].pop(MAGIC, None)
    if MAGIC in getattr(mm.user_magics, "__dict__", {}):
        delattr(mm.user_magics, MAGIC)
    if _STATE.shell is ipython:
        for event, fn in _STATE.callbacks:
            with contextlib.suppress(ValueError):
                ipython.events.unregister(event, fn)
    for key in list(_STATE.open):
        _close(key)
    _STATE.shell = _STATE.cell_id = None
    _STATE.callbacks = []


def _close(key: str) -> None:
    for dbg in _STATE.open.pop(key, []):
        dbg.close()


def _magic(line: str) -> None:
    """Open the nbdebug debugger.

    Usage::

        %nbdebug model batch [target] [--loss NAME]
        %nbdebug path/to/step-000123.nbsnap [--model NAME] [--loss NAME]
        %nbdebug path/to/snapshots/ --model NAME     # a distributed run's per-rank files
        %nbdebug [--model NAME] [--loss NAME]

    ``model``, ``batch``, ``target`` and ``NAME`` are names (``a.b`` attributes allowed) from
    the notebook. The batch follows :func:`nbdebug.trace`'s conventions (a tensor, a
    tuple/list or a dict); ``--loss`` is the loss function, a notebook name or a function
    of ``torch.nn.functional`` (``--loss cross_entropy``). With a snapshot path (or a
    name holding a path or a ``Snapshot``), ``--model`` is the architecture (a module or a
    zero-argument factory) and ``--loss`` overrides the recorded loss function. Without
    arguments it opens the snapshot of the last ``nbdebug.NonFiniteError`` raised in this
    session, as ``%debug`` does for the last exception. A name may also hold a recorded
    ``Trace`` or a ``(model, batch[, target])`` tuple: what it holds is told apart by
    :func:`nbdebug.core.snapshot.resolve_source`, as for ``nbdebug.debug``.

    The panel has a header (model, parameters, batch, loss and where the first NaN/Inf was
    produced) and tabs: Step (walk through the forward and backward pass), Layers
    (parameter norms and grad/weight ratios) and, for snapshots, History. Running the cell
    again closes the debugger it opened before. Use ``nbdebug.debug(...)`` to get the
    debugger object itself.
    """
    try:
        dbg = _open(line)
    except MagicUsageError as e:
        print(f"nbdebug: {e}", file=sys.stderr)
        return None
    from IPython.display import display

    key = _STATE.cell_id or line.strip()
    if _STATE.cell_id is None:  # outside Jupyter: the same line again replaces its debugger
        _close(key)
    _STATE.open.setdefault(key, []).append(dbg)
    display(dbg)
    return None


def _split(line: str) -> tuple[list[str], dict[str, str]]:
    try:
        words = shlex.split(line)
    except ValueError as e:
        raise MagicUsageError(f"cannot parse the line ({e}). {USAGE}") from None
    args: list[str] = []
    opts: dict[str, str] = {}
    i = 0
    while i < len(words):
        w = words[i]
        if w.startswith("--"):
            key, _, val = w[2:].partition("=")
            if key not in ("loss", "model"):
                raise MagicUsageError(f"unknown option --{key}. {USAGE}")
            if not val:
                if i + 1 >= len(words):
                    raise MagicUsageError(f"--{key} needs a name. {USAGE}")
                i += 1
                val = words[i]
            opts[key] = val
        else:
            args.append(w)
        i += 1
    return args, opts


def _lookup(name: str, ns: dict[str, Any]) -> Any:
    """A notebook name (dotted attributes allowed); raises KeyError when it is undefined."""
    head, *rest = name.split(".")
    if head not in ns:
        raise KeyError(name)
    value = ns[head]
    for attr in rest:
        if not hasattr(value, attr):
            raise KeyError(name)
        value = getattr(value, attr)
    return value


def _resolve(name: str, ns: dict[str, Any], what: str) -> Any:
    if not _NAME.match(name):
        raise MagicUsageError(f"{what} must be a name from the notebook; got {name!r}. {USAGE}")
    try:
        return _lookup(name, ns)
    except KeyError:
        raise MagicUsageError(f"name {name!r} ({what}) is not defined in the notebook.") from None


def _loss(name: str, ns: dict[str, Any]) -> Any:
    if _NAME.match(name):
        try:
            fn = _lookup(name, ns)
        except KeyError:
            import torch.nn.functional as F

            fn = getattr(F, name, None)
            if fn is None:
                raise MagicUsageError(
                    f"--loss {name}: no such name in the notebook or in torch.nn.functional."
                ) from None
    else:
        raise MagicUsageError(f"--loss must be a name; got {name!r}.")
    if not callable(fn):
        raise MagicUsageError(f"--loss {name} is of type {type(fn).__qualname__}, not a function.")
    return fn


def _last_error() -> Any:
    """The last ``NonFiniteError`` of the session (the guard's own record, else IPython's
    ``sys.last_exc`` / ``sys.last_value``), or None."""
    from .core.guard import last_error

    return last_error()


def _reported_factory(name: str, factory: Callable[[], Any]) -> Callable[[], Any]:
    """``factory``, whose own error (the user's code) becomes one line naming ``--model``."""

    @functools.wraps(factory)
    def build() -> Any:
        try:
            return factory()
        except Exception as e:
            raise MagicUsageError(f"--model {name} failed: {type(e).__name__}: {e}") from None

    return build


def _open(line: str) -> Any:
    """Parse a ``%nbdebug`` line and build the debugger; bad input raises MagicUsageError."""
    import torch

    from .core.snapshot.resolve import source_kind

    shell = _STATE.shell
    ns: dict[str, Any] = shell.user_ns if shell is not None else {}
    args, opts = _split(line)
    model = _resolve(opts["model"], ns, "--model") if "model" in opts else None
    if callable(model) and not isinstance(model, torch.nn.Module):
        model = _reported_factory(opts["model"], model)

    if not args:
        err = _last_error()
        if err is None:
            raise MagicUsageError(f"no NonFiniteError has been raised in this session. {USAGE}")
        loss_fn = _loss(opts["loss"], ns) if "loss" in opts else None
        return _debug(err, (None, None), model, loss_fn)

    first = args[0]
    value = _first_value(first, ns)
    if source_kind(value) is None:
        raise MagicUsageError(
            f"{first} is of type {type(value).__qualname__}: expected a torch.nn.Module, a "
            f"Snapshot, a snapshot path or a Trace. {USAGE}"
        )
    batch: tuple[object, object] = (None, None)
    if isinstance(value, torch.nn.Module):  # the names after it are its batch
        if len(args) < 2:
            raise MagicUsageError(f"the batch is missing after {first}. {USAGE}")
        if len(args) > 3:
            raise MagicUsageError(f"too many names: {' '.join(args)}. {USAGE}")
        if "model" in opts:
            raise MagicUsageError("--model is for snapshots; the model is the first name here.")
        target = _resolve(args[2], ns, "target") if len(args) > 2 else None
        batch = (_resolve(args[1], ns, "batch"), target)
    elif len(args) > 1:
        raise MagicUsageError(f"a snapshot takes no batch or target (it holds its own). {USAGE}")
    loss_fn = _loss(opts["loss"], ns) if "loss" in opts else None
    return _debug(value, batch, model, loss_fn)


def _first_value(first: str, ns: dict[str, Any]) -> Any:
    """The first word of the line: a notebook name's value, else a path."""
    if _NAME.match(first):
        try:
            return _lookup(first, ns)
        except KeyError:
            if not (first.endswith(".nbsnap") or os.path.exists(first)):
                also = " nor a file or folder here" if "." in first else ""
                raise MagicUsageError(
                    f"name {first!r} is not defined in the notebook{also}."
                ) from None
            return first  # a file name (step-1.nbsnap, crash.pt) or a folder of snapshots
    if first.endswith(".nbsnap") or os.sep in first or os.path.exists(first):
        return first  # a snapshot path, or a directory of them
    raise MagicUsageError(
        f"{first!r} is neither a name from the notebook nor a snapshot path: give the "
        f"magic names (assign it first, e.g. m = {first}). {USAGE}"
    )


def _debug(
    value: Any,  # a notebook name's value
    batch: tuple[object, object],
    model: torch.nn.Module | Callable[[], torch.nn.Module] | None,
    loss_fn: Callable[..., object] | None,
) -> Any:
    """``nbdebug.debug`` of the line's source; its errors as one MagicUsageError (a
    snapshot without a model names ``--model``)."""
    from .core.snapshot import Snapshot, SnapshotError
    from .widgets.app import debug

    path = value if isinstance(value, (str, os.PathLike)) else None
    if isinstance(value, (Snapshot, BaseException)):  # a NonFiniteError names its file
        path = getattr(value, "path", None)
    p = None if path is None else os.fspath(path)
    if p is not None and not isinstance(value, Snapshot) and not os.path.exists(p):
        raise MagicUsageError(f"no such file: {p}")
    try:
        return debug(value, *batch, loss_fn, model=model)
    except SnapshotError as e:
        if e.needs_model:
            raise MagicUsageError(
                f"{p or 'the snapshot'} was loaded without a model: give --model NAME (a "
                "module, or a zero-argument factory, in the notebook's namespace)."
            ) from None
        msg = str(e)  # most name the file already
        raise MagicUsageError(msg if p is None or p in msg else f"{p}: {msg}") from None
    except (TypeError, ValueError) as e:
        raise MagicUsageError(str(e)) from None
