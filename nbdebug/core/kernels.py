"""The optional compiled statistics kernel (``kernels.cpp``): built once on request, then
used by every trace on this machine.

The eager statistics of a tensor take three passes over its memory (``sum``, ``dot``,
``aminmax``) and five dispatches with the histogram sample; the compiled kernel takes one
pass and one call, for dense CPU tensors of floating dtypes. Nothing is compiled unless
asked: ``nbdebug build-kernels`` (or :func:`build`; the project's ``make setup`` runs it)
compiles it with the C++ compiler PyTorch uses for extensions into nbdebug's cache
directory, one build per PyTorch version and kernel source. Without a build, or with
``NBDEBUG_KERNELS=eager``, statistics are computed with eager PyTorch ops (same numbers;
see :func:`nbdebug.core.measure.quick_parts`).

>>> from nbdebug.core import kernels
>>> kernels.build()          # once per machine and PyTorch version (about a minute)
>>> kernels.active()         # True: traces now use it
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["active", "build", "build_dir", "compiled"]

SOURCE = Path(__file__).with_name("kernels.cpp")
#: ``NBDEBUG_KERNELS=eager`` turns a built kernel off (``compiled``, the default, uses it
#: when it was built)
ENV = "NBDEBUG_KERNELS"

#: compiler flags: ``-fopenmp`` makes ``at::parallel_for`` (an OpenMP pragma in ATen's
#: headers) run on torch's intra-op threads; without it the pragma is ignored and the
#: kernel runs on one thread. Only compiled with it: the library is not linked against an
#: OpenMP runtime of its own, its calls resolve to the one libtorch loaded.
CFLAGS = ("-O3", "-march=native", "-fopenmp")

_loaded: dict[tuple[str | None, ...], ModuleType | None] = {}
_tags: dict[str, str] = {}


def _tag() -> str:
    """12 hex digits naming this kernel source built for this PyTorch version."""
    tag = _tags.get(torch.__version__)
    if tag is None:
        key = SOURCE.read_bytes() + torch.__version__.encode() + _cpu().encode()
        key += " ".join(CFLAGS).encode()
        tag = _tags[torch.__version__] = hashlib.sha256(key).hexdigest()[:12]
    return tag


def _cpu() -> str:
    """This CPU's model and instruction sets: the kernel is built for them
    (``-march=native``), so a cache directory shared with other machines never hands one
    a library it cannot run."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def _name() -> str:
    return f"nbdebug_kernels_{_tag()}"


def build_dir() -> Path:
    """Where the kernel of this PyTorch version and source is built:
    ``$NBDEBUG_CACHE`` or ``$XDG_CACHE_HOME/nbdebug`` (default ``~/.cache/nbdebug``),
    then ``kernels/<tag>``."""
    root = os.environ.get("NBDEBUG_CACHE")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "nbdebug")
    return Path(root) / "kernels" / _tag()


def _library() -> Path | None:
    hits = sorted(build_dir().glob(f"{_name()}*.so")) + sorted(build_dir().glob(f"{_name()}*.pyd"))
    return hits[0] if hits else None


def _import(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_name(), str(path))
    spec = importlib.util.spec_from_file_location(_name(), str(path), loader=loader)
    if spec is None:  # pragma: no cover - only for a path importlib cannot describe
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _cache_key() -> tuple[str | None, ...]:
    env = os.environ
    return (_tag(), env.get("NBDEBUG_CACHE"), env.get("XDG_CACHE_HOME"), env.get("HOME"))


def _module() -> ModuleType | None:
    # looked up per tensor: keyed by the tag and the environment naming the cache directory, the
    # file system is searched once per directory and process (a kernel built in another
    # process is picked up after a restart, or by calling :func:`build` here)
    key = _cache_key()
    try:
        return _loaded[key]
    except KeyError:
        lib = _library()
        module = _loaded[key] = _import(lib) if lib is not None else None
        return module


def active() -> bool:
    """Whether traces use the compiled kernel: it was built for this PyTorch version and
    ``NBDEBUG_KERNELS`` is not ``eager``."""
    return compiled() is not None


def compiled() -> ModuleType | None:
    """The compiled kernel's module when :func:`active`, else None (read per tensor). Its
    ``quick_stats(x, *measure.kernel_args())`` takes a non-empty contiguous CPU tensor of a
    floating dtype and returns one float64 row: ``[sum, sum of squares, min, max]``, then
    the histogram (bin counts, zeros, NaN/Inf, size) of every ``ceil(numel /
    max_sample)``-th element. ``quick_stats_row(x, out, row, *args)`` writes that row into
    row ``row`` of a preallocated float64 ``out``, ``quick_stats_into(xs, out, first_row,
    *args)`` the rows of many tensors in one call (large ones split across torch's
    intra-op threads, small ones packed into shared tasks), and ``moments_many(xs,
    wide)`` returns float64 ``[len(xs), 4]`` of ``[sum, sum of squares, min, max]``
    (squares in float64 lanes when ``wide``)."""
    mode = os.environ.get(ENV)
    if mode is None or mode == "compiled":
        return _module()
    if mode == "eager":
        return None
    raise ValueError(f"{ENV} expects 'compiled' or 'eager', got {mode!r}")


def build(*, verbose: bool = False) -> Path:
    """Compile the kernel for this PyTorch version (once; later calls return at once) and
    return the built library's path. Needs the C++ compiler and ``ninja`` that PyTorch's
    extension builder uses; a RuntimeError says which one is missing."""
    lib = _library()
    if lib is not None:
        return lib
    from torch.utils import cpp_extension

    if not cpp_extension.is_ninja_available():
        raise RuntimeError(
            "building nbdebug's kernels needs ninja (pip install ninja), found none on PATH"
        )
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    try:
        module = cpp_extension.load(
            name=_name(),
            sources=[str(SOURCE)],
            build_directory=str(out),
            extra_cflags=list(CFLAGS),
            verbose=verbose,
        )
    except (RuntimeError, OSError) as err:
        raise RuntimeError(
            f"building nbdebug's kernels expects a working C++ compiler (CXX or c++) for "
            f"torch {torch.__version__}; the build failed: {str(err).splitlines()[-1]}"
        ) from err
    _loaded[_cache_key()] = module
    lib = _library()
    if lib is None:  # pragma: no cover - cpp_extension always leaves the library there
        raise RuntimeError(f"the kernel build left no library in {out}")
    return lib
