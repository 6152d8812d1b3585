"""The ``nbdebug`` command: look at a snapshot without Jupyter.

::

    nbdebug inspect snapshots/step-000048213.nbsnap --model mypkg.models:make_model
    nbdebug report  snapshots/step-000048213.nbsnap -o report.html --model mypkg.models:make_model
    nbdebug list    snapshots/
    nbdebug diagnose snapshots/step-000048213.nbsnap --model mypkg.models:make_model -o r.html
    nbdebug build-kernels     # once: compile the statistics kernel that makes traces faster

``--model package.module:factory`` names a zero-argument callable (or a class) that builds
the architecture; the current directory is importable. Without it, ``--trust-recipe``
builds the model from the recipe recorded in the file (this imports and runs that code).
Without a model the step is not replayed, but the reason, history and norms are shown.
``inspect --verify`` reads every tensor of the file and checks it against its checksum.

Bad input prints one line on stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn, TextIO

if TYPE_CHECKING:
    import torch

    from .core.snapshot import Snapshot
    from .core.trace.result import Trace

EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line instead of usage + error
        self.exit(
            EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog.split()[0]} --help)\n"
        )


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="nbdebug", description="Inspect nbdebug snapshot files (.nbsnap) from the terminal."
    )
    sub = p.add_subparsers(
        dest="command",
        metavar="{inspect,report,list,diagnose,build-kernels}",
        parser_class=_Parser,
    )
    sub.required = True

    def model_opts(q: argparse.ArgumentParser) -> None:
        q.add_argument("path", help="the snapshot file (.nbsnap)")
        q.add_argument(
            "--model",
            metavar="package.module:factory",
            help="builds the model (zero-argument callable)",
        )
        q.add_argument(
            "--model-kwargs",
            metavar="JSON",
            default=None,
            help="keyword arguments for --model, as JSON",
        )
        q.add_argument(
            "--trust-recipe",
            action="store_true",
            help="build the model from the recipe in the file",
        )
        q.add_argument(
            "--loss",
            metavar="package.module:function",
            help="loss function overriding the recorded one",
        )
        q.add_argument("--no-replay", action="store_true", help="do not run the model")

    q = sub.add_parser("inspect", help="print a summary of a snapshot")
    model_opts(q)
    q.add_argument("--rows", type=int, default=10, help="history rows to print (default 10)")
    q.add_argument("--top", type=int, default=8, help="entries per largest-norm table (default 8)")
    q.add_argument(
        "--verify",
        action="store_true",
        help="read every tensor and check it against the checksum recorded when it was written",
    )

    r = sub.add_parser("report", help="write a self-contained HTML report")
    model_opts(r)
    r.add_argument(
        "-o", "--output", required=True, metavar="report.html", help="the HTML file to write"
    )

    ls = sub.add_parser("list", help="list the snapshots in a directory")
    ls.add_argument("directory")

    dg = sub.add_parser("diagnose", help="replay the failing step with candidate fixes, ranked")
    model_opts(dg)
    dg.add_argument("-o", "--output", metavar="report.html", help="also write the HTML report")
    dg.add_argument("--budget", type=float, default=None, metavar="S", help="seconds of replays")
    dg.add_argument("--steps", type=int, default=1, help="updates replayed per fix (default 1)")

    bk = sub.add_parser(
        "build-kernels", help="compile the statistics kernel traces use on CPU (once)"
    )
    bk.add_argument("--verbose", action="store_true", help="show the compiler's output")
    return p


@contextmanager
def _cwd_importable() -> Iterator[None]:
    """Modules in the current directory can be imported (a console script's sys.path
    does not hold it)."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


def _factory(spec: str, kwargs_json: str | None) -> Callable[[], torch.nn.Module]:
    from .core.snapshot import import_object

    kwargs: dict[str, Any] = {}
    if kwargs_json:
        try:
            kwargs = json.loads(kwargs_json)
        except json.JSONDecodeError as e:
            raise UsageError(f"--model-kwargs is not valid JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise UsageError(f"--model-kwargs must be a JSON object; got {kwargs_json!r}.")
    try:
        with _cwd_importable():
            obj = import_object(spec)
    except ValueError as e:
        raise UsageError(f"--model: {e}") from None
    if not callable(obj):
        raise UsageError(
            f"--model {spec} is a {type(obj).__qualname__}, not a callable that builds a model."
        )

    def build() -> torch.nn.Module:
        try:
            return obj(**kwargs)
        except Exception as e:
            raise UsageError(f"--model {spec} failed: {type(e).__name__}: {e}") from None

    return build


def _load(args: argparse.Namespace) -> tuple[Snapshot, Trace | None, str | None]:
    """(snapshot, trace or None, a note when there is no trace)."""
    from .core.snapshot import SnapshotError, import_object
    from .core.snapshot.resolve import Caller, resolve_source
    from .core.trace.result import TraceError
    from .core.vocab import SourceKind

    if args.model_kwargs and not args.model:
        raise UsageError("--model-kwargs needs --model.")
    model = _factory(args.model, args.model_kwargs) if args.model else None
    # a file; the step is shown without a model too ("Not replayed: no model")
    files = Caller("nbdebug", frozenset({SourceKind.SNAPSHOT}))
    try:
        with _cwd_importable():
            src = resolve_source(
                args.path, model=model, trust_recipe=args.trust_recipe, caller=files
            )
    except (SnapshotError, TypeError) as e:
        raise UsageError(str(e)) from None
    snap = src.snapshot
    assert snap is not None  # a file: a directory is read as one, which says what it is
    loss_fn = None
    if args.loss:
        try:
            with _cwd_importable():
                loss_fn = import_object(args.loss)
        except ValueError as e:
            raise UsageError(f"--loss: {e}") from None
    if args.no_replay:
        return snap, None, "Not replayed (--no-replay)."
    if snap.model is None:
        hint = (
            f" or --trust-recipe to build it with the recorded recipe {snap.recipe['factory']}"
            if snap.recipe is not None
            else ""
        )
        return snap, None, f"Not replayed: no model. Give --model package.module:factory{hint}."
    try:
        with _cwd_importable():  # a recorded loss function may live next to the model
            # resolved here so that a missing one names this command's option
            loss_fn = snap.replay_loss_fn(loss_fn, "--loss package.module:function")
            return snap, snap.trace(loss_fn=loss_fn), None
    except SnapshotError as e:
        return snap, None, f"Not replayed: {e}"
    except TraceError as e:
        return snap, e.trace, f"The replay raised: {e}"


def _print_rows(rows: list[tuple[str, str]], out: TextIO, indent: str = "") -> None:
    width = max((len(k) for k, _ in rows), default=0)
    for k, v in rows:
        print(f"{indent}{k.ljust(width)}  {v}", file=out)


def _verify(snap: Snapshot, out: TextIO) -> None:
    """``inspect --verify``: every tensor read and checked, or the damage as bad input."""
    from .core.snapshot import SnapshotError
    from .core.text import count_text

    try:
        n = snap.verify()
    except SnapshotError as e:
        raise UsageError(str(e)) from None
    print(f"  verified  {count_text(n, 'tensor')}: each matches its checksum", file=out)


def _inspect(args: argparse.Namespace, out: TextIO) -> None:
    from .core.text import count_text, fmt_num
    from .core.vocab import EventKind, Phase
    from .figures.report import (
        grad_norms,
        history_table,
        largest,
        origin_facts,
        snapshot_facts,
    )

    for option, value in (("--rows", args.rows), ("--top", args.top)):
        if value < 0:
            raise UsageError(f"{option} must be >= 0; got {value}.")
    snap, trace, note = _load(args)
    print(f"nbdebug snapshot: step {fmt_num(snap.step)}", file=out)
    if args.verify:
        _verify(snap, out)
    _print_rows(snapshot_facts(snap), out, "  ")
    print("\norigin (replay of the step)", file=out)
    if trace is not None:
        _print_rows(origin_facts(trace, snap), out, "  ")
    if note:
        print(f"  {note}", file=out)
    shown = min(args.rows, len(snap.history))
    print(f"\nlast {count_text(shown, 'history row')}" if shown else "\nhistory", file=out)
    if snap.history and args.rows:
        table = history_table(snap, args.rows).to_string(index=False)
        for line in table.splitlines():
            print(f"  {line}", file=out)
    elif not snap.history:
        print("  (none recorded)", file=out)
    else:
        print(f"  ({count_text(len(snap.history), 'row')}, not shown: --rows 0)", file=out)
    for title, items in (
        ("largest gradient norms at the failing step", largest(grad_norms(snap), args.top)),
        ("largest parameter norms", largest(snap.param_norms(), args.top)),
    ):
        print(f"\n{title}", file=out)
        if items:
            _print_rows([(n, fmt_num(v)) for n, v in items], out, "  ")
        else:
            print("  (none recorded)", file=out)
    if trace is not None:
        acts = {
            e.label: e.stats.norm_as_is
            for e in trace.events
            if e.phase == Phase.FORWARD and e.kind == EventKind.OUTPUT
        }
        items = largest(acts, args.top)
        if items:
            print("\nlargest activation norms in the replay", file=out)
            _print_rows([(n, fmt_num(v)) for n, v in items], out, "  ")


def _report(args: argparse.Namespace, out: TextIO) -> None:
    from .figures.report import report_html

    snap, trace, note = _load(args)
    _write(args.output, report_html(snap, trace, note=note), out)


def _list(args: argparse.Namespace, out: TextIO) -> None:
    from .core.snapshot import list_snapshots

    try:
        df = list_snapshots(args.directory)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    if df.empty:
        print(f"no snapshots in {args.directory}", file=out)
        return
    df = df.assign(time=df["time"].dt.strftime("%Y-%m-%d %H:%M:%S"))
    # "nothing" reads "-" in every column: pandas prints a None among strings as "None"
    df = df.astype(object).where(df.notna(), "-")
    print(df.to_string(index=False, max_colwidth=80), file=out)


def _build_kernels(args: argparse.Namespace, out: TextIO) -> None:
    from .core import kernels

    try:
        path = kernels.build(verbose=args.verbose)
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    print(f"nbdebug kernels: {path}", file=out)
    if not kernels.active():
        print(f"(not used while {kernels.ENV}=eager)", file=out)


def _diagnose(args: argparse.Namespace, out: TextIO) -> None:
    from .analysis.diagnose import diagnose
    from .core.snapshot import SnapshotError
    from .figures.report import report_html

    if args.no_replay:
        raise UsageError("diagnose replays the step: --no-replay makes no sense here.")
    snap, trace, note = _load(args)
    if snap.model is None:
        raise UsageError(note or "diagnose needs the model: give --model package.module:factory.")
    loss_fn = None
    if args.loss:
        from .core.snapshot import import_object

        with _cwd_importable():
            loss_fn = import_object(args.loss)  # _load has checked the name
    try:
        with _cwd_importable():
            d = diagnose(
                snap, loss_fn=loss_fn, steps=args.steps, budget_s=args.budget, progress=False
            )
    except (ValueError, TypeError, SnapshotError) as e:
        raise UsageError(str(e)) from None
    print(f"nbdebug diagnose: step {snap.step}", file=out)
    print(f"  cause: {d.cause.statement}", file=out)
    print(f"  origin: {d.origin}\n", file=out)
    for line in d.table().splitlines():
        print(f"  {line}", file=out)
    for n in d.notes:
        print(f"  note: {n}", file=out)
    if args.output:
        page = report_html(snap, trace, note=note, diagnosis=d)
        _write(args.output, page, out)


def _write(output: str, page: str, out: TextIO) -> None:
    path = os.path.abspath(output)
    if os.path.isdir(path):
        raise UsageError(f"-o {output} is a directory; give a file name such as report.html.")
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        raise UsageError(f"cannot write {output}: {e.strerror or e}") from None
    print(f"wrote {output} ({len(page) / 1e6:.1f} MB, self-contained)", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nbdebug`` console script; returns the exit status."""
    args = _parser().parse_args(argv)
    try:
        commands = {
            "inspect": _inspect,
            "report": _report,
            "list": _list,
            "diagnose": _diagnose,
            "build-kernels": _build_kernels,
        }
        commands[args.command](args, sys.stdout)
        sys.stdout.flush()
    except UsageError as e:
        print(f"nbdebug: error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        # the reader went away (`nbdebug inspect SNAP | head -1`): stop quietly, as cat
        # does; stdout goes to devnull so that the interpreter's final flush is silent too
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return 0


if __name__ == "__main__":  # python -m nbdebug.cli
    sys.exit(main())
