"""gpuctl given values no one means: empty strings, out-of-range numbers, malformed names,
and an output it cannot write. Each is refused with a documented exit code, before anything
changes in gpud (an empty value as a usage error: ``gpuctl CMD: error: argument ...`` and
``try 'gpuctl CMD --help'``, anything else in one ``gpuctl:`` line); none ends in a
traceback."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from gpud.api import NodeServicer
from gpud.backend.sim import SimNode
from gpud.cli import output
from gpud.cli.main import build_parser, main
from gpud.cluster.api import ClusterServicer
from gpud.cluster.ports import StaticNodeView
from gpud.telemetry.snapshot import ClearedXids
from gpud.v1 import node_pb2, node_pb2_grpc
from tests.unit.api_support import FakeFaults, make_snapshot, node_info
from tests.unit.test_cluster_gpuctl import leading_agent
from tests.unit.test_gpuctl_run import Node, serving

EXIT_USAGE = 2
EXIT_OUTPUT = 1


@pytest.fixture
def sim() -> SimNode:
    return SimNode([("H100-SXM5-80GB", 3)])


def _usage_error(node: Node, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """``gpuctl ARGV`` refused as a usage error with nothing on stdout; what it said on
    stderr."""
    code = node.ctl(*argv)
    out, err = capsys.readouterr()
    assert (code, out) == (EXIT_USAGE, ""), err
    return err


def _nothing_changed(node: Node, sim: SimNode, faults: FakeFaults) -> None:
    """Refused before anything changed in gpud: no job, no workload, no fault injected."""
    assert node.jobs.registry.all() == []
    assert sim.workloads.list() == []
    assert faults.calls == []


@pytest.fixture
def faults() -> FakeFaults:
    return FakeFaults()


@pytest.fixture
def cleared() -> list[tuple[int, int | None]]:
    return []


@pytest.fixture
def node(sim: SimNode, faults: FakeFaults, cleared: list[tuple[int, int | None]]) -> Iterator[Node]:
    """Jobs, MPS, the node's simulated workloads and faults, its XIDs and the cluster
    service on one socket."""

    def clear_xid(gpu: int, xid: int | None) -> ClearedXids:
        cleared.append((gpu, xid))
        return ClearedXids((), ())

    simulated = NodeServicer(
        snapshots=make_snapshot,
        node_info=node_info,
        workloads=sim.workloads,
        faults=faults,
        clear_xid=clear_xid,
    )
    with serving(
        simulated.register, ClusterServicer(leading_agent(StaticNodeView(gpus={}))).register
    ) as n:
        yield n


REFUSED = [
    # gpud refuses what no client should send
    (
        ("sim", "workload", "start", "--gpu", "0", "--pid", "99999999"),
        "pid: must be in [1, 4194304], got 99999999",
    ),
    (("cluster", "attributes", "--job", "a\nb"), "jobs[0]: 'a\\nb': letters, digits"),
    (("cluster", "attributes", "--job", "ok", "--job", "a b"), "jobs[1]: 'a b': letters"),
]


@pytest.mark.parametrize(("argv", "message"), REFUSED, ids=[" ".join(c[0]) for c in REFUSED])
def test_an_absurd_value_is_refused_in_one_line_changing_nothing(  # noqa: PLR0917 (fixtures)
    node: Node,
    sim: SimNode,
    faults: FakeFaults,
    capsys: pytest.CaptureFixture[str],
    argv: tuple[str, ...],
    message: str,
) -> None:
    err = _usage_error(node, capsys, *argv)
    assert err.startswith("gpuctl: ") and err.count("\n") == 1, err
    assert message in err
    _nothing_changed(node, sim, faults)


EMPTY = [
    # an explicitly empty value is an unset variable, not "the default": every option and
    # argument that takes a value refuses it, as a usage error naming it
    ("jobs add", ("",), "name: give a job name"),
    ("jobs add", ("a", "--owner", ""), "--owner: give a user name"),
    ("jobs add", ("a", "--mig", ""), "--mig: give a MIG profile such as 3g.40gb"),
    ("jobs add", ("a", "--devices", ""), "--devices: give devices: indexes (0, 0:1) or UUIDs"),
    ("jobs add", ("a", "--memory", ""), "--memory: '' is not a size like 20GiB"),
    ("jobs rm", ("",), "name: give a job name"),
    ("jobs ls", ("",), "name: give a job name"),
    ("run", ("--job", "", "--", "true"), "--job: give a job name"),
    ("run", ("--job", "a", "--owner", "", "--", "true"), "--owner: give a user name"),
    ("run", ("--job", "a", "--mig", "", "--", "true"), "--mig: give a MIG profile"),
    ("run", ("--job", "a", "--devices", "", "--", "true"), "--devices: give devices"),
    ("run", ("--job", "a", "--memory", "", "--", "true"), "--memory: '' is not a size"),
    ("env", ("--job", ""), "--job: give a job name"),
    ("queue", ("--leave", ""), "--leave: give an entry id"),
    ("colo advise", ("",), "job: give a job name"),
    ("colo advise", ("a", "--memory", ""), "--memory: '' is not a size"),
    ("net report", ("--job", "", "--iterations", "3"), "--job: give a job name"),
    ("net report", ("--job", "a", "--iterations", "3", "--session", ""), "--session: give a"),
    ("net pin", ("--job", "", "--level", "1"), "--job: give a job name"),
    ("net unpin", ("--job", ""), "--job: give a job name"),
    ("cluster attributes", ("--job", ""), "--job: give a job name"),
    ("cluster attributes", ("--job", "ok", "--job", " "), "--job: give a job name, got ' '"),
    ("mps show", ("--gpu", ""), "--gpu: give a GPU or MIG device"),
    ("mps set", ("--gpu", "", "--threads", "50"), "--gpu: give a GPU or MIG device"),
    ("mps set", ("--gpu", "0", "--memory", ""), "--memory: '' is not a size"),
    ("mig export", ("-c", ""), "-c/--config: give the config's name, got ''"),
    ("mig assert", ("-f", "", "-c", "a"), "-f/--file: give the file's path, got ''"),
    ("mig apply", ("-f", "a", "-c", ""), "-c/--config: give the config's name, got ''"),
    ("sim fault", ("--gpu", "0", "not-supported", ""), "field: give a reading"),
    ("sim fault", ("--gpu", "0", "error", ""), "field: give a reading"),
    (
        "sim workload start",
        ("--gpu", "0", "--pid", "77", "--mig", ""),
        "--mig: give a MIG device index or MIG UUID, got ''",
    ),
    ("sim workload start", ("--gpu", "0", "--pid", "77", "--memory", ""), "--memory: ''"),
    # what names nothing but is not empty, the same way
    ("events", ("--kind", "a\nb"), "--kind: '\\n' at character 2: only printable characters"),
    ("events", ("--follow", "--kind", "\x1b[2J"), "--kind: '\\x1b' at character 1: only"),
    ("jobs add", ("a", "--devices", ","), "--devices: give devices: indexes (0, 0:1) or UUIDs"),
    ("run", ("--job", "a", "--devices", ",,", "--", "true"), "--devices: give devices"),
    # an empty item among devices named: "$A,$B" with B unset, not a job on fewer devices
    *(
        (cmd, (*head, "--devices", bad, *tail), f"--devices: item {n} of {bad!r} is empty")
        for cmd, head, tail in (("jobs add", ("a",), ()), ("run", ("--job", "a"), ("--", "true")))
        for bad, n in (("0,,1", 2), ("0, ,1", 2), ("0,", 2), (" ,1", 1))
    ),
    # no command at all: what is missing and the form, not a run of nothing
    *(
        (
            "run",
            argv,
            "-- CMD ARGS...: give the command to run: gpuctl run --job NAME [options]"
            " -- COMMAND [ARGS...]",
        )
        for argv in (("--job", "a"), ("--job", "a", "--"), ("--job", "a", "--gpus", "1"))
    ),
    ("run", ("--job", "a", "--", ""), "-- CMD ARGS...: give the command's name, got ''"),
    ("run", ("--job", "a", "--", " ", "x"), "-- CMD ARGS...: give the command's name, got ' '"),
    ("sim workload start", ("--gpu", "0", "--pid", "0"), "--pid: 0 is not in 1..4294967295"),
    ("sim workload stop", ("--pid", "0"), "--pid: 0 is not in 1..4294967295"),
]


@pytest.mark.parametrize(
    ("command", "argv", "message"), EMPTY, ids=[f"{c} {' '.join(a)}" for c, a, _ in EMPTY]
)
def test_an_empty_value_is_a_usage_error_naming_its_option(  # noqa: PLR0917 (fixtures)
    node: Node,
    sim: SimNode,
    faults: FakeFaults,
    capsys: pytest.CaptureFixture[str],
    command: str,
    argv: tuple[str, ...],
    message: str,
) -> None:
    err = _usage_error(node, capsys, *command.split(), *argv)
    said, hint = err.splitlines()
    prog = said.split(": error: ")[0]
    assert prog.startswith(f"gpuctl {command}") and hint == f"try '{prog} --help'", err
    assert said.startswith(f"{prog}: error: argument {message}"), err
    _nothing_changed(node, sim, faults)


# (command, argv before the value, the option as argparse names it, the range it takes):
# a number just out of it and one past any integer field gpud has are refused alike
OUT_OF_RANGE = [
    ("events", ("--limit",), "--limit", "0..10000"),
    ("sim fault", ("--gpu", "1", "xid"), "code", "1..999"),
]


@pytest.mark.parametrize(
    ("command", "head", "option", "span", "value"),
    [
        (*case, value)
        for case in OUT_OF_RANGE
        for value in (
            str(int(case[3].split("..")[0]) - 1),
            str(int(case[3].split("..")[1]) + 1),
            "99999999999",
        )
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_a_number_out_of_range_is_refused_saying_the_range_the_command_takes(  # noqa: PLR0917 (fixtures)
    node: Node,
    faults: FakeFaults,
    capsys: pytest.CaptureFixture[str],
    command: str,
    head: tuple[str, ...],
    option: str,
    span: str,
    value: str,
) -> None:
    said = _usage_error(node, capsys, *command.split(), *head, value).splitlines()[0]
    assert said.endswith(f": error: argument {option}: {value} is not in {span}"), said
    assert faults.calls == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("jobs", "add", "a", "--devices", ","), "jobs add: argument --devices: give devices"),
        (("run", "--job", "a", "--", ""), "run: argument -- CMD ARGS...: give the command's"),
        (("run", "--job", "a"), "run: argument -- CMD ARGS...: give the command to run: gpuctl"),
        (("sim", "workload", "stop", "--pid", "0"), "sim workload stop: argument --pid: 0 is"),
    ],
)
def test_under_json_a_value_naming_nothing_is_a_usage_error_naming_its_command(
    node: Node, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    err = _usage_error(node, capsys, "--json", *argv)
    assert json.loads(err)["error"]["message"].startswith(message), err
    assert node.jobs.registry.all() == []


def test_blanks_around_each_device_named_are_dropped() -> None:
    """``--devices "0, 1"``, as people write a list, is ``0,1`` in every command taking it."""
    for argv in (("run", "--job", "a", "--", "true"), ("jobs", "add", "a")):
        args = build_parser().parse_args([*argv[:3], "--devices", " 0, 1 ,0:2", *argv[3:]])
        assert args.devices == ["0", "1", "0:2"], argv
    args = build_parser().parse_args(["run", "--job", "a", "--devices", "0,\t1", "--", "true"])
    assert args.devices == ["0", "1"]


def test_empty_words_after_the_command_name_are_its_own() -> None:
    args = build_parser().parse_args(["run", "--job", "a", "--", "printf", "", "x"])
    assert args.command == ["printf", "", "x"]
    assert build_parser().parse_args(["run", "--job", "a", "true", ""]).command == ["true", ""]


UNSENDABLE = [
    # what gpuctl refuses before sending, another client may send: gpud refuses it too
    ("InjectFault", node_pb2.InjectFaultRequest(gpu=1, kind=node_pb2.FAULT_KIND_XID, xid=99999)),
    ("ClearXid", node_pb2.ClearXidRequest(gpu=1, xid=1000)),
]


@pytest.mark.parametrize(("method", "request_"), UNSENDABLE, ids=[m for m, _ in UNSENDABLE])
def test_gpud_refuses_an_xid_code_no_config_could_name(
    node: Node,
    faults: FakeFaults,
    cleared: list[tuple[int, int | None]],
    method: str,
    request_: object,
) -> None:
    with grpc.insecure_channel(f"unix:{node.socket}") as channel:
        call = getattr(node_pb2_grpc.NodeStub(channel), method)
        with pytest.raises(grpc.RpcError) as caught:
            call(request_, timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "xid: must be an XID code in 1..999, got" in str(caught.value.details())
    assert faults.calls == [] and cleared == []


@pytest.fixture
def socket_path() -> Iterator[Path]:
    with serving() as n:
        yield n.socket


FULL = "cannot write the output: No space left on device"
CLOSED_OR_FULL = [
    # a small answer fails only at the final flush, a large one at its write
    ("> /dev/full", ("version",), EXIT_OUTPUT, FULL),
    ("> /dev/full", ("--json", "jobs", "ls"), EXIT_OUTPUT, FULL),
    (">&-", ("version",), EXIT_OUTPUT, "cannot write the output: stdout is closed"),
    (">&-", ("--json", "jobs", "ls"), EXIT_OUTPUT, "cannot write the output: stdout is closed"),
    (
        "<&-",
        ("mig", "assert", "-f", "-", "-c", "a"),
        EXIT_USAGE,
        "cannot read -: standard input is closed",
    ),
]


@pytest.mark.parametrize(("redirect", "argv", "code", "message"), CLOSED_OR_FULL)
def test_a_closed_or_full_standard_stream_is_said_in_one_line(
    socket_path: Path, redirect: str, argv: tuple[str, ...], code: int, message: str
) -> None:
    if redirect == "> /dev/full" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    gpuctl = [sys.executable, "-m", "gpud.cli.main", "--socket", str(socket_path), *argv]
    done = subprocess.run(
        ["sh", "-c", f'exec "$@" {redirect}', "sh", *gpuctl],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == code, done.stderr
    err = done.stderr
    if "--json" in argv:
        assert err.count("\n") == 1 and f'"message": "{message}"' in err, err
    else:
        assert err == f"gpuctl: {message}\n"


class Full(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(28, "No space left on device")


def test_output_says_what_stdout_could_not_take() -> None:
    out = output.Output(json_output=False, stream=Full())
    with pytest.raises(
        output.OutputError, match="cannot write the output: No space left on device"
    ):
        out.print("a line")
    with pytest.raises(output.OutputError):
        out.print_json({"a": 1})


EXIT_NOT_RUNNING = 3
NO_SOCKET = [
    ("a\nb", "no socket at a\\nb. Start it"),
    ("/tmp/\x1b[2J", "no socket at /tmp/\\x1b[2J. Start it"),
    ("x" * 100_000, f"to {'x' * 200}... (100000 characters). Start it"),
]


@pytest.mark.parametrize(("path", "message"), NO_SOCKET, ids=["newline", "escape", "100kB"])
def test_a_socket_path_no_socket_could_have_is_shown_on_one_short_line(
    capsys: pytest.CaptureFixture[str], path: str, message: str
) -> None:
    code = main(["--socket", path, "status"], env={})
    out, err = capsys.readouterr()
    assert (code, out) == (EXIT_NOT_RUNNING, "")
    assert err.startswith("gpuctl: gpud is not running: ") and err.count("\n") == 1, err
    assert message in err and len(err) < 400


HUGE = "x" * 100_000
HUGE_ARGUMENTS = [
    ("gpus", "--gpu", HUGE),  # argparse's message
    ("--timeout", HUGE, "status"),
    (HUGE,),
    ("jobs", "add", "a", "--memory", HUGE),  # gpuctl's own
    ("--json", "jobs", "add", "a", "--memory", HUGE),
    ("jobs", "add", "a", "--memory", f"it's {HUGE}"),  # repr quotes it "it's x..."
    ("mig", "assert", "-f", HUGE, "-c", "a"),
]


@pytest.mark.parametrize("argv", HUGE_ARGUMENTS, ids=lambda a: " ".join(w[:12] for w in a))
def test_a_huge_argument_is_cut_where_the_error_repeats_it(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    code = main(list(argv), env={})
    out, err = capsys.readouterr()
    assert (code, out) == (EXIT_USAGE, "")
    assert len(err) < 1000, err[:300]
    assert f"{'x' * 150}... (1000" in err  # cut, its length said


# (command, argv before the value, the value, argv after it, what the option says): a value
# that starts with "-" and a digit is the option's value, not an option of its own
NEGATIVE = [
    ("mps set", ("--gpu", "0", "--memory"), "-5GiB", (), "--memory: '-5GiB': a size cannot be"),
    ("jobs add", ("a", "--memory"), "-5GiB", (), "--memory: '-5GiB': a size cannot be negative"),
    ("run", ("--job", "a", "--memory"), "-1.5G", ("--", "true"), "--memory: '-1.5G': a size"),
    ("colo advise", ("a", "--memory"), "-512MiB", (), "--memory: '-512MiB': a size cannot be"),
    ("sim workload start", ("--gpu", "0", "--pid", "77", "--memory"), "-1G", (), "--memory: '-1G'"),
    ("mig apply", ("-f", "a", "-c", "x", "--drain-timeout"), "-5s", (), "--drain-timeout: '-5s'"),
]


@pytest.mark.parametrize(
    ("command", "head", "value", "tail", "message"),
    NEGATIVE,
    ids=[f"{c} {v}" for c, _, v, _, _ in NEGATIVE],
)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_a_negative_size_or_duration_is_refused_naming_its_option(  # noqa: PLR0917 (fixtures)
    node: Node,
    sim: SimNode,
    faults: FakeFaults,
    capsys: pytest.CaptureFixture[str],
    command: str,
    head: tuple[str, ...],
    value: str,
    tail: tuple[str, ...],
    message: str,
    as_json: bool,
) -> None:
    json_flag = ("--json",) if as_json else ()
    err = _usage_error(node, capsys, *json_flag, *command.split(), *head, value, *tail)
    said = json.loads(err)["error"]["message"] if as_json else err.splitlines()[0]
    assert f"argument {message}" in said, err
    assert "expected one argument" not in said, err
    _nothing_changed(node, sim, faults)


@pytest.mark.parametrize("value", ["-0", "-0GiB", "-0.0M"])
def test_a_minus_zero_size_is_refused_as_zero_is_not_as_negative(
    node: Node,
    sim: SimNode,
    faults: FakeFaults,
    capsys: pytest.CaptureFixture[str],
    value: str,
) -> None:
    err = _usage_error(node, capsys, "jobs", "add", "a", "--memory", value)
    said = err.splitlines()[0]
    assert f"argument --memory: {value!r} must be more than zero" in said, err
    assert "negative" not in said, err
    _nothing_changed(node, sim, faults)
