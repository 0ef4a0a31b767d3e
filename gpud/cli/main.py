"""gpuctl: talk to the local gpud over its unix socket.

::

    gpuctl [--socket PATH] [--json] [--timeout S] COMMAND ...

Each command group is a module with ``register(subparsers)``, which adds its sub-command(s)
and sets ``run=function(ctx, args) -> exit code`` as the parser default; add the module to
:data:`COMMAND_GROUPS`. A command group looks like::

    def register(subparsers: Subparsers) -> None:
        show = subparsers.add_parser("mig", help="...").add_subparsers(...).add_parser("show")
        show.set_defaults(run=run_show)

    def run_show(ctx: Context, args: argparse.Namespace) -> int:
        resp: mig_pb2.ShowResponse = ctx.call(ctx.stub(MigStub).Show, mig_pb2.ShowRequest())
        if ctx.out.json:
            ctx.out.print_json(resp)   # numbers stay numbers, absent readings are null
        else:
            ctx.out.print_table(HEADERS, rows)
        return 0

``ctx.call`` applies ``--timeout`` and turns every gRPC error into the right message and
exit code; a command raises :class:`gpud.cli.context.CliError` for its own failures.
The global options are accepted before or after the command (``gpuctl --json gpus`` and
``gpuctl gpus --json`` are the same): they are added to every sub-parser automatically.

Exit codes: 0 ok, 2 usage or invalid argument, 3 daemon not running, 4 not found (an unknown
GPU, MIG device or job, in every command), 77 permission denied, 129 its terminal (stdout's
or stderr's) hung up, 141 output pipe closed early; others from ``gpud.errors.ERROR_TABLE`` (see :mod:`gpud.cli.context`).
With ``--json`` an error is one JSON document on stderr instead of ``gpuctl: MESSAGE``
(:meth:`gpud.cli.context.CliError.to_json`), usage errors included; stdout keeps nothing
but JSON. Everything a command fails with passes :func:`_main` (a :class:`CliError`), so
this is done there alone.

Start-up time matters (people type gpuctl many times a day): the command modules import
nothing heavy at the top. Generated gRPC code loads on first use (:mod:`gpud.cli.lazy`),
``grpc`` and protobuf inside the functions that call the daemon, and gpuctl imports no daemon
package: what it shares with the daemon is :mod:`gpud.shared` (tests/unit/test_gpuctl_process.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from gpud import __version__
from gpud import build as build_id
from gpud.cli import cluster as cluster_cli
from gpud.cli import colo as colo_cli
from gpud.cli import events, gpus, sim, status, version, xid
from gpud.cli import jobs as jobs_cli
from gpud.cli import mig as mig_cli
from gpud.cli import mps as mps_cli
from gpud.cli import net as net_cli
from gpud.cli import queue as queue_cli
from gpud.cli import run as run_cli
from gpud.cli.context import (
    DEFAULT_SOCKET,
    EXIT_USAGE,
    CliError,
    Context,
    clip_arguments,
    seconds,
)
from gpud.cli.output import Output, OutputError
from gpud.cli.pipes import (
    STDERR_MAY_GO,
    discard_stdout,
    quiet_on_broken_pipe,
    stderr_that_never_fails,
)

EXIT_OUTPUT = 1  # stdout could not take the answer (a full disk, stdout closed)

# Command groups, in help order. Each module exposes register(subparsers).
COMMAND_GROUPS: list[ModuleType] = [
    status,
    gpus,
    mig_cli,
    mps_cli,
    jobs_cli,
    run_cli,
    queue_cli,
    colo_cli,
    net_cli,
    cluster_cli,
    version,
    events,
    xid,
    sim,
]

SOCKET_ENV = "GPUD_SOCKET"
DEFAULT_TIMEOUT = 10.0
# A day: a per-call timeout past it is a typo, and the socket's own timeout overflows
# somewhere past 1e9 s.
MAX_TIMEOUT = 86400.0
TIMEOUT = seconds(MAX_TIMEOUT)  # NaN, 0 and the infinities refused too


class _UsageError(Exception):
    """An argparse error (``message`` as argparse says it after ``error:``), raised instead
    of printing it, so that ``--json`` can print it as JSON."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser (its sub-parsers are of its class) whose errors :func:`_main`
    prints: ``PROG: error: MESSAGE`` as argparse says it and ``try 'PROG --help'`` (not
    argparse's whole usage before it), or as JSON."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse reads a word that starts with "-" as an option unless it is a plain
        # negative number ("-5", "-.5"): "--memory -5GiB" then said "expected one
        # argument". No option of gpuctl starts with "-" and a digit, so every such word is
        # a value, which the option's own type refuses naming it ("cannot be negative").
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        raise _UsageError(self, message)


def _json_asked(argv: Sequence[str]) -> bool:
    """Whether ``--json`` is among ``argv`` before a ``--`` (after it, the words are a
    command's: ``gpuctl run ... -- tool --json``): for a usage error, which comes before
    the parsed options are known."""
    words = list(argv)
    return "--json" in (words[: words.index("--")] if "--" in words else words)


def _socket_arg(text: str) -> Path:
    if not text:  # Path("") would be the working directory
        raise argparse.ArgumentTypeError("must name gpud's socket, got ''")
    return Path(text)


def _add_global_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    # On sub-commands the defaults are SUPPRESS, so an option given before the command is not
    # reset by the sub-command's parser.
    def default(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument(
        "--socket",
        type=_socket_arg,
        metavar="PATH",
        default=default(None),
        help=f"gpud's unix socket (default: ${SOCKET_ENV} or {DEFAULT_SOCKET})",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="JSON output for scripts"
    )
    parser.add_argument(
        "--timeout",
        type=TIMEOUT,
        metavar="SECONDS",
        default=default(DEFAULT_TIMEOUT),
        help=f"per-call timeout (default {DEFAULT_TIMEOUT:g}; `mig apply` waits 600 at least)",
    )


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every parser below ``parser``, at any depth (argparse has no public walk)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield child
                yield from _subparsers(child)


def build_parser(groups: Sequence[ModuleType] = COMMAND_GROUPS) -> argparse.ArgumentParser:
    parser = _Parser(prog="gpuctl", description="Query and control the local gpud daemon.")
    parser.add_argument("--version", action=build_id.VersionAction, version=__version__)
    _add_global_options(parser, defaults=True)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for group in groups:
        group.register(commands)
    for child in _subparsers(parser):
        _add_global_options(child, defaults=False)
    return parser


def _socket_path(args: argparse.Namespace, env: Mapping[str, str]) -> Path:
    if args.socket is not None:
        return Path(args.socket)
    from_env = env.get(SOCKET_ENV)
    return Path(from_env) if from_env else DEFAULT_SOCKET


def main(argv: Sequence[str] | None = None, *, env: Mapping[str, str] | None = None) -> int:
    """Run gpuctl; returns the exit code (the console script exits with it).

    Output piped into a reader that stops early (``gpuctl mig show | head -3``) ends gpuctl
    quietly with exit 141, as a process killed by SIGPIPE would, in every command; a
    terminal that hung up under it (closed, SIGHUP not received: ``trap '' HUP``, a job after
    ``disown``, ``setsid`` with output left on the terminal), with 129, as one
    killed by the terminal's SIGHUP would.
    """
    return quiet_on_broken_pipe(lambda: _main(argv, env))


def _fail(
    err: CliError, json_output: bool, notes: Sequence[str] = (), words: Sequence[str] = ()
) -> int:
    """Say ``err`` on stderr, as one line for people or one JSON document; its exit code.
    Under ``--json`` the notes said before it (each already a ``gpuctl:`` line without
    ``--json``) go in the document, as an answer's would. A huge argument among ``words``
    that the message repeats is cut (:func:`clip_arguments`)."""
    message = clip_arguments(str(err), words)
    if json_output:
        doc: dict[str, object] = err.to_json(message)
        if notes:
            doc["notes"] = list(notes)
        print(json.dumps(doc), file=sys.stderr)
    else:
        print(f"gpuctl: {message}", file=sys.stderr)
    return err.exit_code


def _usage_failed(parser: argparse.ArgumentParser, err: _UsageError, words: Sequence[str]) -> int:
    """Say the usage error ``err`` in ``words`` on stderr; its exit code."""
    if _json_asked(words):
        # "jobs: argument COMMAND: ...", as gpuctl's own usage errors name the command
        command = err.parser.prog.removeprefix(parser.prog).strip()
        message = f"{command}: {err}" if command else str(err)
        return _fail(CliError(message, EXIT_USAGE), json_output=True, words=words)
    # the error, and where the usage is: the whole usage buried the one line that mattered
    print(f"{err.parser.prog}: error: {clip_arguments(str(err), words)}", file=sys.stderr)
    print(f"try '{err.parser.prog} --help'", file=sys.stderr)
    return EXIT_USAGE


def _main(argv: Sequence[str] | None, env: Mapping[str, str] | None) -> int:
    parser = build_parser()
    words = sys.argv[1:] if argv is None else argv
    try:
        args = parser.parse_args(words)
    except SystemExit as exit_:  # --help, --version
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    except _UsageError as err:
        # exit 2 whatever stderr is, in every command: a usage error is known before the
        # command is (`gpuctl --timeout abc run ...`), and a stderr gone makes it no less one
        with stderr_that_never_fails():
            return _usage_failed(parser, err, words)
    run = getattr(args, "run", None)
    if run is None:
        with stderr_that_never_fails():  # a usage error: see above
            if args.json:
                no_command = CliError("give a command (gpuctl --help lists them)", EXIT_USAGE)
                return _fail(no_command, json_output=True)
            parser.print_help(sys.stderr)
        return EXIT_USAGE
    ctx = Context(
        socket_path=_socket_path(args, os.environ if env is None else env),
        timeout=args.timeout,
        output=Output(json_output=args.json),
    )
    with contextlib.ExitStack() as scope:
        if getattr(args, STDERR_MAY_GO, False):
            # a command whose end matters more than its messages (`gpuctl run`: its exit
            # status is its command's, or that of its own error, as a gpud away): a line on
            # stderr that cannot be written, to the very last, is dropped, not raised
            scope.enter_context(stderr_that_never_fails())
        try:
            code: int = run(ctx, args)
            ctx.out.flush()
            return code
        except CliError as err:
            return _fail(err, args.json, ctx.out.notes, words)
        except OutputError as err:
            discard_stdout()
            # said if stderr can take it: a stderr whose terminal hung up too must not turn
            # the output's error (its disk full, failing) into 129
            with stderr_that_never_fails():
                return _fail(CliError(str(err), EXIT_OUTPUT), args.json)
        except UnicodeEncodeError as err:
            # an argument in bytes that are not UTF-8 (Python keeps them as surrogates),
            # which no request can carry
            invalid = CliError(f"an argument is not valid UTF-8: {err.object!r}", EXIT_USAGE)
            with stderr_that_never_fails():  # a usage error: see above
                return _fail(invalid, args.json, words=words)
        except KeyboardInterrupt:
            return 130
        finally:
            ctx.close()


if __name__ == "__main__":
    sys.exit(main())
