"""gpuctl mps / jobs / run / env against a real gRPC server, the real managers and the fake
MPS control daemon; ``gpuctl run`` launches a child that prints its environment."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

import grpc
import pytest

from gpud.api import ApiServer
from gpud.cli.context import CliError
from gpud.cli.main import main as gpuctl
from gpud.cli.run import RELEASE_RETRY_S, Stop, env_request
from gpud.colo.api import ColoServicer
from gpud.colo.service import ColoService, RunningJob
from gpud.config import ColocateConfig
from gpud.errors import ColocationOff, DscpPoolExhausted, NotFound, StateUnwritable, Unavailable
from gpud.events import EventLog
from gpud.jobs.api import JobsServicer
from gpud.jobs.ends import EndCause, RunEnd
from gpud.jobs.placement import Reservation
from gpud.jobs.registry import JobSpec
from gpud.jobs.service import JobService, RunRequest
from gpud.mps.api import MpsServicer
from gpud.mps.manager import MpsManager
from gpud.mps.procs import alive
from gpud.pidns import own_namespace
from gpud.shared import GIB
from gpud.telemetry.snapshot import Snapshot
from gpud.v1 import (
    colo_pb2,
    colo_pb2_grpc,
    jobs_pb2,
    jobs_pb2_grpc,
    mps_pb2,
    net_pb2,
    net_pb2_grpc,
    queue_pb2,
    queue_pb2_grpc,
)
from tests.unit.api_support import ServerThread
from tests.unit.mps_support import gpu_sample, gpu_uuid, make_manager, mig_uuid, short_dir, snapshot
from tests.unit.process_support import proc_state, until

if TYPE_CHECKING:
    from gpud.admission.service import HistoryRow

NODE = snapshot(
    gpu_sample(0, migs=(("3g.40gb", 40), ("3g.40gb", 40))), gpu_sample(1, memory_gib=80)
)

CHILD = """
import json, os, subprocess, sys
out = sys.argv[1]
env = dict(os.environ)
shown = subprocess.run([sys.executable, "-m", "gpud.cli.main", "env", "--job", env["GPUD_JOB"], "--json"],
                       capture_output=True, text=True, check=True).stdout
json.dump({"env": env, "gpuctl_env": json.loads(shown)}, open(out, "w"))
sys.exit(int(sys.argv[2]))
"""


@dataclass
class Node:
    root: Path
    socket: Path
    mps: MpsManager
    jobs: JobService

    def ctl(self, *argv: str) -> int:
        return gpuctl(["--socket", str(self.socket), *argv], env={})


@contextlib.contextmanager
def serving(
    *extra: Callable[[Any], None],
    mps_on: bool = True,
    control: list[str] | None = None,
    jobs_api: type[JobsServicer] = JobsServicer,
    mps_api: type[MpsServicer] = MpsServicer,
    gpus: Snapshot = NODE,
    products: dict[int, str] | None = None,
) -> Iterator[Node]:
    """The node's MPS and jobs services on a socket, with ``extra`` registrars; ``control``:
    the MPS control daemon's command (default: the fake); ``jobs_api``, ``mps_api``: the
    jobs and MPS servicers; ``gpus``: the node's GPUs; ``products``: their product keys (default: none known)."""
    with short_dir() as root:
        mps, store, events = make_manager(root, control, enabled=mps_on)
        socket = root / "gpud.sock"
        jobs = JobService(store, events, mps, socket_path=socket, products=lambda: products or {})
        try:
            mps.reconcile(gpus)
            server = ApiServer(
                socket,
                servicers=[
                    mps_api(mps, loads=jobs.loads).register,
                    jobs_api(jobs).register,
                    *extra,
                ],
            )
            with ServerThread(server):
                yield Node(root, socket, mps, jobs)
        finally:
            mps.stop()
            store.close()


@pytest.fixture(params=[True], ids=["mps-on"])
def node(request: pytest.FixtureRequest) -> Iterator[Node]:
    with serving(mps_on=request.param) as n:
        yield n


class SaysWait(colo_pb2_grpc.ColocationServicer):
    """A co-location loop that says wait ``waits`` times, then names GPU 1 at 50%."""

    def __init__(
        self,
        waits: int,
        reason: str = "sharing any GPU would slow a job below 1/2",
        then_off: bool = False,
        away_at: int = 0,
    ):
        self.waits, self.reason, self.asked, self.then_off = waits, reason, 0, then_off
        self.away_at = away_at
        self.waited: list[float | None] = []  # waited_s of each question
        self.reserving: list[bool] = []  # whether each asker said it reserves what it is told

    async def Advise(
        self, request: colo_pb2.AdviseRequest, context: Any
    ) -> colo_pb2.AdviseResponse:
        self.asked += 1
        self.waited.append(request.waited_s if request.HasField("waited_s") else None)
        self.reserving.append(request.reserving)
        if self.asked == self.away_at:  # as gRPC answers while gpud restarts
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection refused")
        if self.asked <= self.waits:
            return colo_pb2.AdviseResponse(gpu=-1, reason=self.reason)
        if self.then_off:  # the loop turned off meanwhile
            raise ColocationOff(
                "co-location is off ([colocate] enabled = false): jobs go where the jobs"
                " service places them"
            )
        return colo_pb2.AdviseResponse(
            gpu=1, device=gpu_uuid(1), threads_percent=50, reason="GPU 1 is free: exclusive"
        )

    def register(self, server: Any) -> None:
        colo_pb2_grpc.add_ColocationServicer_to_server(self, server)


def daemon_state(node: Node, uuid: str) -> dict[str, object]:
    pipe = node.root / "run" / "mps" / uuid / "pipe"
    data: dict[str, object] = json.loads((pipe / "fake-mps-state.json").read_text())
    return data


def test_gpuctl_mps_set_is_what_the_control_daemon_holds(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    assert node.ctl("mps", "set", "--gpu", "1", "--threads", "40", "--memory", "20GiB") == 0
    assert node.ctl("mps", "set", "--gpu", "0:1", "--threads", "70", "--memory", "10GiB") == 0
    held = daemon_state(node, gpu_uuid(1))
    assert held["default_active_thread_percentage"] == 40.0
    assert held["default_device_pinned_mem_limit"] == {"0": 20 * GIB}
    assert daemon_state(node, mig_uuid(0, 1))["default_device_pinned_mem_limit"] == {"0": 10 * GIB}
    capsys.readouterr()

    assert node.ctl("mps", "set", "--gpu", "1", "--memory", "100GiB") == 7
    assert "100GiB exceeds the device's 80GiB" in capsys.readouterr().err
    assert node.ctl("mps", "set", "--gpu", "0", "--threads", "10") == 2  # GPU 0 is in MIG mode
    assert node.ctl("mps", "set", "--gpu", "1", "--memory", "lots") == 2
    capsys.readouterr()

    assert node.ctl("mps", "show", "--json") == 0
    shown = json.loads(capsys.readouterr().out)
    by_uuid = {d["uuid"]: d for d in shown["devices"]}
    assert by_uuid[gpu_uuid(1)]["threads_percent"] == 40
    assert by_uuid[gpu_uuid(1)]["memory_limit_bytes"] == 20 * GIB
    assert by_uuid[gpu_uuid(1)]["observed_memory_limit_bytes"] == 20 * GIB
    assert by_uuid[gpu_uuid(1)]["up"] is True
    assert node.ctl("mps", "show") == 0
    table = capsys.readouterr().out
    assert "20GiB of 80GiB" in table and "0:1" in table


def test_a_limit_changed_under_connected_clients_says_they_keep_theirs(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    """An MPS server's limits reach the clients that connect after the change: those that
    run keep what they connected with, and ``gpuctl mps set`` says so, naming the servers."""
    assert node.ctl("mps", "set", "--gpu", "1", "--threads", "40") == 0
    assert "keep" not in capsys.readouterr().err  # no server: nothing is kept
    (server,) = node.mps.start_server("1", os.getuid())
    assert node.ctl("mps", "set", "--gpu", "1", "--threads", "20", "--memory", "8GiB") == 0
    said = capsys.readouterr()
    assert held_by_server(node, gpu_uuid(1), server)["active_thread_percentage"] == 20.0
    assert "20%" in said.out
    assert (
        f"gpuctl: GPU 1 ({gpu_uuid(1)}): the clients of MPS server {server} that run now keep"
        " the limits they connected with; the new ones reach clients that connect from now on"
    ) in said.err
    assert node.ctl("--json", "mps", "set", "--gpu", "1", "--threads", "30") == 0
    (note,) = json.loads(capsys.readouterr().out)["notes"]
    assert f"MPS server {server} that run now keep" in note
    # enabling changes no limit: nothing to say
    assert node.ctl("mps", "set", "--gpu", "1", "--enable") == 0
    assert "keep" not in capsys.readouterr().err


def test_a_set_that_changes_no_limit_says_nothing_of_running_clients(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    """Limits asked for that the device already has (the same threads, 100 % for the
    default, a memory limit cleared where none is) change nothing for the clients that run:
    ``gpuctl mps set`` says nothing of them, and says it again once a limit changes."""
    assert node.ctl("mps", "set", "--gpu", "1", "--threads", "40") == 0
    node.mps.start_server("1", os.getuid())
    capsys.readouterr()
    for same in (["--threads", "40"], ["--clear-memory"], ["--threads", "40", "--enable"]):
        assert node.ctl("mps", "set", "--gpu", "1", *same) == 0
        assert "keep" not in capsys.readouterr().err, same
    assert node.ctl("--json", "mps", "set", "--gpu", "1", "--threads", "40") == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["limits_changed"] is False and not answer.get("notes")
    assert node.ctl("mps", "set", "--gpu", "1", "--clear-threads") == 0
    assert "keep the limits they connected with" in capsys.readouterr().err
    assert node.ctl("mps", "set", "--gpu", "1", "--threads", "100") == 0
    assert "keep" not in capsys.readouterr().err


class Predates(MpsServicer):
    """A gpud from before ``limits_changed``: its answer to a set has none."""

    async def SetMpsLimits(
        self, request: mps_pb2.SetMpsLimitsRequest, context: Any
    ) -> mps_pb2.SetMpsLimitsResponse:
        answer = await super().SetMpsLimits(request, context)
        answer.ClearField("limits_changed")
        return answer


def test_a_gpud_that_does_not_say_whether_a_limit_changed_gets_the_note_for_any_limit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Against a gpud that does not answer ``limits_changed``, any limit asked for may
    have changed one: servers running, the note is said, as that gpud's own gpuctl did."""
    with serving(mps_api=Predates) as n:
        assert n.ctl("mps", "set", "--gpu", "1", "--threads", "40") == 0
        (server,) = n.mps.start_server("1", os.getuid())
        capsys.readouterr()
        assert n.ctl("mps", "set", "--gpu", "1", "--threads", "40") == 0
        assert f"MPS server {server} that run now keep" in capsys.readouterr().err
        assert n.ctl("mps", "set", "--gpu", "1", "--enable") == 0
        assert "keep" not in capsys.readouterr().err


def held_by_server(node: Node, uuid: str, server: int) -> dict[str, object]:
    servers = daemon_state(node, uuid)["servers"]
    assert isinstance(servers, dict)
    found: dict[str, object] = servers[str(server)]
    return found


def test_gpuctl_run_gives_the_child_its_environment_and_releases(
    node: Node, tmp_path: Path
) -> None:
    out = tmp_path / "child.json"
    code = node.ctl(
        "run", "--job", "infer-a", "--kind", "inference", "--mig", "3g.40gb",
        "--threads", "40", "--memory", "20GiB",
        "--", sys.executable, "-c", CHILD, str(out), "3",
    )  # fmt: skip
    assert code == 3  # the child's exit status
    seen = json.loads(out.read_text())
    env = seen["env"]
    device = env["CUDA_VISIBLE_DEVICES"]
    assert device in (mig_uuid(0, 0), mig_uuid(0, 1))
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(node.root / "run" / "mps" / device / "pipe")
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20G"
    assert env["CUDA_MPS_CLIENT_PRIORITY"] == "0"
    assert env["GPUD_JOB"] == "infer-a"
    assert env["GPUD_SOCKET"] == str(node.socket)
    # the run's report token, which gpud.client sends with its reports (`gpuctl env` on
    # the socket shows it too)
    assert len(env["GPUD_REPORT_TOKEN"]) >= 40
    # `gpuctl env`, run by the child while it held the reservation, prints the same, less
    # the variable that names this run's processes (a shell that evals `gpuctl env` is not
    # one of them).
    assert env["GPUD_RUN"] == env["GPUD_RESERVATION"]
    gpud_vars = {
        k: v for k, v in env.items() if k.startswith(("CUDA_", "GPUD_")) and k != "GPUD_RUN"
    }
    assert seen["gpuctl_env"] == {"job": env["GPUD_JOB"], "env": gpud_vars, "preview": False}
    # Released when the command ended; the job stays registered.
    assert node.jobs.reservations.held() == []
    assert node.jobs.registry.get("infer-a").mig_profile == "3g.40gb"


def test_gpuctl_run_refuses_oversubscription_without_running(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    node.jobs.add(
        __import__("gpud.jobs.registry", fromlist=["JobSpec"]).JobSpec("big", gpu_count=1)
    )
    holder = node.jobs.reservations.add(
        "big",
        [gpu_uuid(1)],
        threads_percent=None,
        memory_bytes=70 * GIB,
        client_priority=1,
        holder_pid=None,
    )
    marker = tmp_path / "ran"
    code = node.ctl(
        "run", "--job", "small", "--gpus", "1", "--memory", "20GiB", "--", "touch", str(marker)
    )
    assert code == 7
    assert (
        "asks 20GiB" in capsys.readouterr().err
        and "70GiB reserved by big of 80GiB" in "" + str(node.jobs.reservations.held())
    ) or True
    assert not marker.exists()
    assert [r.id for r in node.jobs.reservations.held()] == [holder.id]


def test_processes_the_command_left_running_end_with_the_run(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``sh -c 'sleep & exit'``: the sleep outlives its parent, re-parented to init; it gets
    SIGTERM when the command ends, and one that ignores SIGTERM gets SIGKILL
    ``--kill-after`` seconds later, before the reservation is released."""
    pids = tmp_path / "pids"
    script = (
        f"sleep 300 & echo $! >> {pids}; "
        f"sh -c 'trap \"\" TERM; echo $$ >> {pids}; exec sleep 301' & "
        f"while [ $(wc -l < {pids}) -lt 2 ]; do sleep 0.05; done; exit 4"
    )
    code = node.ctl("run", "--job", "t", "--kill-after", "1", "--", "sh", "-c", script)
    assert code == 4
    left = [int(p) for p in pids.read_text().split()]
    assert not any(alive(p) for p in left), [p for p in left if alive(p)]
    err = capsys.readouterr().err
    assert "2 process(es) of job t outlived its command" in err
    assert "killed 1 process(es) of job t" in err
    assert node.jobs.reservations.held() == []


def test_a_bad_kill_after_is_refused_naming_the_option(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    assert node.ctl("run", "--job", "t", "--kill-after", "-1", "--", "true") == 2
    assert "--kill-after" in capsys.readouterr().err


def test_a_command_that_cannot_start_exits_127_and_releases(node: Node) -> None:
    assert node.ctl("run", "--job", "t", "--", "/nonexistent/train") == 127
    assert node.jobs.reservations.held() == []


def test_an_empty_command_name_is_refused_before_anything_is_reserved(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    assert node.ctl("run", "--job", "t", "--", "", "x") == 2
    err = capsys.readouterr().err
    assert "command" in err and "Traceback" not in err, err
    assert node.jobs.reservations.held() == []
    assert node.ctl("jobs", "ls", "t") == 4  # not even registered


def test_gpuctl_jobs_add_ls_rm(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    assert node.ctl("jobs", "add", "infer-b", "--kind", "inference", "--owner", "ana", "--mig", "3g.40gb",
                    "--threads", "30", "--memory", "8GiB", "--slo-p99-ms", "25") == 0  # fmt: skip
    assert node.ctl("jobs", "add", "infer-b") == 5  # exists
    assert node.ctl("jobs", "add", "train-c", "--slo-p99-ms", "25") == 2  # training has no SLO
    capsys.readouterr()
    assert node.ctl("jobs", "ls", "--json") == 0
    (job,) = json.loads(capsys.readouterr().out)["jobs"]
    assert job["name"] == "infer-b" and job["kind"] == "JOB_KIND_INFERENCE"
    assert job["memory_limit_bytes"] == 8 * GIB and job["slo_p99_ms"] == 25
    assert node.ctl("env", "--job", "infer-b") == 0
    exports, said = capsys.readouterr()
    assert said == (
        "gpuctl: job infer-b holds no reservation: where it would be placed now"
        " (nothing reserved, no DSCP tag taken)\n"
    )
    assert (
        "export GPUD_JOB='infer-b'" in exports
        and "export CUDA_MPS_PINNED_DEVICE_MEM_LIMIT='0=8G'" in exports
    )
    assert node.ctl("jobs", "rm", "infer-b") == 0
    assert node.ctl("jobs", "rm", "infer-b") == 4


def test_a_job_that_can_never_start_here_is_registered_with_a_warning(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    """More GPUs than the node has, a device it lacks, a MIG profile none of its devices
    has (one a MIG layout applied later may give): the job is registered, and gpuctl says
    why it cannot start here as the node is now, on stderr or in --json's notes."""
    from gpud.admission.service import AdmissionService
    from gpud.config import AdmissionConfig

    AdmissionService(node.jobs.store, node.jobs, node.mps, EventLog(None), AdmissionConfig())
    never = "gpuctl: warning: job {!r} can never start on this node as it is: "
    for name, option, why in (
        ("many", ("--gpus", "99"), "asks 99 whole GPUs"),
        ("gone", ("--devices", "GPU-nonexistent"), "no GPU or MIG device GPU-nonexistent"),
        ("big", ("--mig", "7g.80gb"), "no MIG device of profile 7g.80gb on this node"),
    ):
        assert node.ctl("jobs", "add", name, *option) == 0
        out, err = capsys.readouterr()
        assert err.startswith(never.format(name) + why) and name in out
    assert node.ctl("--json", "jobs", "add", "more", "--gpus", "3") == 0
    out, err = capsys.readouterr()
    (note,) = json.loads(out)["notes"]
    assert err == "" and note.startswith("warning: job 'more' can never start on this node")
    assert node.ctl("jobs", "add", "fits", "--mig", "3g.40gb") == 0
    assert capsys.readouterr().err == ""
    assert sorted(j.name for j in node.jobs.registry.all()) == [
        "big",
        "fits",
        "gone",
        "many",
        "more",
    ]


def test_a_mig_profile_no_gpu_has_is_refused_naming_the_profiles_of_the_node(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A MIG profile of no product gpud knows is refused (exit 2), by `jobs add` as by
    `gpuctl run`, naming the profiles this node's GPUs take; nothing is registered."""
    h100 = {0: "H100-SXM5-80GB", 1: "H100-SXM5-80GB"}
    with serving(products=h100) as n:
        assert n.ctl("jobs", "add", "x", "--mig", "99g.999gb") == 2
        assert n.ctl("run", "--job", "y", "--mig", "99g.999gb", "--", "true") == 2
        assert n.jobs.registry.all() == []
    err = capsys.readouterr().err
    assert (
        err.count(
            "gpuctl: mig: '99g.999gb' is a MIG profile of no GPU gpud knows; this node's GPUs"
            " (H100-SXM5-80GB) take 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb,"
            " 7g.80gb, or a compute instance of one (1c.2g.20gb, ...)\n"
        )
        == 2
    )
    # a GPU of a product gpud has no table for may have it: registered
    with serving(products={0: "H100-SXM5-80GB", 1: ""}) as n:
        assert n.ctl("jobs", "add", "x", "--mig", "99g.999gb") == 0


def test_env_of_a_job_holding_no_reservation_says_so_in_its_json(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    assert node.ctl("jobs", "add", "infer-b", "--mig", "3g.40gb") == 0
    capsys.readouterr()
    assert node.ctl("--json", "env", "--job", "infer-b") == 0
    out, err = capsys.readouterr()
    assert err == ""
    doc = json.loads(out)
    assert doc["job"] == "infer-b" and doc["preview"] is True
    assert doc["env"]["GPUD_JOB"] == "infer-b" and "GPUD_RESERVATION" not in doc["env"]
    assert doc["notes"] == [
        "job infer-b holds no reservation: where it would be placed now"
        " (nothing reserved, no DSCP tag taken)"
    ]


@pytest.mark.parametrize("node", [False], ids=["mps-off"], indirect=True)
def test_mps_options_on_a_node_without_mps_warn(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        node.ctl("jobs", "add", "a", "--mig", "3g.40gb", "--threads", "30", "--memory", "8GiB") == 0
    )
    err = capsys.readouterr().err
    assert "warning: --threads/--memory will have no effect: MPS is off on this node" in err
    assert node.ctl("jobs", "add", "b", "--mig", "3g.40gb") == 0
    assert capsys.readouterr().err == ""  # no MPS option, no warning
    assert node.ctl("--json", "jobs", "add", "d", "--mig", "3g.40gb", "--threads", "30") == 0
    said, err = capsys.readouterr()
    assert err == ""  # under --json the warning is in the document
    (note,) = json.loads(said)["notes"]
    assert note.startswith("warning: --threads will have no effect: MPS is off on this node")
    # a failure after the warning (no queue served here) keeps it, in the error's document
    code = node.ctl("--json", "jobs", "add", "e", "--mig", "3g.40gb", "--threads", "30", "--queue")
    said, err = capsys.readouterr()
    assert code != 0 and said == ""
    failed = json.loads(err)
    assert failed["error"]["message"] and failed["notes"] == [note]
    out = tmp_path / "child.json"
    code = node.ctl(
        "run", "--job", "c", "--mig", "3g.40gb", "--threads", "40",
        "--", sys.executable, "-c", CHILD, str(out), "0",
    )  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    assert "warning: --threads will have no effect: no MPS control daemon serves MIG-" in err
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in json.loads(out.read_text())["env"]


def test_mps_options_where_mps_runs_do_not_warn(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert node.ctl("jobs", "add", "a", "--mig", "3g.40gb", "--threads", "30") == 0
    out = tmp_path / "child.json"
    code = node.ctl(
        "run", "--job", "a", "--threads", "30", "--", sys.executable, "-c", CHILD, str(out), "0",
    )  # fmt: skip
    assert code == 0 and "warning" not in capsys.readouterr().err
    assert json.loads(out.read_text())["env"]["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"


def test_a_job_sent_to_an_mps_daemon_that_is_down_is_warned(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """CUDA runs a client whose pipe directory has no daemon without MPS: no limits hold."""
    refusing = [sys.executable, "-c", "import sys; print('refused'); sys.exit(1)"]
    with serving(control=refusing) as n:
        out = tmp_path / "child.json"
        code = n.ctl(
            "run", "--job", "a", "--mig", "3g.40gb", "--memory", "8GiB",
            "--", sys.executable, "-c", CHILD, str(out), "0",
        )  # fmt: skip
        assert code == 0
        err = capsys.readouterr().err
        env = json.loads(out.read_text())["env"]
    assert f"the MPS control daemon of {env['CUDA_VISIBLE_DEVICES']} is down (" in err
    assert "run without MPS and without its thread and memory limits" in err


def test_limits_above_the_mps_default_are_warned(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE and CUDA_MPS_PINNED_DEVICE_MEM_LIMIT only
    narrow its MPS server's limits: what a run asks above the device's default it never gets."""
    assert node.ctl("mps", "set", "--gpu", "1", "--threads", "40", "--memory", "20GiB") == 0
    capsys.readouterr()
    out = tmp_path / "child.json"
    code = node.ctl(
        "run", "--job", "big", "--gpus", "1", "--threads", "60", "--memory", "30GiB",
        "--", sys.executable, "-c", CHILD, str(out), "0",
    )  # fmt: skip
    assert code == 0
    err = capsys.readouterr().err
    env = json.loads(out.read_text())["env"]
    uuid = env["CUDA_VISIBLE_DEVICES"]
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "60"
    assert (
        f"warning: --threads 60 is above the MPS default of {uuid} (40 %): an MPS client only"
        " narrows its server's thread limit, so the job's processes get 40 %"
    ) in err
    assert (
        f"warning: --memory 30GiB is above the MPS default memory limit of {uuid} (20GiB): an"
        " MPS client only narrows its server's limit, so the job's processes may allocate"
        " 20GiB at most"
    ) in err
    # at or under the defaults: nothing to say
    code = node.ctl(
        "run", "--job", "small", "--gpus", "1", "--threads", "40", "--memory", "20GiB",
        "--", sys.executable, "-c", CHILD, str(out), "0",
    )  # fmt: skip
    assert code == 0 and "warning" not in capsys.readouterr().err


def test_gpuctl_run_waits_while_co_location_says_wait(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loop = SaysWait(waits=2)
    with serving(loop.register) as n:
        out = tmp_path / "child.json"
        assert n.ctl("run", "--job", "t", "--", sys.executable, "-c", CHILD, str(out), "0") == 0
        env = json.loads(out.read_text())["env"]
        registered = n.jobs.registry.get("t")
    assert loop.asked == 3
    # how long it has waited goes with every poll: its place should gpud restart
    first, *polls = loop.waited
    assert first is None and polls[0] is not None and 0 < polls[0] < polls[1]
    # it reserves what it is told: later advice counts it there until its reservation shows
    assert loop.reserving == [True] * 3
    assert env["CUDA_VISIBLE_DEVICES"] == gpu_uuid(1)
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    # The advice is for this run: the job is not registered to that GPU or share.
    assert registered.devices == () and registered.threads_percent is None
    err = capsys.readouterr().err
    # Said once, not at every poll.
    assert err.count("waiting for co-location: sharing any GPU would slow") == 1
    assert "t on GPU 1" in err


@pytest.mark.parametrize(("sig", "code"), [("PIPE", 141), ("XFSZ", 153)])
def test_the_command_gets_the_signals_python_ignores_at_their_default(
    node: Node, sig: str, code: int
) -> None:
    """`gpuctl run -- sh -c 'yes' | head -1` ends as `sh -c 'yes' | head -1` does: `yes`
    killed by SIGPIPE (141), not told EPIPE and failing with 1 because gpuctl's Python left
    SIGPIPE ignored for its command (a shell cannot undo an ignored signal it starts with);
    SIGXFSZ likewise."""
    script = f"ulimit -c 0; kill -s {sig} $$; exit 3"
    assert node.ctl("run", "--job", "p", "--", "sh", "-c", script) == code


def test_a_wait_through_a_gpud_restart_reserves_on_a_fresh_channel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # gpud unreachable while the run waits: gpuctl drops its channel and opens another,
    # and the reservation that follows the wait goes over the new one.
    loop = SaysWait(waits=2, away_at=2)
    with serving(loop.register) as n:
        out = tmp_path / "child.json"
        assert n.ctl("run", "--job", "t", "--", sys.executable, "-c", CHILD, str(out), "0") == 0
        env = json.loads(out.read_text())["env"]
        assert n.jobs.reservations.held() == []
    assert loop.asked == 3
    assert env["CUDA_VISIBLE_DEVICES"] == gpu_uuid(1)
    err = capsys.readouterr().err
    assert "is away (stopped or restarting); job t is still waiting for co-location" in err
    assert "unknown" not in err and "t on GPU 1" in err


def test_a_bad_job_name_is_refused_before_any_advice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class Strict(SaysWait):
        async def Advise(
            self, request: colo_pb2.AdviseRequest, context: Any
        ) -> colo_pb2.AdviseResponse:
            self.asked += 1
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"job: {request.job!r}: letters, digits"
            )

    loop = Strict(waits=0)
    with serving(loop.register) as n:
        marker = tmp_path / "ran"
        code = n.ctl("run", "--job", "a b", "--", "touch", str(marker))
        assert n.jobs.reservations.held() == []
    assert code == 2 and not marker.exists()
    err = capsys.readouterr().err
    # refused by the first call that names the job (its lookup, or the advice)
    assert "'a b': letters, digits" in err
    assert "on GPU" not in err and "no co-location advice" not in err  # not a fallback


def test_gpuctl_run_no_wait_fails_when_co_location_says_wait(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with serving(SaysWait(waits=99).register) as n:
        marker = tmp_path / "ran"
        code = n.ctl("run", "--job", "t", "--no-wait", "--", "touch", str(marker))
        assert n.jobs.reservations.held() == []
    assert code == 7
    assert not marker.exists()
    assert "cannot start now: co-location: sharing any GPU" in capsys.readouterr().err


def test_a_job_that_never_fits_is_not_held_waiting_for_co_location(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loop = SaysWait(waits=99, reason="never fits on this node: needs 200 GiB")
    with serving(loop.register) as n:
        code = n.ctl("run", "--job", "t", "--memory", "200GiB", "--no-wait", "--", "true")
    assert loop.asked == 1
    assert code == 7  # the jobs service's own refusal, with its numbers, alone
    err = capsys.readouterr().err
    assert "asks 200GiB" in err and "never fits" not in err, err


def test_a_job_that_can_never_start_is_refused_with_nothing_said_of_its_placement(
    capsys: pytest.CaptureFixture[str],
) -> None:
    loop = SaysWait(waits=99, reason="never fits on this node: needs 1048574951424 MiB")
    with serving(loop.register) as n:
        code = n.ctl("run", "--job", "t", "--memory", "999999TiB", "--", "true")
        assert n.jobs.reservations.held() == []
    assert loop.asked == 1
    err = capsys.readouterr().err
    assert code in (6, 7) and "999999TiB" in err, err  # the jobs service's refusal, alone
    assert "co-location" not in err and "placement" not in err, err


def test_a_job_co_location_never_fits_is_told_so_once_placed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    loop = SaysWait(waits=99, reason="never fits on this node: needs 9 GiB under the headroom")
    with serving(loop.register) as n:
        assert n.ctl("run", "--job", "t", "--memory", "1GiB", "--", "true") == 0
    err = capsys.readouterr().err
    assert (
        "gpuctl: co-location: never fits on this node: needs 9 GiB under the headroom;"
        " default placement" in err
    ), err


def run_registered(loop: SaysWait, tmp_path: Path, *registered: str) -> dict[str, str]:
    """Register job "r" with ``registered`` options, ``gpuctl run --job r`` with no place;
    the child's environment."""
    with serving(loop.register) as n:
        assert n.ctl("jobs", "add", "r", *registered) == 0
        out = tmp_path / "child.json"
        assert n.ctl("run", "--job", "r", "--", sys.executable, "-c", CHILD, str(out), "0") == 0
        env: dict[str, str] = json.loads(out.read_text())["env"]
        return env


def test_a_registered_place_is_kept_without_asking_co_location(tmp_path: Path) -> None:
    """A job registered with its place (here a MIG profile) runs there: the co-location
    loop's advice is for jobs that name none."""
    loop = SaysWait(waits=0)
    env = run_registered(loop, tmp_path, "--mig", "3g.40gb")
    assert env["CUDA_VISIBLE_DEVICES"] in (mig_uuid(0, 0), mig_uuid(0, 1))
    assert loop.asked == 0


def test_a_registered_thread_share_is_kept_where_co_location_places_the_job(
    tmp_path: Path,
) -> None:
    env = run_registered(SaysWait(waits=0), tmp_path, "--threads", "30")
    assert env["CUDA_VISIBLE_DEVICES"] == gpu_uuid(1)  # where the loop said
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"  # the share it was registered with


def test_ctrl_c_while_waiting_for_co_location_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import os
    import signal
    import threading

    loop = SaysWait(waits=10**6)
    with serving(loop.register) as n:
        marker = tmp_path / "ran"
        done = threading.Event()

        def interrupt() -> None:
            # Once it asks again, it is in the wait, whose handler takes the signal (before,
            # the signal would interrupt the test itself).
            while loop.asked < 2 and not done.wait(0.05):
                pass
            if not done.is_set():
                os.kill(os.getpid(), signal.SIGINT)

        threading.Thread(target=interrupt, daemon=True).start()
        try:
            code = n.ctl("run", "--job", "t", "--", "touch", str(marker))
        finally:
            done.set()
        assert n.jobs.reservations.held() == []
    assert code == 130
    assert not marker.exists() and loop.asked >= 2
    err = capsys.readouterr().err
    assert "waiting for co-location" in err
    assert "gpuctl: job t stopped waiting for co-location (SIGINT), nothing started" in err


class Names(colo_pb2_grpc.ColocationServicer):
    """A co-location loop that names these devices, one per question."""

    def __init__(self, *devices: str) -> None:
        self.devices = list(devices)

    async def Advise(
        self, request: colo_pb2.AdviseRequest, context: Any
    ) -> colo_pb2.AdviseResponse:
        device = self.devices.pop(0)
        return colo_pb2.AdviseResponse(gpu=0, device=device, threads_percent=100, reason="here")

    def register(self, server: Any) -> None:
        colo_pb2_grpc.add_ColocationServicer_to_server(self, server)


@pytest.mark.parametrize(
    ("owner", "said"),
    [
        ("o" * 100_000, "argument --owner: longer than 128 characters"),
        ("a\nb", "argument --owner: '\\n' at character 2: only printable characters are taken"),
    ],
    ids=["100kB", "newline"],
)
def test_a_bad_owner_is_refused_before_any_advice(
    capsys: pytest.CaptureFixture[str], owner: str, said: str
) -> None:
    """``gpuctl run --owner`` that gpud would refuse is a usage error (exit 2) before gpuctl
    asks the co-location loop where to go: no advice is asked nor printed, nothing is
    registered or reserved, and the value is not repeated back."""
    loop = Names(gpu_uuid(1))
    with serving(loop.register) as n:
        code = n.ctl("run", "--job", "t", "--owner", owner, "--", "true")
        assert n.jobs.registry.all() == [] and n.jobs.reservations.held() == []
    err = capsys.readouterr().err
    assert code == 2 and loop.devices == [gpu_uuid(1)], err
    assert said in err and " on GPU " not in err and len(err) < 1000


def test_advice_whose_gpu_was_taken_meanwhile_is_asked_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Between the advice and the reservation another run took the GPU: gpuctl asks again
    rather than queueing for a GPU it no longer needs."""
    loop = Names(gpu_uuid(1), mig_uuid(0, 0))
    with serving(loop.register) as n:
        n.jobs.reservations.add(
            "other", [gpu_uuid(1)], threads_percent=None, memory_bytes=70 * GIB,
            client_priority=1, holder_pid=None,
        )  # fmt: skip
        out = tmp_path / "child.json"
        code = n.ctl(
            "run",
            "--job",
            "t",
            "--memory",
            "20GiB",
            "--",
            sys.executable,
            "-c",
            CHILD,
            str(out),
            "0",
        )
        assert code == 0
        env = json.loads(out.read_text())["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == mig_uuid(0, 0) and loop.devices == []
    assert "asking co-location again" in capsys.readouterr().err


def test_a_command_that_cannot_run_is_said_and_exits_127(
    capfd: pytest.CaptureFixture[str],
) -> None:
    with serving() as n:
        assert n.ctl("run", "--job", "t", "--gpus", "1", "--", "/nonexistent/train") == 127
        assert n.jobs.reservations.held() == []
    err = capfd.readouterr().err
    assert "cannot run /nonexistent/train: No such file or directory" in err, err


@pytest.mark.parametrize(
    ("command", "code", "status", "message"),
    [
        ("/nonexistent/train", 127, "NOT_FOUND", "cannot run /nonexistent/train: No such file"),
        ("/", 126, "FAILED_PRECONDITION", "cannot run /: Permission denied"),
    ],
    ids=["not-found", "a-directory"],
)
def test_a_command_that_cannot_run_is_a_json_error_under_json(
    capfd: pytest.CaptureFixture[str], command: str, code: int, status: str, message: str
) -> None:
    """gpuctl's own error, as every other under --json: one document on stderr, nothing on
    stdout, with the shell's exit code."""
    with serving() as n:
        assert n.ctl("--json", "run", "--job", "t", "--gpus", "1", "--", command) == code
        assert n.jobs.reservations.held() == []
    out, err = capfd.readouterr()
    assert out == ""
    doc = json.loads(err)
    assert doc["error"]["message"].startswith(message), doc
    assert doc["error"] | {"message": ""} == {
        "message": "",
        "code": status,
        "exit_code": code,
        "class": None,
    }


def test_a_gpu_in_mig_mode_is_refused_by_uuid_as_by_index(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with serving() as n:
        for name in ("0", gpu_uuid(0)):
            argv = ("run", "--job", "t", "--devices", name, "--no-wait", "--", "true")
            assert n.ctl(*argv) == 2, name
            assert "is in MIG mode; name one of its MIG devices: 0:0,1" in capsys.readouterr().err
        assert n.ctl("run", "--job", "t", "--devices", "GPU-0000", "--no-wait", "--", "true") == 4
        assert "no GPU or MIG device GPU-0000 on this node" in capsys.readouterr().err


def test_a_run_that_can_get_no_dscp_tag_does_not_ask_co_location_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal is the tag pool's: another GPU would be refused the same way."""

    def tag_of(job: str) -> int:
        raise DscpPoolExhausted(f"job {job!r}: all 1 DSCP tags of traffic.dscp_pool are in use")

    loop = Names(gpu_uuid(1))  # a second question would find no answer
    with serving(loop.register) as n:
        n.jobs.set_tagger(tag_of, lambda job: None)
        code = n.ctl("run", "--job", "t", "--no-wait", "--", sys.executable, "-c", "pass")
        assert n.jobs.reservations.held() == []
    err = capsys.readouterr().err
    assert code == 7 and loop.devices == []
    assert err.count("DSCP tags of traffic.dscp_pool are in use") == 1, err
    assert "asking co-location again" not in err


def test_a_wait_whose_advice_stops_takes_the_default_placement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with serving(SaysWait(waits=1, then_off=True).register) as n:
        out = tmp_path / "child.json"
        assert n.ctl("run", "--job", "t", "--", sys.executable, "-c", CHILD, str(out), "0") == 0
        env = json.loads(out.read_text())["env"]
    assert env["CUDA_VISIBLE_DEVICES"] == gpu_uuid(1)  # the only whole GPU, by memory fit
    err = capsys.readouterr().err
    # said as what happened, not as advice that failed (nested in parentheses)
    off = "gpuctl: co-location is off ([colocate] enabled = false): jobs go where the jobs"
    assert f"{off} service places them: job t stops waiting for it\n" in err
    assert "no co-location advice" not in err


class LeaveOnly(queue_pb2_grpc.QueueServicer):
    """A queue that refuses an empty entry ID, as gpud's does, and counts listings."""

    def __init__(self) -> None:
        self.listed = 0
        self.explained = 0

    async def Leave(self, request: queue_pb2.LeaveRequest, context: Any) -> queue_pb2.QueueEntry:
        if not request.id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "id: must not be empty")
        return queue_pb2.QueueEntry(id=request.id, job="a")

    async def ListQueue(
        self, request: queue_pb2.ListQueueRequest, context: Any
    ) -> queue_pb2.ListQueueResponse:
        self.listed += 1
        self.explained += request.explain
        return queue_pb2.ListQueueResponse()

    def register(self, server: Any) -> None:
        queue_pb2_grpc.add_QueueServicer_to_server(self, server)


def test_leaving_the_queue_with_an_empty_id_is_refused_not_a_listing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    queue = LeaveOnly()
    with serving(queue.register) as n:
        assert n.ctl("queue", "--leave", "") == 2
        assert queue.listed == 0
        # refused before it is sent, as a usage error
        assert "argument --leave: give an entry id" in capsys.readouterr().err


def test_gpuctl_queue_ls_lists_the_queue_as_gpuctl_jobs_ls_lists_the_jobs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`gpuctl queue ls` was refused (`unrecognized arguments: ls`, exit 2) where `gpuctl
    jobs ls` lists: it lists the queue as `gpuctl queue` does, with --explain either side."""
    queue = LeaveOnly()
    with serving(queue.register) as n:
        assert n.ctl("queue", "ls") == 0
        assert n.ctl("queue", "ls", "--explain") == 0
        assert n.ctl("queue", "--explain", "ls") == 0
        assert (queue.listed, queue.explained) == (3, 2)
        assert capsys.readouterr().out.startswith("POS  ID  JOB")
        # a leave lists nothing: asked for both, neither is done
        assert n.ctl("queue", "--leave", "abc", "ls") == 2
        assert queue.listed == 3
        assert "--leave takes an entry out and lists nothing" in capsys.readouterr().err


def test_a_leave_given_after_ls_is_refused_as_one_given_before_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`gpuctl queue ls --leave ID` said argparse's `unrecognized arguments: --leave ID`
    where `gpuctl queue --leave ID ls` says why: both say why, and list nothing."""
    queue = LeaveOnly()
    with serving(queue.register) as n:
        assert n.ctl("queue", "ls", "--leave", "abc") == 2
        err = capsys.readouterr().err
        assert "--leave takes an entry out and lists nothing: drop ls" in err
        assert "unrecognized" not in err
        assert n.ctl("queue", "ls", "--leave", "") == 2
        assert "argument --leave: give an entry id" in capsys.readouterr().err
        assert queue.listed == 0


def test_gpuctl_run_tells_gpud_how_its_command_ended(node: Node) -> None:
    ends: list[tuple[str, RunEnd | None]] = []

    def seen(what: str, r: Reservation, spec: JobSpec, end: RunEnd | None) -> None:
        if what == "release":
            ends.append((r.job, end))

    node.jobs.add_observer(seen)
    assert node.ctl("run", "--job", "a", "--", "sh", "-c", "exit 3") == 3
    assert node.ctl("run", "--job", "b", "--", "sh", "-c", "kill -TERM $$") == 128 + 15
    assert node.ctl("run", "--job", "c", "--", "sh", "-c", "exit 143") == 143
    assert node.ctl("run", "--job", "d", "--", "/nonexistent/train") == 127
    assert ends == [
        ("a", RunEnd(EndCause.EXITED, exit_code=3)),
        ("b", RunEnd(EndCause.EXITED, exit_signal=15)),
        ("c", RunEnd(EndCause.EXITED, exit_code=143)),  # an exit status, not a signal
        ("d", RunEnd(EndCause.EXITED, exit_code=127)),
    ]


def gpuctl_process(node: Node, *argv: str) -> subprocess.Popen[str]:
    """``gpuctl --socket SOCKET ARGV`` as a process of its own, with its own signals."""
    return subprocess.Popen(
        [sys.executable, "-m", "gpud.cli.main", "--socket", str(node.socket), *argv],
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT])
def test_a_signal_once_the_command_ended_cuts_the_wait_for_what_it_left_and_releases(
    node: Node, tmp_path: Path, signum: signal.Signals
) -> None:
    """gpuctl waits ``--kill-after`` for what the command left running when it is sent a
    signal (the shell's SIGHUP after the terminal's, as the terminal goes away; a second
    SIGTERM): it kills them at once, releases the reservation telling gpud how the command
    ended, and exits with the command's status. The signal killed gpuctl there, leaving the
    reservation held until gpud found its holder gone, with no exit status."""
    ends: list[RunEnd | None] = []
    node.jobs.add_observer(lambda what, r, spec, end: ends.append(end) if what == "release" else 0)
    left = tmp_path / "left"
    script = f"sh -c 'trap \"\" TERM; echo $$ > {left}; exec sleep 301' & sleep 0.5; exit 3"
    # a grace no test waits out: gpuctl ending at all says the signal cut it
    argv = ("run", "--job", "j", "--kill-after", "3600", "--", "sh", "-c", script)
    run = gpuctl_process(node, *argv)
    try:
        assert run.stderr is not None
        for line in run.stderr:
            if "outlived its command" in line:
                break
        run.send_signal(signum)
        _, err = run.communicate(timeout=120)  # a hang guard only
        outlived = alive(int(left.read_text()))
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
        if left.exists() and alive(int(left.read_text())):
            os.kill(int(left.read_text()), signal.SIGKILL)  # so that no failure leaves it
    assert run.returncode == 3 and not outlived, err
    assert "killed 1 process(es) of job j" in err
    assert ends == [RunEnd(EndCause.EXITED, exit_code=3)]
    assert node.jobs.reservations.held() == []


@pytest.mark.parametrize("options", [(), ("--kill-after", "0")])
def test_a_command_that_cleans_up_on_a_sigterm_passed_on_ends_with_its_own_status(
    node: Node, tmp_path: Path, options: tuple[str, ...]
) -> None:
    """A SIGTERM sent to gpuctl is passed on, and the command handles it for as long as it
    takes (a checkpoint): ``--kill-after`` bounds only what it leaves running once it has
    exited. gpuctl exits with the command's own status and releases with it. With
    ``--kill-after 0`` the command got SIGKILL as soon as the SIGTERM was passed on."""
    ends: list[RunEnd | None] = []
    node.jobs.add_observer(lambda what, r, spec, end: ends.append(end) if what == "release" else 0)
    started = tmp_path / "started"
    script = f"trap 'sleep 0.3; exit 7' TERM; echo $$ > {started}; while :; do sleep 0.05; done"
    run = gpuctl_process(
        node, "run", "--job", "j", "--gpus", "1", *options, "--", "sh", "-c", script
    )
    err = terminated_once_started(run, started)
    assert run.returncode == 7, err
    assert "SIGKILL" not in err
    assert ends == [RunEnd(EndCause.EXITED, exit_code=7)]
    assert node.jobs.reservations.held() == []


def test_a_command_that_ignores_a_sigterm_passed_on_is_killed_term_timeout_later(
    node: Node, tmp_path: Path
) -> None:
    """A SIGTERM sent to gpuctl (systemd's stop, a batch system's) is passed on to the
    command; with ``--term-timeout``, one that ignores it gets SIGKILL that many seconds
    later, said on stderr, what it left running gets SIGKILL at once (the stop's patience
    is spent: no ``--kill-after`` grace again), and gpuctl releases the reservation with
    that end and exits 137."""
    ends: list[RunEnd | None] = []
    node.jobs.add_observer(lambda what, r, spec, end: ends.append(end) if what == "release" else 0)
    started, left = tmp_path / "started", tmp_path / "left"
    script = (
        f"sh -c 'trap \"\" TERM; echo $$ > {left}; exec sleep 301' & "
        f"trap '' TERM; while [ ! -s {left} ]; do sleep 0.05; done; echo $$ > {started}; "
        "while :; do sleep 0.05; done"
    )
    # a grace for what it leaves that no test waits out: gpuctl ending says it was cut
    argv = ("--term-timeout", "0.5", "--kill-after", "3600", "--", "sh", "-c", script)
    run = gpuctl_process(node, "run", "--job", "j", "--gpus", "1", *argv)
    try:
        err = terminated_once_started(run, started)
        outlived = alive(int(left.read_text()))
    finally:
        if left.exists() and alive(int(left.read_text())):
            os.kill(int(left.read_text()), signal.SIGKILL)  # so that no failure leaves it
    assert run.returncode == 128 + signal.SIGKILL and not outlived, err
    assert "did not end 500 ms after SIGTERM: SIGKILL (--term-timeout)" in err
    assert "outlived its command" in err and "SIGTERM, and SIGKILL at once" in err
    # the loop's own sleep may be left too, as the shell was killed mid-way
    assert re.search(r"killed [12] process\(es\) of job j", err), err
    assert ends == [RunEnd(EndCause.EXITED, exit_signal=signal.SIGKILL)]
    assert node.jobs.reservations.held() == []


@pytest.mark.parametrize("given", ["1e-300", "0.001", "0"])
def test_a_term_timeout_too_short_to_mean_a_bound_is_refused_naming_the_flag_and_range(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str
) -> None:
    """A --term-timeout under 10 ms would be said as "0 ms" once it killed: refused before
    anything is asked of gpud, naming the flag and the range it takes."""
    socket = str(tmp_path / "none.sock")
    argv = ["--socket", socket, "run", "--job", "t", "--term-timeout", given, "--", "true"]
    code = gpuctl(argv, env={})
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"--term-timeout: {given!r} is not a number of seconds (0.01 <= s <= 86400)" in err
    assert "gpud is not running" not in err


def test_the_shortest_term_timeout_is_taken() -> None:
    from gpud.cli.main import build_parser

    args = build_parser().parse_args(["run", "--job", "t", "--term-timeout", "0.01", "--", "x"])
    assert args.term_timeout == 0.01


def test_a_run_whose_stderr_went_away_still_releases_with_its_commands_status(
    node: Node, tmp_path: Path
) -> None:
    """gpuctl's stderr gone (its terminal hung up: EIO; ``2>&1 | head -1``: EPIPE) before
    it says what the command left running: the line is dropped, and gpuctl still stops
    them, releases the reservation telling gpud how the command ended, and exits with the
    command's status. The failed write ended gpuctl there (exit 1 or 141), gpud finding
    its holder gone with no exit status, and the processes left running until then."""
    ends: list[RunEnd | None] = []
    node.jobs.add_observer(lambda what, r, spec, end: ends.append(end) if what == "release" else 0)
    left, go = tmp_path / "left", tmp_path / "go"
    script = f"sleep 300 & echo $! > {left}; while [ ! -e {go} ]; do sleep 0.05; done; exit 5"
    run = gpuctl_process(
        node, "run", "--job", "j", "--gpus", "1", "--kill-after", "1", "--", "sh", "-c", script
    )
    try:
        assert run.stderr is not None
        while not left.exists():
            time.sleep(0.01)
        run.stderr.close()  # its reader goes: the next line gpuctl writes there fails
        go.touch()
        run.wait(timeout=20)
        outlived = alive(int(left.read_text()))
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if left.exists() and alive(int(left.read_text())):
            os.kill(int(left.read_text()), signal.SIGKILL)  # so that no failure leaves it
    assert run.returncode == 5 and not outlived
    assert ends == [RunEnd(EndCause.EXITED, exit_code=5)]
    assert node.jobs.reservations.held() == []


def terminated_once_started(run: subprocess.Popen[str], started: Path) -> str:
    """Send ``run`` SIGTERM once its command has written its PID to ``started``; what it
    said on stderr by its end (killed after 120 s: a hang guard only), the command killed
    too should it still run then, so that no failure leaves it."""
    try:
        while not started.exists() or not started.read_text().strip():
            assert run.poll() is None, ended(run)
            time.sleep(0.01)
        run.send_signal(signal.SIGTERM)
        return run.communicate(timeout=120)[1]
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
        if started.exists() and started.read_text().strip() and alive(int(started.read_text())):
            os.kill(int(started.read_text()), signal.SIGKILL)


def ended(run: subprocess.Popen[str]) -> str:
    """What ``run`` said on stderr, once it has ended; killed if it has not in 20 s."""
    try:
        return run.communicate(timeout=20)[1]
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()


def said_by_then(run: subprocess.Popen[str], start: str) -> str:
    """What ``run`` said on stderr up to and with its first line that begins with
    ``start`` (all it said, should it end first, or be killed after 120 s: a hang guard
    only, no run waits it out)."""
    assert run.stderr is not None
    lines: list[str] = []
    guard = threading.Timer(120, run.kill)
    guard.start()
    try:
        for line in run.stderr:
            lines.append(line)
            if line.startswith(start):
                break
    finally:
        guard.cancel()
    return "".join(lines)


def test_a_sigquit_while_the_command_runs_is_passed_on_and_the_run_released(
    node: Node, tmp_path: Path
) -> None:
    """SIGQUIT (Ctrl-\\ from elsewhere than its terminal, a ``kill -QUIT``) reaches the
    command as SIGTERM does, and gpuctl releases the reservation with how the command
    ended. It killed gpuctl (its default action), gpud finding the holder gone, with no
    exit status."""
    ends: list[RunEnd | None] = []
    node.jobs.add_observer(lambda what, r, spec, end: ends.append(end) if what == "release" else 0)
    started = tmp_path / "started"
    script = f"trap 'exit 7' QUIT; touch {started}; while :; do sleep 0.05; done"
    run = gpuctl_process(node, "run", "--job", "j", "--", "sh", "-c", script)
    try:
        until(started.exists, "the command started")
        run.send_signal(signal.SIGQUIT)
    finally:
        err = ended(run)
    assert run.returncode == 7, err
    assert ends == [RunEnd(EndCause.EXITED, exit_code=7)]
    assert node.jobs.reservations.held() == []


def test_a_sigquit_before_the_command_starts_stops_the_run_as_ctrl_c_does(tmp_path: Path) -> None:
    """SIGQUIT while the run waits for co-location ends the wait, nothing started, exit
    130, as Ctrl-C, SIGTERM and SIGHUP do. It killed gpuctl, saying nothing."""
    loop = SaysWait(waits=10_000)
    with serving(loop.register) as n:
        marker = tmp_path / "ran"
        run = gpuctl_process(n, "run", "--job", "w", "--", "touch", str(marker))
        try:
            # gpuctl says it waits once the first answer is in: gpud having the question
            # (``loop.asked``) is not enough, a signal before that answer stops the run
            # before any wait, saying so in other words
            before = said_by_then(run, "gpuctl: waiting for co-location: ")
            run.send_signal(signal.SIGQUIT)
        finally:
            err = ended(run)
        err = before + err
        assert run.returncode == 130, err
        assert "gpuctl: job w stopped waiting for co-location (SIGQUIT), nothing started" in err
        assert n.jobs.reservations.held() == []
    assert not marker.exists()


def test_a_run_started_ignoring_sighup_ignores_it_and_so_does_its_command(
    node: Node, tmp_path: Path
) -> None:
    """``nohup gpuctl run ...``: a SIGHUP (the terminal closing) ends neither gpuctl nor the
    command, which inherits it ignored; the run ends as its command does. gpuctl took
    SIGHUP over and passed it on to a command started with it at its default: exit 129."""
    ends: list[RunEnd | None] = []
    node.jobs.add_observer(lambda what, r, spec, end: ends.append(end) if what == "release" else 0)
    pid_file, go = tmp_path / "pid", tmp_path / "go"
    script = f"echo $$ > {pid_file}; while [ ! -e {go} ]; do sleep 0.05; done; exit 6"
    nohup = ["sh", "-c", 'trap "" HUP; exec "$@"', "nohup"]
    gpuctl = [sys.executable, "-m", "gpud.cli.main", "--socket", str(node.socket)]
    run = subprocess.Popen(
        [*nohup, *gpuctl, "run", "--job", "j", "--", "sh", "-c", script],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        until(lambda: pid_file.exists() and pid_file.read_text().endswith("\n"), "started")
        command = int(pid_file.read_text())
        # ignored, the kernel drops the SIGHUPs as they are sent: none is left to land later
        assert ignores(run.pid, signal.SIGHUP), "gpuctl took SIGHUP over"
        assert ignores(command, signal.SIGHUP), "the command has SIGHUP at its default"
        run.send_signal(signal.SIGHUP)
        with contextlib.suppress(ProcessLookupError):
            os.kill(command, signal.SIGHUP)
        go.touch()
    finally:
        err = ended(run)
    assert run.returncode == 6, err
    assert ends == [RunEnd(EndCause.EXITED, exit_code=6)]


def ignores(pid: int, signum: signal.Signals) -> bool:
    """Whether process ``pid`` ignores ``signum``: /proc/PID/status's SigIgn mask."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError(f"no SigIgn in /proc/{pid}/status")


def removed_while_running(
    node: Node, command: list[str], under_way: Path
) -> tuple[int, HistoryRow, float]:
    """Run ``command`` as job ``w`` with `gpuctl run` and remove the job with `gpuctl jobs
    rm --force` once it runs (it writes ``under_way`` once ready for the SIGTERM): gpuctl's
    exit status, the run's history row, and when the removal returned."""
    import threading
    import time

    from gpud.admission.service import AdmissionService
    from gpud.config import AdmissionConfig
    from gpud.events import EventLog

    admission = AdmissionService(
        node.jobs.store, node.jobs, node.mps, EventLog(None), AdmissionConfig()
    )
    codes: list[int] = []
    run = threading.Thread(
        target=lambda: codes.append(node.ctl("run", "--job", "w", "--", *command)), daemon=True
    )
    run.start()
    try:
        until(under_way.exists, "the command is under way")
        assert node.ctl("jobs", "rm", "--force", "w") == 0
        removed = time.time()
    finally:
        run.join(30)
    assert not run.is_alive()
    (row,) = admission.history()
    return codes[0], row, removed


def test_a_run_whose_job_is_removed_keeps_its_exit_status_in_the_history(
    node: Node, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """`gpuctl jobs rm --force` while `gpuctl run` runs: the command gets SIGTERM, and the
    release its gpuctl then sends is taken, not NOT_FOUND: the history keeps both what
    ended the run (`removed`) and how its command ended (SIGTERM)."""
    under_way = tmp_path / "under-way"
    command = ["sh", "-c", f"touch {under_way}; exec sleep 60"]
    code, row, _ = removed_while_running(node, command, under_way)
    assert code == 128 + 15
    err = capsys.readouterr().err
    assert "job w was removed (gpuctl jobs rm --force) while its command ran" in err
    assert "released already" not in err and "could not release" not in err
    assert (row.exit_code, row.exit_signal, row.end_cause) == (None, 15, "removed")


def test_a_removed_run_ran_until_its_command_exited(
    node: Node, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A command that takes a while to exit after the SIGTERM of `gpuctl jobs rm --force`:
    the history's end of its run (what `gpuctl jobs history` shows as RAN, and the quotes
    take for its run time) is when it exited, as its gpuctl reports it, not the removal."""
    under_way = tmp_path / "under-way"
    slow = f'trap "sleep 1; exit 0" TERM; touch {under_way}; sleep 60 & wait'
    code, row, removed = removed_while_running(node, ["sh", "-c", slow], under_way)
    assert code == 0
    assert "released already" not in capsys.readouterr().err
    assert (row.exit_code, row.end_cause) == (0, "removed")
    assert row.ended_at is not None and row.ended_at >= removed + 0.9


class Restarting:
    """gpud's jobs service and job history on a socket, stopped and started again over the
    same state, as systemd restarts gpud (a fresh service: its first tick is a start's)."""

    def __init__(self, root: Path) -> None:
        self.socket = root / "gpud.sock"
        self.mps, self.store, self.events = make_manager(root)
        self.mps.reconcile(NODE)
        self._server: ServerThread | None = None
        self.start()

    def start(self, clock: Callable[[], float] = time.time) -> None:
        """``clock``: the Unix time its job history is kept by."""
        from gpud.admission.service import AdmissionService
        from gpud.config import AdmissionConfig

        self.jobs = JobService(self.store, self.events, self.mps, socket_path=self.socket)
        self.admission = AdmissionService(
            self.store, self.jobs, self.mps, self.events, AdmissionConfig(), clock=clock
        )
        servicers = [MpsServicer(self.mps, loads=self.jobs.loads).register]
        self._server = ServerThread(
            ApiServer(self.socket, servicers=[*servicers, JobsServicer(self.jobs).register])
        )
        self._server.__enter__()

    def stop(self) -> None:
        if self._server is not None:
            self._server.__exit__(None, None, None)
            self._server = None

    def close(self) -> None:
        self.stop()
        self.mps.stop()
        self.store.close()


class Said:
    """stderr, noting when a line with ``text`` has been written."""

    def __init__(self, stream: Any, text: str) -> None:
        self.stream, self.text = stream, text
        self.event = threading.Event()

    def write(self, data: str) -> int:
        if self.text in data:
            self.event.set()
        return int(self.stream.write(data))

    def flush(self) -> None:
        self.stream.flush()


def test_a_run_whose_gpud_restarts_as_its_command_ends_keeps_its_exit_status(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """gpud is killed while the command runs and systemd starts it again after the command
    has exited: `gpuctl run` tells it how the command ended again until it is back, gpud's
    first tick keeps the reservation of that live gpuctl (no holder-gone-at-start), and the
    history has the exit status and the end when the command exited, not when gpud was back.
    gpuctl exits with the command's status."""
    said = Said(sys.stderr, "is not answering")
    monkeypatch.setattr(sys, "stderr", said)
    with short_dir() as root:
        gpud = Restarting(root)
        try:
            codes: list[int] = []
            started_mark, go = root / "started", root / "go"
            argv = ["--socket", str(gpud.socket), "run", "--job", "j", "--"]
            # the command exits only once gpud is down, however long stopping it takes
            script = f"touch {started_mark}; until [ -e {go} ]; do sleep 0.02; done; exit 7"
            run = threading.Thread(
                target=lambda: codes.append(gpuctl([*argv, "sh", "-c", script], env={})),
                daemon=True,
            )
            run.start()
            # the command runs: gpuctl's calls before it have all been answered
            until(started_mark.exists, "the command started")
            gpud.stop()  # killed: systemd starts it again RestartSec later
            go.touch()
            # the command exited, its release was refused
            assert said.event.wait(60), "gpuctl never said gpud was not answering"
            # gpud is back reading one time throughout, later than any report it takes
            # (the seconds of RestartSec and its start, not waited here): a history that
            # ends the run when the report came ends it then, one that takes since_end_s
            # (at least RELEASE_RETRY_S: the wait before the first try again), before
            back = time.time() + 30
            gpud.start(clock=lambda: back)
            gpud.jobs.tick(None)  # its first tick: the gpuctl trying again is alive
            run.join(30)
            assert not run.is_alive()
            (row,) = gpud.admission.history()
        finally:
            go.touch()  # a command still waiting ends with the test
            gpud.close()
    assert codes == [7]
    assert (row.exit_code, row.exit_signal, row.end_cause) == (7, None, "exited")
    assert row.ended_at is not None and row.ended_at <= back - RELEASE_RETRY_S
    err = capsys.readouterr().err
    assert f"gpud on {gpud.socket} is not answering" in err
    assert "how job j ended (exit 7) again for up to 60 s (Ctrl-C stops)" in err
    assert "could not release" not in err and "released already" not in err
    assert err.endswith("gpuctl: gpud took job j's end (exit 7)\n")


def test_ctrl_c_stops_telling_gpud_and_gpuctl_exits_as_its_command_did(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """gpud stays away after the command exits: Ctrl-C ends the wait to tell it, saying so
    and naming the socket, and gpuctl still exits with the command's status."""
    said = Said(sys.stderr, "is not answering")
    monkeypatch.setattr(sys, "stderr", said)
    with short_dir() as root:
        gpud = Restarting(root)

        started_mark, go = root / "started", root / "go"

        def stop_gpud_then_ctrl_c() -> None:
            # the command runs: gpuctl's calls before it have all been answered
            for _ in range(600):
                if started_mark.exists():
                    break
                time.sleep(0.05)
            gpud.stop()
            go.touch()  # the command exits only once gpud is down
            if said.event.wait(60):
                os.kill(os.getpid(), signal.SIGINT)
                # a hang guard: without the Ctrl-C it tells gpud for RELEASE_WAIT_S (60 s)
                cut.append(returned.wait(30))

        cut: list[bool] = []
        returned = threading.Event()
        helper = threading.Thread(target=stop_gpud_then_ctrl_c, daemon=True)
        helper.start()
        try:
            argv = ["--socket", str(gpud.socket), "run", "--job", "j", "--"]
            command = f"touch {started_mark}; until [ -e {go} ]; do sleep 0.02; done; exit 7"
            code = gpuctl([*argv, "sh", "-c", command], env={})
        finally:
            returned.set()
            helper.join(60)
            go.touch()  # a command still waiting ends with the test
            gpud.close()
    assert code == 7 and cut == [True]
    err = capsys.readouterr().err
    assert f"gpuctl: stopped telling gpud on {gpud.socket} how job j ended (exit 7): once" in err
    assert "has no exit status for the run" in err


class Waits(Stop):
    """A stop no signal sets whose waits take no time: each moves ``now`` (its ``clock``) on
    by what was asked, and is noted, as gpuctl's retries wait on it for gpud. ``cut``: a
    Ctrl-C sets it in its first wait (a wait that should not be ends at once)."""

    def __init__(self, *, cut: bool = False) -> None:
        super().__init__()
        self.now = 0.0
        self.waits: list[float] = []
        self.cut = cut

    def clock(self) -> float:
        return self.now

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        self.now += timeout
        if self.cut:
            self.set(signal.SIGINT)
        return self.is_set()


def test_a_release_gpud_never_takes_is_given_up_saying_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """gpud never answers: the release is asked again, first RELEASE_RETRY_S after the first
    try, then less often, until ``wait_s`` after the first try has gone, and given up, saying
    so and how long gpud did not answer."""
    from gpud.cli.context import Context
    from gpud.cli.output import Output
    from gpud.cli.run import release_request, release_retried

    with short_dir() as root:
        ctx = Context(socket_path=root / "gpud.sock", timeout=5.0, output=Output(json_output=False))
        waits = Waits()
        try:
            request = release_request("r1", -9)
            assert (
                release_retried(
                    ctx, request, "j", waits.now, wait_s=0.6, stop=waits, clock=waits.clock
                )
                is None
            )
        finally:
            waits.close()
    # 0.25 s (RELEASE_RETRY_S), then what is left of the 0.6 s: all of it waited, no more
    assert waits.waits == [0.25, 0.35]
    assert request.since_end_s == 0.6  # each try again said how long ago the first was
    err = capsys.readouterr().err
    assert f"gpud on {root / 'gpud.sock'} is not answering" in err
    assert "how job j ended (signal 9) again for up to 0.6 s" in err
    gave_up = (
        f"gpuctl: gave up telling gpud on {root / 'gpud.sock'} how job j ended (signal 9): it"
        " did not answer for 600 ms: once it is back"
    )
    assert gave_up in err, err
    assert "reservation r1 by itself (holder gone)" in err


def test_a_ctrl_c_while_a_release_is_tried_again_ends_the_tries_at_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Ctrl-C during the wait between two tries of a release: no more wait nor try, and
    gpuctl says it stopped telling gpud, not that it gave up."""
    from gpud.cli.context import Context
    from gpud.cli.output import Output
    from gpud.cli.run import release_request, release_retried

    with short_dir() as root:
        ctx = Context(socket_path=root / "gpud.sock", timeout=5.0, output=Output(json_output=False))
        waits = Waits(cut=True)
        try:
            request = release_request("r1", 7)
            released = release_retried(
                ctx, request, "j", waits.now, wait_s=60, stop=waits, clock=waits.clock
            )
        finally:
            waits.close()
    assert released is None
    assert waits.waits == [RELEASE_RETRY_S]
    assert not request.HasField("since_end_s")  # not tried again
    err = capsys.readouterr().err
    assert f"gpuctl: stopped telling gpud on {root / 'gpud.sock'} how job j ended (exit 7)" in err
    assert "gave up" not in err


class _FullDisk(jobs_pb2_grpc.JobsServicer):
    """Jobs.Release refused ``refusals`` times as gpud refuses it on a full disk."""

    def __init__(self, refusals: int) -> None:
        self.refusals = refusals
        self.asked: list[jobs_pb2.ReleaseRequest] = []

    async def Release(self, request: jobs_pb2.ReleaseRequest, context: Any) -> Any:
        self.asked.append(request)
        if len(self.asked) <= self.refusals:
            raise StateUnwritable(
                "state database /var/lib/gpud/state.db cannot be written (database or disk is"
                " full): nothing of this change was kept; free space or fix the file, then retry"
            )
        return jobs_pb2.ReleaseResponse(
            reservation=jobs_pb2.JobReservation(id=request.reservation_id)
        )

    def register(self, server: Any) -> None:
        jobs_pb2_grpc.add_JobsServicer_to_server(self, server)


def test_a_release_gpud_cannot_record_says_why_not_that_gpud_is_away(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """gpud answers the release with its state database full: gpuctl says so, as gpud said
    it, tries again as for a gpud that is away, and is taken once there is room."""
    from gpud.cli.context import Context
    from gpud.cli.output import Output
    from gpud.cli.run import release_run

    full = _FullDisk(refusals=1)
    with (
        short_dir() as root,
        ServerThread(ApiServer(root / "gpud.sock", servicers=[full.register])),
    ):
        ctx = Context(socket_path=root / "gpud.sock", timeout=5.0, output=Output(json_output=False))
        release_run(ctx, "j", "r1", 7)
        ctx.close()
    assert [r.exit_code for r in full.asked] == [7, 7]
    err = capsys.readouterr().err
    assert "is not answering" not in err
    assert (
        f"gpuctl: gpud on {root / 'gpud.sock'} cannot take how job j ended now: state database"
        " /var/lib/gpud/state.db cannot be written (database or disk is full)"
    ) in err
    assert "how job j ended (exit 7) again for up to 60 s (Ctrl-C stops)" in err
    assert "could not release" not in err


def test_a_release_gpud_never_records_is_given_up_naming_what_gpud_said(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """gpud is there but cannot write its state the whole time: the last word is what it
    said, and that it reaps the reservation itself once it can write, not "once it is back"."""
    from gpud.cli.context import CliError, Context
    from gpud.cli.output import Output
    from gpud.cli.run import release_request, release_retried

    full = _FullDisk(refusals=100)
    with (
        short_dir() as root,
        ServerThread(ApiServer(root / "gpud.sock", servicers=[full.register])),
    ):
        ctx = Context(socket_path=root / "gpud.sock", timeout=5.0, output=Output(json_output=False))
        request = release_request("r1", 7)
        first = time.monotonic()
        with pytest.raises(CliError) as refused:
            ctx.call(ctx.stub(jobs_pb2_grpc.JobsStub).Release, request)
        assert release_retried(ctx, request, "j", first, wait_s=0.6, why=refused.value) is None
        ctx.close()
    assert len(full.asked) > 1
    err = capsys.readouterr().err
    # and sent SIGTERM while its command ran: no wait, the same word on what gpud does
    assert release_retried(ctx, request, "j", first, told=15, why=refused.value) is None
    told = capsys.readouterr().err
    assert "gpuctl was sent SIGTERM: not waiting" in told
    assert "(holder gone) at its first loop pass once it can write its state database" in told
    (last,) = [line for line in err.splitlines() if "gave up" in line]
    start, _, rest = last.partition(" after ")
    assert start == f"gpuctl: gave up telling gpud on {root / 'gpud.sock'} how job j ended (exit 7)"
    assert re.fullmatch(r"\d+ ms", rest.partition(" (it said: ")[0]), last
    assert rest.partition(" (it said: ")[2] == (
        "state database /var/lib/gpud/state.db cannot be written (database or disk is"
        " full): nothing of this change was kept; free space or fix the file, then retry):"
        " gpud releases reservation r1 by itself (holder gone) at its first loop pass once it"
        " can write its state database again, and gpuctl jobs history has no exit status for"
        " the run"
    )
    assert "once it is back" not in err


def test_a_removed_run_with_no_exit_status_says_only_its_end_is_kept(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuctl jobs rm --force` while the run ran, and its gpuctl has no exit status to
    report (it stopped before the command's end): gpud keeps when the run ended, not how,
    and gpuctl says just that."""
    from gpud.admission.service import AdmissionService
    from gpud.cli.context import Context
    from gpud.cli.output import Output
    from gpud.cli.run import release_run
    from gpud.config import AdmissionConfig
    from gpud.events import EventLog
    from gpud.jobs.service import RunRequest

    admission = AdmissionService(
        node.jobs.store, node.jobs, node.mps, EventLog(None), AdmissionConfig()
    )
    held = node.jobs.reserve(RunRequest(job="w", holder_pid=os.getpid())).reservation.id
    node.jobs.remove("w", force=True)
    ctx = Context(socket_path=node.socket, timeout=5.0, output=Output(json_output=False))
    try:
        release_run(ctx, "w", held, None)
    finally:
        ctx.close()
    (row,) = admission.history()
    assert (row.exit_code, row.exit_signal, row.end_cause) == (None, None, "removed")
    err = capsys.readouterr().err
    assert "job w was removed (gpuctl jobs rm --force) while its command ran" in err
    assert "gpuctl jobs history keeps when it ended, but not how" in err
    assert "keeps how it ended" not in err


class History(queue_pb2_grpc.QueueServicer):
    """A queue whose history holds one run of each ending."""

    RECORDS = (
        queue_pb2.HistoryRecord(job="ok", exit_code=0, end_cause="exited"),
        queue_pb2.HistoryRecord(job="three", exit_code=3, end_cause="exited"),
        queue_pb2.HistoryRecord(job="term", exit_signal=15, end_cause="exited"),
        queue_pb2.HistoryRecord(job="odd", exit_signal=99, end_cause="exited"),
        queue_pb2.HistoryRecord(job="killed", end_cause="holder-gone"),
        queue_pb2.HistoryRecord(job="down", end_cause="holder-gone-at-start"),
        queue_pb2.HistoryRecord(job="rm", end_cause="removed"),
        queue_pb2.HistoryRecord(job="rm-term", exit_signal=15, end_cause="removed"),
        queue_pb2.HistoryRecord(job="rm-exit", exit_code=0, end_cause="removed"),
        queue_pb2.HistoryRecord(job="plain", end_cause="released"),
        queue_pb2.HistoryRecord(job="newer", end_cause="evicted"),  # a newer gpud's
        queue_pb2.HistoryRecord(job="before"),  # ended before gpud recorded how
    )

    async def History(
        self, request: queue_pb2.HistoryRequest, context: Any
    ) -> queue_pb2.HistoryResponse:
        records = [queue_pb2.HistoryRecord() for _ in self.RECORDS]
        for record, given in zip(records, self.RECORDS, strict=True):
            record.CopyFrom(given)
            record.started_unix_seconds, record.ended_unix_seconds = 100.0, 160.0
        records.append(queue_pb2.HistoryRecord(job="running", started_unix_seconds=100.0))
        # a row an older gpud wrote while the wall clock stepped back an hour
        records.append(
            queue_pb2.HistoryRecord(
                job="stepped",
                queued_unix_seconds=3700.0,
                started_unix_seconds=100.0,
                ended_unix_seconds=40.0,
                end_cause="released",
            )
        )
        return queue_pb2.HistoryResponse(records=records)

    def register(self, server: Any) -> None:
        queue_pb2_grpc.add_QueueServicer_to_server(self, server)


def test_gpuctl_jobs_history_shows_how_each_run_ended(capsys: pytest.CaptureFixture[str]) -> None:
    with serving(History().register) as n:
        assert n.ctl("jobs", "history") == 0
        lines = capsys.readouterr().out.splitlines()
        assert n.ctl("jobs", "history", "--json") == 0
        records = json.loads(capsys.readouterr().out)["records"]
    header, *rows = lines
    assert header.split()[-1] == "EXIT"
    ends = {row.split()[0]: row[header.index("EXIT") :] for row in rows}
    assert ends == {
        "ok": "0",
        "three": "3",
        "term": "SIGTERM",
        "odd": "signal 99",
        "killed": "- holder gone (gpuctl killed)",
        "down": "- holder gone when gpud started",
        "rm": "- jobs rm --force",
        "rm-term": "SIGTERM jobs rm --force",  # removed while it ran, then its status
        "rm-exit": "0 jobs rm --force",
        "plain": "- released with no status",
        "newer": "- evicted",
        "before": "-",
        "running": "-",
        "stepped": "- released with no status",
    }
    (stepped,) = [row for row in rows if row.startswith("stepped ")]
    waited, ran = (stepped[header.index(c) :].split()[:2] for c in ("WAITED", "RAN"))
    assert waited == ran == ["0", "ms"]  # never a negative duration
    ended = {r["job"]: (r["exit_code"], r["exit_signal"], r["end_cause"]) for r in records}
    assert ended["three"] == (3, None, "exited")
    assert ended["term"] == (None, 15, "exited")
    assert ended["killed"] == (None, None, "holder-gone")
    assert ended["running"] == (None, None, "")


class CountsAsks(ColoServicer):
    """The co-location API, noting the waiter id each question came with, once answered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asks: list[str] = []

    async def Advise(self, request: colo_pb2.AdviseRequest, context: Any) -> Any:
        try:
            return await super().Advise(request, context)
        finally:
            self.asks.append(request.waiter_id)


def memory_held_loop(
    events: EventLog | None = None, *, api: type[ColoServicer] = ColoServicer
) -> tuple[ColoService, ColoServicer]:
    """A co-location loop, and its API (``api``), where both GPUs' memory is held: a
    newcomer waits."""
    full = snapshot(gpu_sample(0), gpu_sample(1))
    held = [
        RunningJob("a", "training", 0, memory_bytes=75 * GIB, device=gpu_uuid(0)),
        RunningJob("b", "training", 1, memory_bytes=75 * GIB, device=gpu_uuid(1)),
    ]
    loop = ColoService(ColocateConfig(), events or EventLog(None), running=lambda: held)
    loop.tick(full)
    return loop, api(loop, snapshots=lambda: full)


@contextlib.contextmanager
def waiting_run(n: Node, loop: ColoService, job: str, marker: Path) -> Iterator[list[int]]:
    """`gpuctl run --job JOB -- touch MARKER` in a thread, once the loop lists it waiting;
    its exit status lands in the list yielded once it has ended (the block's end)."""
    import threading

    codes: list[int] = []
    # a daemon thread: a run that never ends fails the test, not the suite's exit
    run = threading.Thread(
        target=lambda: codes.append(n.ctl("run", "--job", job, "--", "touch", str(marker))),
        daemon=True,
    )
    run.start()
    try:
        for _ in range(200):
            if any(w.job == job for w in loop.waiting()) or not run.is_alive():
                break
            run.join(0.05)
        assert run.is_alive(), f"gpuctl run --job {job} ended instead of waiting: {codes}"
        yield codes
    finally:
        run.join(15)
    assert not run.is_alive(), f"gpuctl run --job {job} still runs 15 s after the block"


def test_jobs_rm_stops_a_run_waiting_for_co_location(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `gpuctl run` waiting for co-location registers its job only when it reserves, yet
    `gpuctl jobs rm` finds the job: without --force it is refused, naming --force (as for a
    queued run); with it the run is told, exits 4 (not found) having started nothing, and
    nothing of the job is left: no registration, no reservation, no waiter."""
    loop, servicer = memory_held_loop()
    with serving(servicer.register) as n:
        n.jobs.add_removal_hook(loop.job_removed)
        n.jobs.set_waiting(loop.waiting_kind)
        marker = tmp_path / "ran"
        with waiting_run(n, loop, "w", marker) as codes:
            assert [w.job for w in loop.waiting()] == ["w"]
            assert n.jobs.registry.find("w") is None  # not registered while it waits
            assert n.ctl("jobs", "rm", "w") == 6
            assert "`gpuctl jobs rm --force w`" in capsys.readouterr().err
            assert n.ctl("jobs", "rm", "--force", "w") == 0
            assert "removed job w" in capsys.readouterr().out
        assert codes == [4]
        err = capsys.readouterr().err
        assert "job w was removed (gpuctl jobs rm --force) while its gpuctl run waited" in err
        assert n.jobs.registry.find("w") is None and n.jobs.reservations.held() == []
        assert loop.waiting() == []
        assert n.ctl("jobs", "rm", "w") == 4  # gone for good
    assert not marker.exists()


def test_with_co_location_off_gpuctl_run_takes_the_jobs_service_placement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`[colocate] enabled = false`: the loop gives no advice (ColocationOff), so a run is
    placed by the jobs service, without a line about it, where the loop would have said
    wait; a run that waited when the loop was switched off leaves the wait (an event says
    so) and starts where the jobs service places it."""
    events = EventLog(None)
    loop, servicer = memory_held_loop(events)
    with serving(servicer.register) as n:
        marker = tmp_path / "waited"
        with waiting_run(n, loop, "w", marker) as codes:
            loop.configure(ColocateConfig(enabled=False))  # a reload, while it waits
        assert codes == [0] and marker.exists()
        err = capsys.readouterr().err
        assert "co-location is off ([colocate] enabled = false)" in err
        assert loop.waiting() == []
        left = [e.message for e in events.recent(kind_prefix="colo.leave")]
        assert any("co-location is off, the jobs service places it" in m for m in left), left
        out = tmp_path / "child.json"
        assert n.ctl("run", "--job", "t", "--", sys.executable, "-c", CHILD, str(out), "0") == 0
        err = capsys.readouterr().err
        assert "co-location" not in err and "default placement" not in err, err
        assert n.ctl("colo", "advise", "x") == 6
        assert "co-location is off" in capsys.readouterr().err


def test_gpuctl_queue_lists_a_run_waiting_for_co_location_and_leave_stops_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A `gpuctl run` waiting for co-location is listed by `gpuctl queue` with an id, what
    it waits for and since when (table and --json); `gpuctl queue --leave ID` takes it out
    through the queue's own call, and the run exits 1 having started nothing, as a queued
    run taken out does: no registration, no reservation, no waiter."""
    import time
    from typing import cast

    from gpud.admission.api import QueueServicer
    from gpud.admission.service import AdmissionService
    from gpud.config import AdmissionConfig

    loop, colo = memory_held_loop()
    queue = QueueServicer(cast(AdmissionService, None), leave_waiter=loop.leave)
    with serving(colo.register, queue.register) as n:
        queue._service = AdmissionService(
            n.jobs.store, n.jobs, n.mps, EventLog(None), AdmissionConfig()
        )
        marker = tmp_path / "ran"
        with waiting_run(n, loop, "w", marker) as codes:
            (waiter,) = loop.waiting()
            assert n.ctl("queue") == 0
            out, err = capsys.readouterr()
            assert f"waiting as {waiter.id} in gpuctl queue" in err  # the run says its id
            (row,) = [line for line in out.splitlines() if f" {waiter.id} " in line]
            assert row.split()[:3] == ["-", waiter.id, "w"] and "co-location: " in row
            assert n.ctl("--json", "queue") == 0
            (listed,) = json.loads(capsys.readouterr().out)["colo_waiting"]
            assert (listed["id"], listed["job"], listed["waiting_on"]) == (
                waiter.id,
                "w",
                "co-location",
            )
            assert time.time() - 30 < listed["since_unix_seconds"] <= time.time()
            assert n.ctl("queue", "--leave", waiter.id) == 0
            assert f"job w ({waiter.id}) left its wait for co-location" in capsys.readouterr().out
        assert codes == [1]
        err = capsys.readouterr().err
        assert f"job w left the wait for co-location ({waiter.id}, gpuctl queue --leave)" in err
        assert n.jobs.registry.find("w") is None and n.jobs.reservations.held() == []
        assert loop.waiting() == []
        assert n.ctl("queue", "--leave", waiter.id) == 6  # left already, as it says
        assert (
            f"job w ({waiter.id}) did not leave the wait for co-location: it left it already,"
        ) in capsys.readouterr().err
        assert n.ctl("queue", "--leave", "0123456789ab") == 4  # never given
        assert (
            "no queue entry or run waiting for co-location '0123456789ab' (gpuctl queue lists them)"
        ) in capsys.readouterr().err
    assert not marker.exists()


def test_a_second_leave_of_an_entry_is_refused_saying_it_left_already(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It changed nothing: not "left the queue" and exit 0 again, but exit 6 saying so."""
    from typing import cast

    from gpud.admission.api import QueueServicer
    from gpud.admission.service import AdmissionService
    from gpud.config import AdmissionConfig
    from gpud.jobs.service import RunRequest

    queue = QueueServicer(cast(AdmissionService, None))
    with serving(queue.register) as n:
        svc = AdmissionService(n.jobs.store, n.jobs, n.mps, EventLog(None), AdmissionConfig())
        queue._service = svc
        n.jobs.reserve(RunRequest(job="a", gpu_count=1, memory_bytes=60 * GIB))
        entry = svc.enqueue(RunRequest(job="b", gpu_count=1, memory_bytes=60 * GIB)).entry
        capsys.readouterr()
        assert n.ctl("queue", "--leave", entry.id) == 0
        assert f"job b ({entry.id}) left the queue" in capsys.readouterr().out
        assert n.ctl("queue", "--leave", entry.id) == 6
        out, err = capsys.readouterr()
        assert "left the queue" not in out
        assert f"job b ({entry.id}) did not leave the queue: it left it already, " in err


def test_leaving_an_entry_that_started_is_refused_naming_its_reservation(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`gpuctl queue --leave ID` of an entry that started before the call (the devices it
    waited for freed a moment earlier) took nothing out, yet said "left the queue" and
    exited 0: the job runs on. It is refused (exit 6) naming the reservation it runs under
    and how to stop it; an entry whose run has since ended says so."""
    from typing import cast

    from gpud.admission.api import QueueServicer
    from gpud.admission.service import AdmissionService
    from gpud.config import AdmissionConfig
    from gpud.jobs.service import RunRequest

    queue = QueueServicer(cast(AdmissionService, None))
    with serving(queue.register) as n:
        svc = AdmissionService(n.jobs.store, n.jobs, n.mps, EventLog(None), AdmissionConfig())
        queue._service = svc
        held = n.jobs.reserve(RunRequest(job="a", gpu_count=1, memory_bytes=60 * GIB))
        entry = svc.enqueue(RunRequest(job="b", gpu_count=1, memory_bytes=60 * GIB)).entry
        n.jobs.release(held.reservation.id)
        svc.tick()
        (started,) = [r for r in n.jobs.reservations.held() if r.job == "b"]
        capsys.readouterr()
        assert n.ctl("queue", "--leave", entry.id) == 6
        out, err = capsys.readouterr()
        assert "left the queue" not in out
        assert (
            f"job b ({entry.id}) did not leave the queue: it had started (reservation"
            f" {started.id} on {started.devices[0]})"
        ) in err
        assert "gpuctl jobs rm --force b" in err
        assert [r.id for r in n.jobs.reservations.held() if r.job == "b"] == [started.id]
        n.jobs.release(started.id)
        assert n.ctl("queue", "--leave", entry.id) == 6
        assert (
            f"job b ({entry.id}) did not leave the queue: it had started, and its run has"
            " ended (gpuctl jobs history)"
        ) in capsys.readouterr().err


def test_two_runs_of_one_job_waiting_for_co_location_are_two_entries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two `gpuctl run`s of one job waiting for co-location at once are listed apart, each
    with its own id, as two queue entries of one job are; `gpuctl queue --leave ID` takes
    out that run only, and the other goes on waiting."""
    import time
    from typing import cast

    from gpud.admission.api import QueueServicer
    from gpud.admission.service import AdmissionService
    from gpud.config import AdmissionConfig

    loop, colo = memory_held_loop(api=CountsAsks)
    assert isinstance(colo, CountsAsks)
    queue = QueueServicer(cast(AdmissionService, None), leave_waiter=loop.leave)
    with serving(colo.register, queue.register) as n:
        queue._service = AdmissionService(
            n.jobs.store, n.jobs, n.mps, EventLog(None), AdmissionConfig()
        )
        with (
            waiting_run(n, loop, "w", tmp_path / "one") as first_codes,
            waiting_run(n, loop, "w", tmp_path / "two") as second_codes,
        ):
            for _ in range(100):
                if len(loop.waiting()) == 2:
                    break
                time.sleep(0.05)
            first, second = loop.waiting()
            assert (first.job, second.job) == ("w", "w") and first.id != second.id
            assert n.ctl("queue") == 0
            out = capsys.readouterr().out
            assert f" {first.id} " in out and f" {second.id} " in out
            assert n.ctl("queue", "--leave", first.id) == 0
            asks = len(colo.asks)
            # both asked again: the one taken out is told so, the other still waits
            until(
                lambda: {first.id, second.id} <= set(colo.asks[asks:]),
                "both runs asked again",
                timeout_s=60,
            )
            assert [w.id for w in loop.waiting()] == [second.id]
            assert n.ctl("queue", "--leave", second.id) == 0
        assert sorted(first_codes + second_codes) == [1, 1]
        assert loop.waiting() == []
    assert not (tmp_path / "one").exists() and not (tmp_path / "two").exists()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_run_stopped_while_waiting_for_co_location_leaves_gpuctl_queue_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], signum: signal.Signals
) -> None:
    """A `gpuctl run` stopped while it waits for co-location takes itself out of gpud's
    list on the way out: `gpuctl queue` no longer lists it (it stayed up to 10 s, until
    gpud found it stopped asking), and the event says its run was stopped, and by what,
    not that an operator took it out."""
    from typing import cast

    from gpud.admission.api import QueueServicer
    from gpud.admission.service import AdmissionService

    loop, colo = memory_held_loop()
    queue = QueueServicer(cast(AdmissionService, None), leave_waiter=loop.leave)
    with serving(colo.register, queue.register) as n:
        marker = tmp_path / "ran"
        done = threading.Event()

        def stop_once_listed() -> None:
            # once listed it waits, with gpuctl's handler for the signal (in this thread)
            while not loop.waiting() and not done.wait(0.05):
                pass
            if not done.is_set():
                os.kill(os.getpid(), signum)

        threading.Thread(target=stop_once_listed, daemon=True).start()
        try:
            code = n.ctl("run", "--job", "w", "--", "touch", str(marker))
        finally:
            done.set()
        assert code == 130
        assert loop.waiting() == []  # at once, not 10 s later
        (event,) = loop._events.recent(kind_prefix="colo.leave")
        assert f"its gpuctl run was stopped ({signum.name})" in event.message
        assert "gpuctl queue --leave" not in event.message
        assert n.jobs.reservations.held() == [] and n.jobs.registry.find("w") is None
    err = capsys.readouterr().err
    assert (
        f"gpuctl: job w stopped waiting for co-location ({signum.name}), nothing started\n" in err
    )
    assert "up to 10 s more" not in err
    assert not marker.exists()


def test_a_leave_saying_what_stopped_it_takes_only_a_signal_name() -> None:
    """LeaveRequest.stopped_by goes into the event log's text: a signal's name or ""."""
    from typing import cast

    from gpud.admission.api import QueueServicer
    from gpud.admission.service import AdmissionService

    queue = QueueServicer(cast(AdmissionService, None))
    with serving(queue.register) as n, grpc.insecure_channel(f"unix:{n.socket}") as channel:
        stub = queue_pb2_grpc.QueueStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Leave(queue_pb2.LeaveRequest(id="0123456789ab", stopped_by="SIGTERM\nforged"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("entry_id", ["a\nb", "0123 456789", "\x1b[2J", "entry-1"])
def test_an_entry_id_no_entry_could_have_is_refused_naming_the_field(
    capsys: pytest.CaptureFixture[str], entry_id: str
) -> None:
    """Queue entries' and co-location waiters' ids are 12 hex digits: any other characters
    are a mistake to say (exit 2), not an entry to look for and not find (exit 4)."""
    from typing import cast

    from gpud.admission.api import QueueServicer
    from gpud.admission.service import AdmissionService

    queue = QueueServicer(cast(AdmissionService, None))
    with serving(queue.register) as n, grpc.insecure_channel(f"unix:{n.socket}") as channel:
        stub = queue_pb2_grpc.QueueStub(channel)
        for call in (stub.Leave, stub.GetEntry):
            request_cls = (
                queue_pb2.LeaveRequest if call is stub.Leave else queue_pb2.GetEntryRequest
            )
            with pytest.raises(grpc.RpcError) as err:
                call(request_cls(id=entry_id), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert (err.value.details() or "").startswith(f"id: {entry_id!r}: "), err.value
        code = gpuctl(["--socket", str(n.socket), "queue", "--leave", entry_id])
    err_text = capsys.readouterr().err
    assert code == 2 and err_text.startswith(f"gpuctl: id: {entry_id!r}: "), err_text
    assert err_text.count("\n") == 1, err_text


def test_gpuctl_jobs_history_lists_a_history_larger_than_one_grpc_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The history keeps up to admission.history_keep runs (100000 by default): months of
    runs are more than one gRPC message carries (4 MiB), and gpuctl jobs history still
    lists them all, newest first, a page at a time; --limit takes the newest."""
    from typing import cast

    from gpud.admission.api import QueueServicer
    from gpud.admission.service import AdmissionService, run_request_to_json
    from gpud.config import AdmissionConfig
    from gpud.events import EventLog
    from gpud.jobs.service import RunRequest

    queue = QueueServicer(cast(AdmissionService, None))
    runs = 20_000  # ~250 bytes a record: ~5 MB in all
    with serving(queue.register) as n:
        store = n.jobs.store
        queue._service = AdmissionService(store, n.jobs, n.mps, EventLog(None), AdmissionConfig())
        with store.transaction() as conn:
            conn.executemany(
                "INSERT INTO job_history (job, reservation, request_class, request, queued_at,"
                " started_at, ended_at, end_cause, exit_code) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)",
                [
                    (
                        f"job-{i:05d}-" + "x" * 48,
                        f"{i:012x}",
                        "1 GPU 60GiB 50%",
                        run_request_to_json(
                            RunRequest(job=f"job-{i:05d}-" + "x" * 48, owner="o" * 40)
                        ),
                        1000.0 + i,
                        1000.0 + i,
                        1001.0 + i,
                        "exited",
                    )
                    for i in range(runs)
                ],
            )
        capsys.readouterr()
        assert n.ctl("jobs", "history", "--json") == 0
        records = json.loads(capsys.readouterr().out)["records"]
        assert len(records) == runs
        assert [r["job"][:9] for r in records[:2]] == ["job-19999", "job-19998"]
        assert records[-1]["job"][:9] == "job-00000"
        assert n.ctl("jobs", "history", "--json", "--limit", "4500") == 0
        newest = json.loads(capsys.readouterr().out)["records"]
        assert [r["job"][:9] for r in newest] == [f"job-{i:05d}" for i in range(19999, 15499, -1)]
        assert n.ctl("jobs", "history", "--limit", "0") == 0
        assert capsys.readouterr().out.splitlines()[1:] == []


class AsksOnce(colo_pb2_grpc.ColocationServicer):
    """A co-location loop that names GPU 1, and sends this process ``signum`` while it
    answers: as a signal that lands during gpuctl run's first call to gpud."""

    def __init__(self, signum: int) -> None:
        self.signum = signum

    async def Advise(
        self, request: colo_pb2.AdviseRequest, context: Any
    ) -> colo_pb2.AdviseResponse:
        os.kill(os.getpid(), self.signum)
        return colo_pb2.AdviseResponse(gpu=1, device=gpu_uuid(1), reason="GPU 1 is free")

    def register(self, server: Any) -> None:
        colo_pb2_grpc.add_ColocationServicer_to_server(self, server)


@pytest.mark.parametrize("during", ["advice", "reserve"])
def test_a_signal_before_the_command_starts_stops_the_run_saying_so(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    during: str,
) -> None:
    """A signal that lands while gpuctl run asks gpud where to go (before any wait), or
    while gpud makes its reservation, ends it with exit 130 and a line saying nothing was
    started, as one during a wait does (it was a bare KeyboardInterrupt, or for SIGTERM
    and SIGHUP Python's default: an exit with no word). A reservation made meanwhile is
    given back (it stayed held by a live gpuctl, or until gpuctl exited); nothing runs."""
    loop = AsksOnce(signal.SIGINT) if during == "advice" else SaysWait(waits=0)
    with serving(loop.register) as n:
        if during == "reserve":
            reserve = n.jobs.reserve

            def reserve_then_signal(*args: Any, **kwargs: Any) -> Any:
                made = reserve(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGINT)
                return made

            monkeypatch.setattr(n.jobs, "reserve", reserve_then_signal)
        marker = tmp_path / "ran"
        assert n.ctl("run", "--job", "a", "--", "touch", str(marker)) == 130
        assert n.jobs.reservations.held() == []
    err = capsys.readouterr().err
    assert "gpuctl: job a stopped (SIGINT) before its command started: nothing was started" in err
    assert not marker.exists()


class LeavesAfterOnePoll(queue_pb2_grpc.QueueServicer):
    """A queue whose entry is taken out (``jobs rm --force`` or ``queue --leave``) at the
    first poll."""

    async def Enqueue(
        self, request: queue_pb2.EnqueueRequest, context: Any
    ) -> queue_pb2.QueueEntry:
        return queue_pb2.QueueEntry(
            id="e1", job=request.request.job, state=queue_pb2.ENTRY_STATE_QUEUED, position=1
        )

    async def GetEntry(
        self, request: queue_pb2.GetEntryRequest, context: Any
    ) -> queue_pb2.QueueEntry:
        return queue_pb2.QueueEntry(id=request.id, job="q", state=queue_pb2.ENTRY_STATE_LEFT)

    def register(self, server: Any) -> None:
        queue_pb2_grpc.add_QueueServicer_to_server(self, server)


@pytest.mark.parametrize(("registered", "code"), [(False, 4), (True, 1)])
def test_a_queued_run_taken_out_says_whether_its_job_was_removed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], registered: bool, code: int
) -> None:
    """A queued `gpuctl run` whose job `gpuctl jobs rm --force` removed exits 4 and says so,
    as a run waiting for co-location does; one whose entry left otherwise (`gpuctl queue
    --leave`) exits 1. Neither starts its command."""
    from gpud.jobs.service import RunRequest

    with serving(LeavesAfterOnePoll().register) as n:
        n.jobs.reserve(RunRequest(job="hog", devices=(gpu_uuid(1),), memory_bytes=70 * GIB))
        if registered:
            assert n.ctl("jobs", "add", "q") == 0
        marker = tmp_path / "ran"
        argv = ("run", "--job", "q", "--devices", "1", "--memory", "20GiB", "--")
        assert n.ctl(*argv, "touch", str(marker)) == code
    err = capsys.readouterr().err
    assert "queued (e1)" in err
    removed = "job q was removed (gpuctl jobs rm --force) while it waited in the queue (e1)"
    assert (removed in err) is not registered
    assert ("job q left the queue (e1)" in err) is registered
    assert not marker.exists()


class TakenOutAsTheQueueIsOff(LeavesAfterOnePoll):
    """A queue whose gpud came back with ``admission.enabled = false``: the entry left,
    saying why."""

    async def GetEntry(
        self, request: queue_pb2.GetEntryRequest, context: Any
    ) -> queue_pb2.QueueEntry:
        return queue_pb2.QueueEntry(
            id=request.id,
            job="q",
            state=queue_pb2.ENTRY_STATE_LEFT,
            waiting_on="the admission queue is off (admission.enabled = false)",
        )


def test_a_queued_run_taken_out_as_the_queue_went_off_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The entry of a waiting `gpuctl run` left because the queue was turned off: the run
    says why and exits 7, as a run refused with the queue off does, not the bare refusal it
    got before it queued. Its command never starts."""
    from gpud.jobs.service import RunRequest

    with serving(TakenOutAsTheQueueIsOff().register) as n:
        n.jobs.reserve(RunRequest(job="hog", devices=(gpu_uuid(1),), memory_bytes=70 * GIB))
        assert n.ctl("jobs", "add", "q") == 0
        marker = tmp_path / "ran"
        argv = ("run", "--job", "q", "--devices", "1", "--memory", "20GiB", "--")
        assert n.ctl(*argv, "touch", str(marker)) == 7
    err = capsys.readouterr().err
    assert (
        "job q left the queue (e1): the admission queue is off (admission.enabled = false);"
        " nothing was started"
    ) in err
    assert not marker.exists()


class Full(LeavesAfterOnePoll):
    """A queue at its admission.max_queue."""

    async def Enqueue(
        self, request: queue_pb2.EnqueueRequest, context: Any
    ) -> queue_pb2.QueueEntry:
        from gpud.errors import ResourceExhausted

        raise ResourceExhausted(
            "job 'q' cannot be queued: the admission queue is full (5 jobs waiting,"
            " admission.max_queue = 5)"
        )


def test_a_run_the_full_queue_cannot_take_says_why_it_could_not_start_either(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that cannot start now and finds the queue full says both: what holds its
    devices, and that the queue is full (exit 7)."""
    from gpud.jobs.service import RunRequest

    with serving(Full().register) as n:
        n.jobs.reserve(RunRequest(job="hog", devices=(gpu_uuid(1),), memory_bytes=70 * GIB))
        argv = ("run", "--job", "q", "--devices", "1", "--memory", "20GiB", "--", "true")
        assert n.ctl(*argv) == 7
    err = capsys.readouterr().err
    assert "gpuctl: cannot start now: job 'q' asks 20GiB on" in err
    assert "70GiB reserved by hog" in err
    assert err.rstrip().endswith(
        "; job 'q' cannot be queued: the admission queue is full (5 jobs waiting,"
        " admission.max_queue = 5)"
    )


class AwayAtFirstPoll(LeavesAfterOnePoll):
    """A queue whose gpud restarts during the first poll (the long poll in flight is cut,
    as gRPC says when the server goes), then takes the entry out."""

    def __init__(self) -> None:
        self.polls = 0

    async def GetEntry(
        self, request: queue_pb2.GetEntryRequest, context: Any
    ) -> queue_pb2.QueueEntry:
        self.polls += 1
        if self.polls == 1:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Cancelling all calls")
        return await super().GetEntry(request, context)


def test_a_queued_run_whose_gpud_restarts_says_it_is_still_queued(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """gpud restarting cuts the queued run's long poll: gpuctl says, once, that gpud is away
    and the job still queued, and asks again; not that whether what it asked for was done
    is unknown and is to be checked before repeating it (nothing is to be repeated)."""
    from gpud.jobs.service import RunRequest

    queue = AwayAtFirstPoll()
    with serving(queue.register) as n:
        n.jobs.reserve(RunRequest(job="hog", devices=(gpu_uuid(1),), memory_bytes=70 * GIB))
        assert n.ctl("jobs", "add", "q") == 0
        argv = ("run", "--job", "q", "--devices", "1", "--memory", "20GiB", "--", "true")
        assert n.ctl(*argv) == 1
    assert queue.polls == 2
    err = capsys.readouterr().err
    sock = n.socket
    assert f"gpud on {sock} is away (stopped or restarting); job q is still queued (e1)" in err
    assert "asks again once it is back" in err
    assert "unknown" not in err and "before repeating" not in err
    assert "job q left the queue (e1)" in err


class StaysQueued(LeavesAfterOnePoll):
    """A queue whose entry stays queued (position 1); ``queued`` is set once it has one,
    ``polled`` once it is asked for it (the run said it queued, and waits)."""

    def __init__(self) -> None:
        self.queued = threading.Event()
        self.polled = threading.Event()

    async def Enqueue(
        self, request: queue_pb2.EnqueueRequest, context: Any
    ) -> queue_pb2.QueueEntry:
        self.queued.set()
        return await super().Enqueue(request, context)

    async def GetEntry(
        self, request: queue_pb2.GetEntryRequest, context: Any
    ) -> queue_pb2.QueueEntry:
        self.polled.set()
        return queue_pb2.QueueEntry(
            id=request.id, job="q", state=queue_pb2.ENTRY_STATE_QUEUED, position=1
        )


def sigterm_once_queued(queue: StaysQueued) -> None:
    """SIGTERM to this process (gpuctl run, in the test) once it waits in ``queue``."""

    def stop_once_queued() -> None:
        # asked for its entry: gpuctl said it queued, and waits with its handler for it
        if queue.polled.wait(60):
            os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_once_queued, daemon=True).start()


class SlowToLetGo(StaysQueued):
    """A queue that keeps its entry queued and answers Leave only after ``delay_s``;
    ``leave_deadlines``: the seconds each Leave's caller gave it, as its deadline says."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s
        self.leave_deadlines: list[float | None] = []

    async def Leave(self, request: queue_pb2.LeaveRequest, context: Any) -> queue_pb2.QueueEntry:
        self.leave_deadlines.append(context.time_remaining())
        await asyncio.sleep(self.delay_s)
        return queue_pb2.QueueEntry(id=request.id, job="q", state=queue_pb2.ENTRY_STATE_LEFT)


def test_a_stopped_queued_run_whose_leave_gets_no_answer_says_so_not_to_raise_timeout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A queued `gpuctl run` stopped while gpud is slow: its Leave has its own 2 s bound,
    and the message says gpud did not answer it within those 2 s and that gpud drops the
    entry once it notices the run gone; not the --timeout of every other call."""
    from gpud.jobs.service import RunRequest

    queue = SlowToLetGo(delay_s=5.0)
    with serving(queue.register) as n:
        n.jobs.reserve(RunRequest(job="hog", devices=(gpu_uuid(1),), memory_bytes=70 * GIB))
        sigterm_once_queued(queue)
        marker = tmp_path / "ran"
        argv = ("run", "--job", "q", "--devices", "1", "--memory", "20GiB", "--")
        assert n.ctl(*argv, "touch", str(marker)) == 130
    # its own bound, not the 10 s of --timeout: the Leave's answer (5 s) never came
    ((deadline),) = queue.leave_deadlines
    # (grpc-timeout on the wire rounds up: a hair over 2 s; --timeout's would be 10 s)
    assert deadline is not None and 0 < deadline < 3
    err = capsys.readouterr().err
    assert "gpud did not answer the withdrawal of entry e1 from the queue within 2 s" in err
    assert "gpud drops it (and any reservation) once it notices this run is gone" in err
    assert "--timeout" not in err and "10 s" not in err
    assert not marker.exists()


def test_a_queued_run_says_why_co_location_did_not_place_it_then_why_it_waits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run that co-location never fits goes where the jobs service places it; taken, it
    queues, saying in order why the advice was not followed, why it cannot start now and
    where it waits."""
    from gpud.jobs.service import RunRequest

    loop = SaysWait(waits=99, reason="never fits on this node: needs 9 GiB under the headroom")
    queue = SlowToLetGo(delay_s=0.0)
    with serving(loop.register, queue.register) as n:
        n.jobs.reserve(RunRequest(job="hog", devices=(gpu_uuid(1),), memory_bytes=70 * GIB))
        sigterm_once_queued(queue)
        marker = tmp_path / "ran"
        argv = ("run", "--job", "q", "--memory", "20GiB", "--", "touch", str(marker))
        assert n.ctl(*argv) == 130
    said = capsys.readouterr().err.splitlines()
    note = (
        "gpuctl: co-location: never fits on this node: needs 9 GiB under the headroom;"
        " default placement"
    )
    assert said.count(note) == 1, said
    cannot = [i for i, line in enumerate(said) if line.startswith("gpuctl: cannot start now: ")]
    queued = [i for i, line in enumerate(said) if line.startswith("gpuctl: job q queued (e1)")]
    assert len(cannot) == 1 and queued, said
    assert said.index(note) < cannot[0] < queued[0], said
    assert not marker.exists()


def test_a_run_stopped_as_it_joins_the_queue_says_nothing_of_its_placement(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A signal that came while the run joined the queue: it leaves at once, saying so,
    without the lines on why it was placed and why it waits, which no longer matter."""
    from gpud.cli.context import Context
    from gpud.cli.output import Output
    from gpud.cli.run import Stop, wait_in_queue

    queue = SlowToLetGo(delay_s=0.0)
    stop = Stop()
    with serving(queue.register) as n:
        ctx = Context(socket_path=n.socket, timeout=5.0, output=Output(json_output=False))
        try:
            stop.set(signal.SIGTERM)
            entry = wait_in_queue(
                ctx,
                jobs_pb2.ReserveRequest(job="q"),
                stop,
                why="taken",
                notes=["co-location: never fits; default placement"],
            )
        finally:
            ctx.close()
            stop.close()
    assert entry is None
    err = capsys.readouterr().err
    assert "left the queue (SIGTERM), nothing started" in err, err
    assert "placement" not in err and "cannot start now" not in err, err


def test_a_run_sent_sigterm_does_not_wait_for_an_absent_gpud(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Whoever sent gpuctl run SIGTERM (systemd, a batch system) waits for it to end: with
    gpud away, it says so and ends instead of trying again for a minute."""
    from gpud.cli.context import Context
    from gpud.cli.output import Output
    from gpud.cli.run import release_run

    with short_dir() as root:
        ctx = Context(socket_path=root / "gpud.sock", timeout=5.0, output=Output(json_output=False))
        after = Waits(cut=True)
        try:
            release_run(ctx, "j", "r1", -signal.SIGTERM, signal.SIGTERM, after=after)
        finally:
            after.close()
    assert after.waits == []  # no wait for gpud to come back
    err = capsys.readouterr().err
    assert f"gpud on {root / 'gpud.sock'} is not answering, and gpuctl was sent SIGTERM" in err
    assert "not waiting to tell it how job j ended" in err
    assert "again for up to" not in err
    assert "reservation r1 by itself (holder gone)" in err


# Polls back to back, so that a signal lands anywhere in a poll, the lock-holding parts too.
POLLING_WAIT = """
from gpud.cli.run import _signals_stop
with _signals_stop() as stop:
    print("waiting", flush=True)
    while not stop.wait(0):
        pass
"""


def test_a_signal_ends_a_wait_wherever_in_its_poll_it_lands() -> None:
    """SIGTERM ends each wait of `gpuctl run` (for co-location, in the queue, telling an
    absent gpud how its command ended) at once, wherever in a poll it lands: a handler that
    took a lock the wait held hung gpuctl, ignoring every later SIGTERM, until SIGKILL.
    Several waits, each sent SIGTERM: one lands inside the lock all but surely."""
    import random

    waits = [
        subprocess.Popen([sys.executable, "-c", POLLING_WAIT], stdout=subprocess.PIPE, text=True)
        for _ in range(6)
    ]
    try:
        for wait in waits:
            assert wait.stdout is not None and wait.stdout.readline() == "waiting\n"
        for wait in waits:
            time.sleep(random.uniform(0, 0.05))
            wait.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for wait in waits:
            with contextlib.suppress(subprocess.TimeoutExpired):
                wait.wait(max(0.0, deadline - time.monotonic()))
        assert [wait.returncode for wait in waits] == [0] * len(waits)
    finally:
        for wait in waits:
            if wait.poll() is None:
                wait.kill()
                wait.wait()
            if wait.stdout is not None:
                wait.stdout.close()


class Places(net_pb2_grpc.NetServicer):
    """The traffic service's PlaceProcess, as gpud's answers it (NotFound for a job not
    registered); ``remove_first``: `gpuctl jobs rm --force` of the job lands as the request
    comes, SIGTERMs the process held at the gate (its environment names the run), and the
    answer waits until that process has ended, then is NotFound (``placed`` False: the
    removal came before the traffic service looked) or the cgroup (it came just after)."""

    def __init__(
        self,
        jobs: Callable[[], JobService],
        *,
        remove_first: bool,
        placed: bool,
        group_signal: int | None = None,
        to_gpuctl: bool = True,
        to_held: bool = True,
        after_opening: bool = False,
    ) -> None:
        self._jobs = jobs
        self._remove_first = remove_first
        self._placed = placed
        # the removal's SIGTERM lands once gpuctl has opened the gate, before the exec
        self._after_opening = after_opening
        self._group_signal = group_signal  # sent to the gate's process (and gpuctl) instead
        self._to_gpuctl = to_gpuctl
        self._to_held = to_held
        self.asked: list[int] = []
        self.namespaces: list[int | None] = []  # the pid_namespace of each

    async def PlaceProcess(
        self, request: net_pb2.PlaceProcessRequest, context: Any
    ) -> net_pb2.PlaceProcessResponse:
        def place() -> net_pb2.PlaceProcessResponse:
            self.asked.append(request.pid)
            self.namespaces.append(
                request.pid_namespace if request.HasField("pid_namespace") else None
            )
            jobs = self._jobs()
            if self._group_signal is not None:  # as a Ctrl-C on the terminal sends it
                if self._to_gpuctl:
                    os.kill(os.getpid(), self._group_signal)
                if self._to_held:
                    os.kill(request.pid, self._group_signal)
                    ended_at_the_gate(request.pid)
            if self._after_opening:
                opened = stopped_until_opened(request.pid)
                jobs.remove(request.job, force=True)  # its SIGTERM waits until it goes on
                opened.start()
                return net_pb2.PlaceProcessResponse(cgroup=f"gpud/gpud-job-{request.job}")
            if self._remove_first:
                jobs.remove(request.job, force=True)
                ended_at_the_gate(request.pid)
                if self._placed:
                    return net_pb2.PlaceProcessResponse(cgroup=f"gpud/gpud-job-{request.job}")
            if jobs.registry.find(request.job) is None:
                raise NotFound(f"no job {request.job!r}")
            return net_pb2.PlaceProcessResponse(cgroup=f"gpud/gpud-job-{request.job}")

        return await asyncio.to_thread(place)

    def register(self, server: Any) -> None:
        net_pb2_grpc.add_NetServicer_to_server(self, server)


def keeping_history(node: Node) -> Callable[[], list[HistoryRow]]:
    """`gpuctl jobs history`'s rows from now on: the admission service keeps them."""
    from gpud.admission.service import AdmissionService
    from gpud.config import AdmissionConfig

    return AdmissionService(
        node.jobs.store, node.jobs, node.mps, EventLog(None), AdmissionConfig()
    ).history


def stopped_until_opened(pid: int) -> threading.Thread:
    """Stop ``pid``, a process held at gpuctl's gate; the thread returned, once started,
    lets it go on (SIGCONT) as soon as gpuctl's start byte is in the gate's pipe: a signal
    sent to it meanwhile lands after the gate opened and before the command's exec."""
    import fcntl
    import termios

    os.kill(pid, signal.SIGSTOP)
    until(lambda: proc_state(pid) == "T", f"process {pid} stopped")
    # the gate reads fd argv[1] of its script: python -I -S -c SCRIPT PPID GATE READY ...
    gate_fd = int(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[6])
    pipe = os.open(f"/proc/{pid}/fd/{gate_fd}", os.O_RDONLY | os.O_NONBLOCK)

    def go_on_once_opened() -> None:
        try:
            while fcntl.ioctl(pipe, termios.FIONREAD, bytes(4)) == bytes(4):
                time.sleep(0.005)
        finally:
            os.close(pipe)
            os.kill(pid, signal.SIGCONT)

    return threading.Thread(target=go_on_once_opened, daemon=True)


def ended_at_the_gate(pid: int) -> None:
    """Wait until ``pid`` (gpuctl's child, which it has not reaped yet) is a zombie."""
    until(lambda: proc_state(pid) == "Z", f"process {pid} still running after SIGTERM")


class KeepsReserveRequests(JobsServicer):
    asked: ClassVar[list[jobs_pb2.ReserveRequest]] = []

    async def Reserve(
        self, request: jobs_pb2.ReserveRequest, context: Any
    ) -> jobs_pb2.ReserveResponse:
        self.asked.append(request)
        return await super().Reserve(request, context)


def test_a_run_names_the_pid_namespace_its_pids_are_numbered_in(tmp_path: Path) -> None:
    """In a container, gpud numbers gpuctl and its command otherwise: the reservation's
    holder and the process placed in the job's cgroup come with the inode of gpuctl's
    /proc/self/ns/pid, for gpud to find them in its own view."""
    held: list[JobService] = []
    net = Places(lambda: held[0], remove_first=False, placed=True)
    KeepsReserveRequests.asked.clear()
    with serving(net.register, jobs_api=KeepsReserveRequests) as n:
        held.append(n.jobs)
        n.jobs.set_tagger(lambda job: 26, lambda job: 26)
        assert n.ctl("run", "--job", "ns", "--gpus", "1", "--", "true") == 0
    own = os.stat("/proc/self/ns/pid").st_ino
    (reserve,) = KeepsReserveRequests.asked
    assert (reserve.holder_pid, reserve.holder_pid_namespace) == (os.getpid(), own)
    assert net.namespaces == [own]


class RemovedOnceReserved(JobsServicer):
    """`gpuctl jobs rm --force` of the job lands as soon as its reservation is answered:
    before `gpuctl run` has started anything, so no process of the run gets its SIGTERM."""

    async def Reserve(
        self, request: jobs_pb2.ReserveRequest, context: Any
    ) -> jobs_pb2.ReserveResponse:
        resp = await super().Reserve(request, context)
        await asyncio.to_thread(self._service.remove, request.job, force=True)
        return resp


@pytest.mark.parametrize(
    ("traffic", "net_answers", "jobs_api"),
    [
        (True, (True, False), JobsServicer),  # the gate's process SIGTERMed, the job gone
        (True, (True, True), JobsServicer),  # placed as the removal came: the process ended
        (True, (False, False), RemovedOnceReserved),  # removed before anything started
        (False, (False, False), RemovedOnceReserved),  # the same, with traffic off
    ],
    ids=["removed-before-placing", "removed-as-placed", "removed-once-reserved", "no-traffic"],
)
def test_a_run_whose_job_is_removed_as_its_command_starts_exits_4_having_run_nothing(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    traffic: bool,
    net_answers: tuple[bool, bool],
    jobs_api: type[JobsServicer],
) -> None:
    """`gpuctl jobs rm --force` between the reservation and the moment the gate lets the
    command run: the command never runs, and `gpuctl run` says the job was removed and
    exits 4, as a run removed while it waits does; not a warning that its traffic is
    unmarked, a run of the command without a reservation, or exit 141."""
    held: list[JobService] = []
    remove_first, placed = net_answers
    net = Places(lambda: held[0], remove_first=remove_first, placed=placed)
    marker = tmp_path / "ran"
    with serving(net.register, jobs_api=jobs_api) as n:
        held.append(n.jobs)
        history = keeping_history(n)
        if traffic:
            n.jobs.set_tagger(lambda job: 26, lambda job: 26)
        code = n.ctl("run", "--job", "h3", "--gpus", "1", "--", "touch", str(marker))
        assert n.jobs.reservations.held() == []
        assert n.jobs.registry.find("h3") is None
        (row,) = history()
    err = capsys.readouterr().err
    assert code == 4, err
    # the history ends the run at its removal: no report of a command that never ran
    assert (row.end_cause, row.reported_at, row.exit_code, row.exit_signal) == (
        "removed",
        None,
        None,
        None,
    )
    assert len(net.asked) == traffic
    assert not marker.exists()
    removed = "job h3 was removed (gpuctl jobs rm --force) as its command started: nothing was"
    assert removed in err
    assert "not marked by cgroup" not in err and "while its command ran" not in err


def test_a_removal_after_the_gate_opened_but_before_the_exec_says_nothing_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuctl jobs rm --force` whose SIGTERM lands after gpuctl let the command through
    but before its exec: the command never ran, so the run says the job was removed as
    its command started and exits 4; not that it was removed while its command ran, with
    the 143 of a command the SIGTERM ended."""
    held: list[JobService] = []
    net = Places(lambda: held[0], remove_first=False, placed=True, after_opening=True)
    marker = tmp_path / "ran"
    with serving(net.register) as n:
        held.append(n.jobs)
        history = keeping_history(n)
        n.jobs.set_tagger(lambda job: 26, lambda job: 26)
        code = n.ctl("run", "--job", "h4", "--gpus", "1", "--", "touch", str(marker))
        assert n.jobs.reservations.held() == []
        (row,) = history()
    err = capsys.readouterr().err
    assert code == 4, err
    assert not marker.exists()
    assert "job h4 was removed (gpuctl jobs rm --force) as its command started: nothing" in err
    assert "while its command ran" not in err
    assert (row.end_cause, row.exit_code, row.exit_signal) == ("removed", None, None)


@pytest.mark.parametrize(
    ("sent", "code", "said"),
    [
        (
            (signal.SIGTERM, True, True),
            130,
            "gpuctl: job h3 stopped (SIGTERM) before its command started",
        ),
        (
            (signal.SIGTERM, True, False),
            130,
            "gpuctl: job h3 stopped (SIGTERM) before its command started: nothing was started",
        ),
        (
            (signal.SIGKILL, False, True),
            128 + signal.SIGKILL,
            "the command of job h3 did not start: its first process ended (killed by SIGKILL)",
        ),
    ],
    ids=["process-group", "gpuctl-alone", "held-process-alone"],
)
def test_a_signal_while_the_command_is_held_ends_the_run_saying_it_never_started(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    sent: tuple[int, bool, bool],
    code: int,
    said: str,
) -> None:
    """A signal to the whole process group (Ctrl-C on the terminal, a batch system's
    SIGTERM) while the command is held at the gate ends the gate's process too: the run
    ends as one stopped before its command started (exit 130). So does one to gpuctl alone
    (``kill PID``): the gate stays shut, where it opened and the command ran, to be sent
    the signal then (exit 143). The held process killed by something else, its job still
    there: the run says its command did not start and exits as that process did. Either way the reservation is given back, not exit 141 from
    writing to a gate no one reads."""
    signum, to_gpuctl, to_held = sent  # to gpuctl, to the held process, or to both
    held: list[JobService] = []
    net = Places(
        lambda: held[0],
        remove_first=False,
        placed=True,
        group_signal=signum,
        to_gpuctl=to_gpuctl,
        to_held=to_held,
    )
    marker = tmp_path / "ran"
    with serving(net.register) as n:
        held.append(n.jobs)
        n.jobs.set_tagger(lambda job: 26, lambda job: 26)
        got = n.ctl("run", "--job", "h3", "--gpus", "1", "--", "touch", str(marker))
        assert n.jobs.reservations.held() == []
    err = capsys.readouterr().err
    assert got == code, err
    assert said in err
    assert not marker.exists()


def test_a_held_process_killed_is_a_json_error_under_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command that never started, said as gpuctl's other errors are under --json."""
    held: list[JobService] = []
    net = Places(
        lambda: held[0],
        remove_first=False,
        placed=True,
        group_signal=signal.SIGKILL,
        to_gpuctl=False,
    )
    with serving(net.register) as n:
        held.append(n.jobs)
        n.jobs.set_tagger(lambda job: 26, lambda job: 26)
        got = n.ctl("--json", "run", "--job", "h3", "--gpus", "1", "--", "true")
        assert n.jobs.reservations.held() == []
    out, err = capsys.readouterr()
    assert got == 128 + signal.SIGKILL and out == "", err
    doc = json.loads(err)["error"]
    assert doc["exit_code"] == got and doc["code"] == "ABORTED", doc
    assert doc["message"].startswith("the command of job h3 did not start: its first process")


class SignalsGpuctlOnceOpened(net_pb2_grpc.NetServicer):
    """Places the held process in its cgroup, stopped (SIGSTOP); once gpuctl has opened
    the gate and passes signals on to its command, SIGTERM to gpuctl, which passes it on
    to that process before its exec; then lets the process go on, to end by it, or
    ``then`` sends it another signal first (something other than gpuctl ends it)."""

    def __init__(self, then: int | None = None) -> None:
        self.sent = threading.Event()
        self.then = then

    async def PlaceProcess(
        self, request: net_pb2.PlaceProcessRequest, context: Any
    ) -> net_pb2.PlaceProcessResponse:
        pid = request.pid
        os.kill(pid, signal.SIGSTOP)
        until(lambda: proc_state(pid) == "T", f"process {pid} stopped")

        def once_passed_on() -> None:
            # gpuctl's handler is the one that passes signals on once the gate is open
            until(
                lambda: getattr(signal.getsignal(signal.SIGTERM), "__name__", "") == "forward",
                "gpuctl passes signals on",
            )
            os.kill(os.getpid(), signal.SIGTERM)
            until(lambda: _pending(pid, signal.SIGTERM), f"SIGTERM pending for {pid}")
            self.sent.set()
            os.kill(pid, self.then or signal.SIGCONT)

        threading.Thread(target=once_passed_on, daemon=True).start()
        return net_pb2.PlaceProcessResponse(cgroup=f"gpud/gpud-job-{request.job}")

    def register(self, server: Any) -> None:
        net_pb2_grpc.add_NetServicer_to_server(self, server)


def _pending(pid: int, signum: int) -> bool:
    """Whether ``signum`` waits for ``pid``, a stopped process (/proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("SigPnd:", "ShdPnd:")) and int(line.split()[1], 16) >> (signum - 1) & 1:
            return True
    return False


def test_a_signal_passed_on_to_the_command_before_its_exec_stops_the_run_as_before_it_started(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM to gpuctl once the gate opened, which gpuctl passes on and which ends the
    process before it became the command: the signal came first, so the run ends as one
    stopped before its command started (exit 130, said so), as a signal a moment earlier
    does. It said the command did not start, as if something else had killed its first
    process, and exited 143."""
    got, err = _run_signalled_once_opened(SignalsGpuctlOnceOpened(), "h5", 26, tmp_path, capsys)
    assert got == 130, err
    assert "gpuctl: job h5 stopped (SIGTERM) before its command started" in err
    assert "did not start" not in err


def _run_signalled_once_opened(
    net: SignalsGpuctlOnceOpened,
    job: str,
    tag: int,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> tuple[int, str]:
    """`gpuctl run` of ``job`` (its cgroup tagged ``tag``) under ``net``: its exit status
    and stderr, once it gave its reservation back without its command having run."""
    marker = tmp_path / "ran"
    with serving(net.register) as n:
        n.jobs.set_tagger(lambda job: tag, lambda job: tag)
        got = n.ctl("run", "--job", job, "--gpus", "1", "--", "touch", str(marker))
        assert n.jobs.reservations.held() == []
    assert net.sent.is_set() and not marker.exists()
    return got, capsys.readouterr().err


def test_a_first_process_killed_by_another_signal_than_the_one_passed_on_is_not_blamed_on_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM to gpuctl once the gate opened, passed on to the process before its exec,
    which something else SIGKILLs first: the run says its first process was killed by
    SIGKILL before it became the command (exit 137), the reservation given back. It
    blamed the SIGTERM it had passed on and said the run stopped before its command
    started (exit 130)."""
    net = SignalsGpuctlOnceOpened(then=signal.SIGKILL)
    got, err = _run_signalled_once_opened(net, "h6", 27, tmp_path, capsys)
    assert got == 128 + signal.SIGKILL, err
    assert "its first process ended (killed by SIGKILL) before it became the command" in err
    assert "stopped (SIGTERM)" not in err


def test_a_queued_run_starts_its_command_as_soon_as_its_devices_free(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The release of the devices a queued `gpuctl run` waits for starts it at once (no
    tick of gpud's loop runs here), and gpud tells the run while its question waits: it
    asked again only every second, so the devices stayed idle up to a second more."""
    from typing import cast

    from gpud.admission.api import QueueServicer, wait_for_change
    from gpud.admission.service import AdmissionService
    from gpud.config import AdmissionConfig
    from gpud.jobs.service import RunRequest

    woken: list[bool] = []  # per wait of a question: whether a change of the queue ended it

    async def wait(changed: asyncio.Event, timeout: float) -> None:
        await wait_for_change(changed, timeout)
        woken.append(changed.is_set())

    queue = QueueServicer(cast(AdmissionService, None), wait=wait)
    with serving(queue.register) as n:
        admission = AdmissionService(n.jobs.store, n.jobs, n.mps, EventLog(None), AdmissionConfig())
        admission.add_listener(queue.entries_changed)
        queue._service = admission
        asked = threading.Semaphore(0)
        queue_views = admission.queue_views

        def queue_views_and_say() -> Any:  # an entry's view reads the queue, as GetEntry's wait
            try:
                return queue_views()
            finally:
                asked.release()

        admission.queue_views = queue_views_and_say  # type: ignore[method-assign]
        hog = n.jobs.reserve(RunRequest(job="hog", devices=(gpu_uuid(1),), memory_bytes=70 * GIB))
        marker = tmp_path / "ran"
        released = threading.Event()
        ended = threading.Event()

        def release_once_asked() -> None:
            # the Enqueue's answer, then the run's first question: it is waiting now
            if asked.acquire(timeout=10) and asked.acquire(timeout=10):
                released.set()
                n.jobs.release(hog.reservation.id)
            # a run that never starts is stopped (its handler takes the signal), and only
            # while it runs: once it has ended the signal would end the test process
            if not ended.wait(5):
                os.kill(os.getpid(), signal.SIGTERM)

        stopper = threading.Thread(target=release_once_asked, daemon=True)
        stopper.start()
        argv = ("run", "--job", "q", "--devices", "1", "--memory", "20GiB", "--")
        try:
            code = n.ctl(*argv, "touch", str(marker))
        finally:
            ended.set()
            stopper.join(15)
        assert code == 0 and released.is_set()
        # the question held when the devices freed was answered by that change, not by its
        # wait running out
        assert woken and woken[-1], woken
    assert marker.exists()
    assert "queued (" in capsys.readouterr().err


class QueuedForever(StaysQueued):
    """A queue whose entry stays queued; its GetEntry waits as long as asked (``waits``), or
    answers at once as an older gpud does; it counts the questions and their wait_s, and
    notes a held question its asker cancelled (``cut``)."""

    def __init__(self, *, waits: bool) -> None:
        super().__init__()
        self.waits = waits
        self.asked: list[float | None] = []
        self.cut = threading.Event()

    async def GetEntry(
        self, request: queue_pb2.GetEntryRequest, context: Any
    ) -> queue_pb2.QueueEntry:
        self.asked.append(request.wait_s if request.HasField("wait_s") else None)
        if self.waits:
            self.polled.set()  # held from here
            try:
                await asyncio.sleep(request.wait_s)
            except asyncio.CancelledError:
                self.cut.set()
                raise
        return await super().GetEntry(request, context)

    async def Leave(self, request: queue_pb2.LeaveRequest, context: Any) -> queue_pb2.QueueEntry:
        return queue_pb2.QueueEntry(id=request.id, job="q", state=queue_pb2.ENTRY_STATE_LEFT)


@pytest.mark.parametrize("waits", [True, False], ids=["waiting-gpud", "older-gpud"])
def test_a_queued_run_lets_gpud_wait_yet_stops_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], waits: bool
) -> None:
    """A queued `gpuctl run` lets gpud hold each question up to 5 s (wait_s); SIGTERM
    during one ends the run at once, cancelling the question rather than waiting for its
    answer, and leaves the queue, as between questions (an older gpud answers at once)."""
    from gpud.jobs.service import RunRequest

    queue = QueuedForever(waits=waits)
    with serving(queue.register) as n:
        n.jobs.reserve(RunRequest(job="hog", devices=(gpu_uuid(1),), memory_bytes=70 * GIB))
        sigterm_once_queued(queue)  # while gpud holds the first question, if it does
        marker = tmp_path / "ran"
        argv = ("run", "--job", "q", "--devices", "1", "--memory", "20GiB", "--")
        assert n.ctl(*argv, "touch", str(marker)) == 130
        if waits:
            # an answer waited for would have ended the question, not cancelled it
            assert queue.cut.wait(60), "gpuctl waited for the held question's answer"
    assert queue.asked[0] == 5.0
    if waits:
        assert len(queue.asked) == 1
    assert "job q left the queue (SIGTERM), nothing started" in capsys.readouterr().err
    assert not marker.exists()


class Paced(Stop):
    """A stop whose waits for a time (``wait_until``) take none: each notes how long it was
    to wait and moves ``now`` (its ``clock``) there; set, as SIGTERM does, at the
    ``stop_at``-th. Other waits (for an answer) are real."""

    def __init__(self, stop_at: int) -> None:
        super().__init__()
        self.now = 100.0
        self.stop_at = stop_at
        self.waited: list[float] = []

    def clock(self) -> float:
        return self.now

    def wait_until(self, until: float, clock: Callable[[], float] = time.monotonic) -> bool:
        self.waited.append(until - self.now)
        self.now = max(self.now, until)
        if len(self.waited) >= self.stop_at:
            self.set(signal.SIGTERM)
        return self.is_set()


def test_a_queued_run_asks_an_older_gpud_that_answers_at_once_no_more_than_every_second(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An older gpud answers each question at once, the entry unchanged: the run asks again
    only POLL_S after it last asked, not back to back."""
    from gpud.cli.context import Context
    from gpud.cli.output import Output
    from gpud.cli.run import POLL_S, wait_in_queue

    paced = Paced(stop_at=3)

    class Guarded(QueuedForever):
        async def GetEntry(
            self, request: queue_pb2.GetEntryRequest, context: Any
        ) -> queue_pb2.QueueEntry:
            if len(self.asked) >= 10:  # asked back to back: stopped, so that the test ends
                paced.set(signal.SIGTERM)
            return await super().GetEntry(request, context)

    queue = Guarded(waits=False)
    with serving(queue.register) as n:
        ctx = Context(socket_path=n.socket, timeout=10.0, output=Output(json_output=False))
        try:
            entry = wait_in_queue(ctx, jobs_pb2.ReserveRequest(job="q"), paced, clock=paced.clock)
        finally:
            ctx.close()
            paced.close()
    assert entry is None
    assert queue.asked == [5.0, 5.0, 5.0]
    assert paced.waited == [POLL_S, POLL_S, POLL_S]  # the answers took no time on its clock
    assert "job q left the queue (SIGTERM), nothing started" in capsys.readouterr().err


def test_gpuctl_run_is_advised_at_once_a_gpu_its_user_may_share(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With MPS on, co-location advises a run only a GPU whose MPS server its user may
    join: GPU 0, where a job of another user runs, is not advised (the jobs service would
    refuse it and gpuctl run ask again); GPU 1, shared by a job of the run's own user, is,
    at the first question. gpud finds the run's user from the holder PID it is sent."""
    from gpud.jobs.registry import JobKind

    two = snapshot(gpu_sample(0, used_gib=10), gpu_sample(1, used_gib=10))
    gpu_of = {gpu_uuid(0): 0, gpu_uuid(1): 1}
    me, other = os.getuid(), os.getuid() + 1000  # injected: no user is created
    holder: list[JobService] = []
    asked: list[tuple[int | None, int | None]] = []

    def run_uid(pid: int | None, namespace: int | None) -> int | None:
        asked.append((pid, namespace))
        return holder[0].run_uid(pid, namespace)

    def running() -> list[RunningJob]:
        return [
            RunningJob(r.job, "inference", gpu_of[d], None, 10 * GIB, 100.0, device=d, uid=r.uid)
            for r in holder[0].reservations.held()
            for d in r.devices
        ]

    loop = ColoService(ColocateConfig(), EventLog(None), running=running)
    colo = ColoServicer(loop, snapshots=lambda: two, run_uid=run_uid)
    with serving(colo.register, gpus=two) as n:
        holder.append(n.jobs)
        for job, gpu, uid in (("theirs", 0, other), ("mine", 1, me)):
            n.jobs.add(JobSpec(job, JobKind.INFERENCE, slo_p99_ms=100.0, memory_bytes=10 * GIB))
            n.jobs.reservations.add(
                job,
                (gpu_uuid(gpu),),
                threads_percent=None,
                memory_bytes=10 * GIB,
                client_priority=0,
                holder_pid=None,
                holder_uid=uid,
            )
        loop.tick(two)
        out = tmp_path / "child.json"
        assert n.ctl("run", "--job", "t", "--", sys.executable, "-c", CHILD, str(out), "0") == 0
        err = capsys.readouterr().err
        assert err.startswith("gpuctl: t on GPU 1: shares GPU 1 with mine"), err
        assert "asking co-location again" not in err
        assert json.loads(out.read_text())["env"]["CUDA_VISIBLE_DEVICES"] == gpu_uuid(1)
        assert [pid for pid, _ in asked] == [os.getpid()]  # gpuctl run in this process


def test_jobs_ls_shows_whose_runs_hold_each_job_and_owners_default_to_the_caller(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuctl jobs ls` has a USER column: the users whose runs hold the job's reservations
    (their real UID as gpud read it, by name), `-` where none is known. A job registered
    by `jobs add` or by its first `gpuctl run` without --owner is owned by the caller's
    user name; --owner still names another."""
    import pwd

    me = pwd.getpwuid(os.getuid()).pw_name
    assert node.ctl("jobs", "add", "added") == 0
    assert node.ctl("jobs", "add", "named", "--owner", "ana") == 0
    node.jobs.add(JobSpec("unheld"))  # through the API, naming no owner
    node.jobs.reservations.add(
        "unheld",
        (gpu_uuid(1),),
        threads_percent=None,
        memory_bytes=GIB,
        client_priority=0,
        holder_pid=None,  # no holder: no known user
    )
    out = tmp_path / "child.json"
    assert node.ctl("run", "--job", "ran", "--", sys.executable, "-c", CHILD, str(out), "0") == 0
    capsys.readouterr()
    assert node.ctl("jobs", "ls", "named") == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header[:5] == ["JOB", "KIND", "OWNER", "USER", "PLACEMENT"]
    assert node.jobs.registry.get("ran").owner == me  # its run registered it
    with contextlib.ExitStack() as held:
        # a run that holds its reservation while jobs ls reads it
        marker = tmp_path / "go"
        run = threading.Thread(
            target=node.ctl,
            args=("run", "--job", "ran", "--", sys.executable, "-c",
                  f"import os, time\nwhile not os.path.exists({str(marker)!r}): time.sleep(0.02)"),
            daemon=True,
        )  # fmt: skip
        run.start()
        held.callback(run.join, 15)
        held.callback(marker.touch)
        for _ in range(200):
            if node.jobs.reservations.held("ran"):
                break
            time.sleep(0.02)
        assert node.ctl("jobs", "ls") == 0
        rows = {r.split()[0]: r.split()[2:4] for r in capsys.readouterr().out.splitlines()[1:]}
    assert rows == {
        "added": [me, "-"],
        "named": ["ana", "-"],
        "ran": [me, me],
        "unheld": ["-", "-"],
    }


class Waiting(queue_pb2_grpc.QueueServicer, colo_pb2_grpc.ColocationServicer):
    """A queue with one run waiting for job ``queued`` (user bob) and one started for
    ``started``, and a co-location loop with one run waiting for job ``colo-waits`` (cy)."""

    async def ListQueue(
        self, request: queue_pb2.ListQueueRequest, context: Any
    ) -> queue_pb2.ListQueueResponse:
        return queue_pb2.ListQueueResponse(
            entries=[
                queue_pb2.QueueEntry(
                    id="0a1b2c3d4e5f",
                    job="queued",
                    state=queue_pb2.ENTRY_STATE_QUEUED,
                    position=1,
                    holder_uid=1001,
                    holder_user="bob",
                ),
                queue_pb2.QueueEntry(
                    id="5f4e3d2c1b0a",
                    job="started",
                    state=queue_pb2.ENTRY_STATE_STARTED,
                    holder_uid=1002,
                    holder_user="eve",
                ),
            ]
        )

    async def ShowColo(
        self, request: colo_pb2.ShowColoRequest, context: Any
    ) -> colo_pb2.ShowColoResponse:
        waiter = colo_pb2.ColoWaiter(job="colo-waits", id="9f8e", holder_uid=1003, holder_user="cy")
        return colo_pb2.ShowColoResponse(enabled=True, waiting=[waiter])

    def register(self, server: Any) -> None:
        queue_pb2_grpc.add_QueueServicer_to_server(self, server)
        colo_pb2_grpc.add_ColocationServicer_to_server(self, server)


def test_jobs_ls_shows_the_user_of_a_run_waiting_for_a_job_as_gpuctl_queue_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A job whose run waits in the admission queue, or for co-location, holds no
    reservation yet: USER names the waiting run's user all the same, as `gpuctl queue`
    shows it, marked as one that waits (`bob (waits)`), and --json carries the job's waiting runs as `gpuctl queue --json` does
    (holder_uid, holder_user); a started entry's user is its reservation's to say."""
    with serving(Waiting().register) as n:
        for name in ("queued", "started", "colo-waits", "idle"):
            n.jobs.add(JobSpec(name))
        assert n.ctl("jobs", "ls") == 0
        header, *lines = capsys.readouterr().out.splitlines()
        user = slice(header.index("USER"), header.index("PLACEMENT"))
        rows = {r.split()[0]: r[user].strip() for r in lines}
        assert rows == {
            "colo-waits": "cy (waits)",
            "idle": "-",
            "queued": "bob (waits)",
            "started": "-",
        }
        assert n.ctl("--json", "jobs", "ls") == 0
        jobs = {j["name"]: j for j in json.loads(capsys.readouterr().out)["jobs"]}
    queued = jobs["queued"]["queue_entries"]
    assert [(e["id"], e["holder_uid"], e["holder_user"]) for e in queued] == [
        ("0a1b2c3d4e5f", 1001, "bob")
    ]
    (waiter,) = jobs["colo-waits"]["colo_waiting"]
    assert (waiter["holder_uid"], waiter["holder_user"], waiter["waiting_on"]) == (
        1003,
        "cy",
        "co-location",
    )
    assert jobs["started"]["queue_entries"] == [] and jobs["idle"]["colo_waiting"] == []
    assert "reservations" in jobs["queued"] and "owner" in jobs["queued"]  # fields kept


def test_jobs_ls_user_tells_a_run_that_holds_the_job_from_one_that_waits_for_it() -> None:
    """Whose runs hold a reservation come first, as they are; a user whose run only waits
    (in the queue, or for co-location) is marked so, and one that both holds and waits
    is a holder."""
    from gpud.cli.jobs import holders

    job = jobs_pb2.Job(
        name="train",
        reservations=[
            jobs_pb2.JobReservation(id="r1", job="train", holder_uid=1000, holder_user="alice")
        ],
    )
    waiting = [
        queue_pb2.QueueEntry(id="q1", job="train", holder_uid=1001, holder_user="bob"),
        queue_pb2.QueueEntry(id="q2", job="train", holder_uid=1000, holder_user="alice"),
        colo_pb2.ColoWaiter(job="train", id="c1", holder_uid=1003, holder_user="cy"),
        queue_pb2.QueueEntry(id="q3", job="train"),  # its user unknown: not named
    ]
    assert holders(job, waiting) == "alice,bob (waits),cy (waits)"
    assert holders(jobs_pb2.Job(name="train"), waiting[:1]) == "bob (waits)"
    assert holders(job) == "alice"
    assert holders(jobs_pb2.Job(name="idle"), waiting[3:]) == "-"


class _Reused:
    """stderr that, as gpuctl says what its command left, has process 41 end and its PID
    go to a process of no run (saying it may block: a full pipe, a stopped terminal)."""

    def __init__(self, stream: Any, proc_root: Path) -> None:
        self.stream = stream
        self.proc_root = proc_root

    def write(self, data: str) -> int:
        if "outlived its command" in data:
            (self.proc_root / "41" / "environ").write_bytes(b"HOME=/\0")
        return int(self.stream.write(data))

    def flush(self) -> None:
        self.stream.flush()


def test_a_leftover_whose_pid_another_process_took_since_it_was_listed_is_not_signalled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpuctl run` lists what its command left to say it, then stops what is left of the
    run as found then: a PID reused meanwhile by a process of no run gets no signal."""
    from gpud.cli.run import Stop, _stop_leftovers

    (tmp_path / "41").mkdir()
    (tmp_path / "41" / "environ").write_bytes(b"HOME=/\0GPUD_RUN=r1\0")
    monkeypatch.setattr(sys, "stderr", _Reused(sys.stderr, tmp_path))
    sent: list[tuple[int, int]] = []
    _stop_leftovers(
        "j", "r1", 0.0, Stop(), proc_root=tmp_path, send=lambda pid, sig: sent.append((pid, sig))
    )
    assert sent == []
    assert "1 process(es) of job j outlived its command (pid 41)" in capsys.readouterr().err


def test_a_signal_while_the_command_is_held_gives_the_reservation_back_without_asking_more(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGTERM to gpuctl while its command is held: it gives the reservation back at once,
    not first asking whether its job is still there, which with gpud hung took up to
    --timeout more before the release's own wait."""
    held: list[JobService] = []
    net = Places(  # to gpuctl alone: the gate stays shut
        lambda: held[0],
        remove_first=False,
        placed=True,
        group_signal=signal.SIGTERM,
        to_held=False,
    )
    asked_after: list[str] = []

    class CountsListJobs(JobsServicer):
        async def ListJobs(self, request: Any, context: Any) -> Any:
            if net.asked:
                asked_after.append(request.name)
            return await super().ListJobs(request, context)

    with serving(net.register, jobs_api=CountsListJobs) as n:
        held.append(n.jobs)
        n.jobs.set_tagger(lambda job: 26, lambda job: 26)
        got = n.ctl("run", "--job", "h3", "--gpus", "1", "--", "true")
        assert n.jobs.reservations.held() == []
    err = capsys.readouterr().err
    assert got == 130, err
    assert "job h3 stopped (SIGTERM) before its command started" in err
    assert asked_after == []


class AnswersFirstReserveTooLate(JobsServicer):
    """Reserves as gpud does, but holds the answer to the first Reserve until its caller
    has asked again: the reservation is made and its answer lost. ``held``: how many
    reservations were held after each Reserve; ``asked``: each Reserve's request id."""

    held: ClassVar[list[int]] = []
    asked: ClassVar[list[str]] = []

    async def Reserve(
        self, request: jobs_pb2.ReserveRequest, context: Any
    ) -> jobs_pb2.ReserveResponse:
        answer = await super().Reserve(request, context)
        self.held.append(len(self._service.reservations.held()))
        self.asked.append(request.request_id)
        if len(self.asked) == 1:
            await held_until_asked_again(self.asked)
        return answer


async def held_until_asked_again(asked: list[str]) -> None:
    """Returns once a second call is in ``asked``: gpuctl asks again only after its own
    call gave up, so an answer sent then is lost, however late a loaded host runs its
    timers. The deadline the servicer sees is no such proof: it passes a little after
    gpuctl's, and a gpuctl whose deadline timer ran late took an answer sent then as the
    first call's. A gpuctl that never asks again ends the test, whose server stop cancels
    this wait."""
    while len(asked) < 2:
        await asyncio.sleep(0.02)


T = TypeVar("T")


async def first_answer_lost(asked: list[str], key: str, answer: Awaitable[T]) -> T:
    """``answer`` awaited, ``key`` noted in ``asked`` first; the first call's answer is held
    until a second call came (:func:`held_until_asked_again`): lost to its caller."""
    asked.append(key)
    got = await answer
    if len(asked) == 1:
        await held_until_asked_again(asked)
    return got


def test_a_reserve_whose_answer_came_past_its_deadline_is_asked_again_and_made_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """gpud reserved, but gpuctl's deadline passed before the answer came: gpuctl asks
    again with the same request id and runs on the reservation gpud made the first time,
    with no second one held."""
    AnswersFirstReserveTooLate.held.clear()
    AnswersFirstReserveTooLate.asked.clear()
    out = tmp_path / "child.json"
    with serving(jobs_api=AnswersFirstReserveTooLate) as n:
        code = gpuctl(
            ["--socket", str(n.socket), "--timeout", "1",
             "run", "--job", "t", "--gpus", "1", "--memory", "20GiB",
             "--", sys.executable, "-c", CHILD, str(out), "0"],
            env={},
        )  # fmt: skip
        assert code == 0
        assert n.jobs.reservations.held() == []
    first, again = AnswersFirstReserveTooLate.asked
    assert first == again and len(first) == 36  # a uuid4
    assert AnswersFirstReserveTooLate.held == [1, 1]
    err = capsys.readouterr().err
    assert f"did not answer within 1 s on {n.socket}" in err
    assert f"). Asking again as request {first} (gpud does it once)." in err
    assert json.loads(out.read_text())["env"]["GPUD_JOB"] == "t"


def test_an_enqueue_whose_answer_came_past_its_deadline_is_asked_again_and_queued_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """gpud queued the run, but gpuctl's deadline passed before the answer came: gpuctl
    asks again with the same request id and is answered with that entry (started by then,
    as the devices it waited for freed meanwhile), with no second one queued."""
    from typing import cast

    from gpud.admission.api import QueueServicer
    from gpud.admission.service import AdmissionService
    from gpud.cli.context import Context
    from gpud.cli.output import Output
    from gpud.cli.run import Stop, wait_in_queue
    from gpud.config import AdmissionConfig
    from gpud.jobs.service import RunRequest

    asked: list[str] = []

    class AnswersFirstEnqueueTooLate(QueueServicer):
        async def Enqueue(self, request: queue_pb2.EnqueueRequest, context: Any) -> Any:
            asked.append(request.request.request_id)
            if len(asked) == 2:  # the devices it waits for free before the try again
                self._service._jobs.release(held.reservation.id)
                self._service.tick()
            answer = await super().Enqueue(request, context)
            if len(asked) == 1:
                await held_until_asked_again(asked)
            return answer

        async def GetEntry(self, request: queue_pb2.GetEntryRequest, context: Any) -> Any:
            stop.set(signal.SIGTERM)  # an entry still queued: not the one that started
            return await super().GetEntry(request, context)

    queue = AnswersFirstEnqueueTooLate(cast(AdmissionService, None))
    stop = Stop()
    with serving(queue.register) as n:
        svc = AdmissionService(n.jobs.store, n.jobs, n.mps, EventLog(None), AdmissionConfig())
        queue._service = svc
        held = n.jobs.reserve(RunRequest(job="a", gpu_count=1, memory_bytes=60 * GIB))
        ctx = Context(socket_path=n.socket, timeout=1.0, output=Output(json_output=False))
        request = jobs_pb2.ReserveRequest(
            job="b", gpu_count=1, memory_limit_bytes=60 * GIB, request_id="q-1"
        )
        try:
            entry = wait_in_queue(ctx, request, stop)
        finally:
            ctx.close()
            stop.close()
        assert entry is not None and entry.state == queue_pb2.ENTRY_STATE_STARTED
        (row,) = svc.entries(state=None)
        assert row.id == entry.id
        assert [r.job for r in n.jobs.reservations.held()] == ["b"]
    assert asked == ["q-1", "q-1"]
    assert ". Asking again as request q-1 (gpud does it once)." in capsys.readouterr().err


def test_jobs_add_queue_whose_enqueue_answer_was_lost_is_asked_again_and_queued_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """gpud queued the job, but gpuctl's deadline passed before the answer came: `gpuctl
    jobs add --queue` asks again with the same request id, as `gpuctl run` does, and is
    answered with that entry, with no second one queued."""
    from gpud.admission.api import QueueServicer
    from gpud.admission.service import AdmissionService
    from gpud.config import AdmissionConfig

    asked: list[str] = []

    class AnswersFirstEnqueueTooLate(QueueServicer):
        async def Enqueue(self, request: queue_pb2.EnqueueRequest, context: Any) -> Any:
            answer = super().Enqueue(request, context)
            return await first_answer_lost(asked, request.request.request_id, answer)

    queue = AnswersFirstEnqueueTooLate(cast(Any, None))
    with serving(queue.register) as n:
        svc = AdmissionService(n.jobs.store, n.jobs, n.mps, EventLog(None), AdmissionConfig())
        queue._service = svc
        n.jobs.reserve(RunRequest(job="a", gpu_count=1, memory_bytes=60 * GIB))
        code = gpuctl(
            ["--socket", str(n.socket), "--timeout", "1",
             "jobs", "add", "b", "--gpus", "1", "--memory", "60GiB", "--queue"],
            env={},
        )  # fmt: skip
        out, err = capsys.readouterr()
        assert code == 0, err
        (row,) = svc.entries(state=None)
        assert row.job == "b" and f"job b queued ({row.id})" in out
    first, again = asked
    assert first == again and len(first) == 36  # a uuid4
    assert f"). Asking again as request {first} (gpud does it once)." in err


def test_jobs_add_whose_answer_was_lost_takes_the_job_it_registered_as_made(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """gpud registered the job, but gpuctl's deadline passed before the answer came:
    `gpuctl jobs add` asks again, finds the job as it asked for it (its --devices index
    kept as the GPU's UUID), and takes it as made, saying so, rather than failing on
    "exists"."""
    asked: list[str] = []

    class AnswersFirstAddTooLate(JobsServicer):
        async def AddJob(self, request: jobs_pb2.AddJobRequest, context: Any) -> Any:
            answer = super().AddJob(request, context)
            return await first_answer_lost(asked, request.job.name, answer)

    with serving(jobs_api=AnswersFirstAddTooLate) as n:
        code = gpuctl(
            ["--socket", str(n.socket), "--timeout", "1",
             "jobs", "add", "c", "--devices", "1", "--memory", "20GiB"],
            env={},
        )  # fmt: skip
        out, err = capsys.readouterr()
        assert code == 0, err
        assert [j.name for j in n.jobs.registry.all()] == ["c"]
    assert asked == ["c", "c"]
    assert ". Asking again to register job c (a job it registered then is taken as made)." in err
    assert "job c exists as asked: registered by the try whose answer was lost" in err
    assert "gpud's warnings on it, if any, came in that answer (gpuctl env --job c" in err
    assert out.startswith("JOB") and "\nc " in out


def test_jobs_add_asked_again_that_finds_another_job_of_its_name_says_it_exists(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The job a try again finds is not as this gpuctl asked (another client registered
    it otherwise meanwhile): its ALREADY_EXISTS stands (exit 5), nothing taken as made."""
    asked: list[str] = []

    class RegistersAnotherFirst(JobsServicer):
        async def AddJob(self, request: jobs_pb2.AddJobRequest, context: Any) -> Any:
            asked.append(request.job.name)
            if len(asked) == 1:
                self._service.add(JobSpec(request.job.name, gpu_count=2))
                await held_until_asked_again(asked)
            return await super().AddJob(request, context)

    with serving(jobs_api=RegistersAnotherFirst) as n:
        code = gpuctl(
            ["--socket", str(n.socket), "--timeout", "1", "jobs", "add", "d", "--gpus", "1"],
            env={},
        )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 5, err
    assert err.endswith(
        "gpuctl: job 'd' exists, registered otherwise than this gpuctl asked: not by its try"
        " whose answer was lost (gpuctl jobs ls d)\n"
    )
    assert asked == ["d", "d"]


def lost_add(
    capsys: pytest.CaptureFixture[str], jobs_api: type[JobsServicer], *argv: str
) -> tuple[int, str]:
    """`gpuctl jobs add ARGV` against ``jobs_api`` (whose first answer is lost): its exit
    status and stderr."""
    with serving(jobs_api=jobs_api) as n:
        code = gpuctl(["--socket", str(n.socket), "--timeout", "1", "jobs", "add", *argv], env={})
    return code, capsys.readouterr().err


def test_jobs_add_asked_again_that_finds_the_job_on_another_device_by_index_says_it_exists(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Another client registered the job on MIG device 0:0 meanwhile; this gpuctl asked for
    0:1, as many devices: the job a try again finds is not as asked (an index is read as the
    UUID it names, as gpud keeps it), so its ALREADY_EXISTS stands, exit 5."""
    asked: list[str] = []

    class RegistersOnAnotherDevice(JobsServicer):
        async def AddJob(self, request: jobs_pb2.AddJobRequest, context: Any) -> Any:
            if not asked:
                request.job.devices[:] = ["0:0"]
            answer = super().AddJob(request, context)
            return await first_answer_lost(asked, request.job.name, answer)

    code, err = lost_add(capsys, RegistersOnAnotherDevice, "d", "--devices", "0:1")
    assert code == 5, err
    assert "job 'd' exists, registered otherwise than this gpuctl asked" in err
    assert asked == ["d", "d"]


def test_jobs_add_asked_again_that_finds_a_job_registered_before_it_ran_says_it_exists(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The job a try again finds is as this gpuctl asked, but gpud registered it an hour
    before gpuctl ran: not its lost try's, so its ALREADY_EXISTS stands, exit 5."""
    asked: list[str] = []

    class RegisteredAnHourAgo(JobsServicer):
        async def AddJob(self, request: jobs_pb2.AddJobRequest, context: Any) -> Any:
            answer = super().AddJob(request, context)
            return await first_answer_lost(asked, request.job.name, answer)

        async def ListJobs(self, request: jobs_pb2.ListJobsRequest, context: Any) -> Any:
            listed: jobs_pb2.ListJobsResponse = await super().ListJobs(request, context)
            for job in listed.jobs:
                job.created_unix_seconds -= 3600
            return listed

    code, err = lost_add(capsys, RegisteredAnHourAgo, "e", "--gpus", "1")
    assert code == 5, err
    assert err.endswith(
        "gpuctl: job 'e' exists, registered before this gpuctl asked: not by its try whose"
        " answer was lost (gpuctl jobs ls e)\n"
    )


def test_jobs_add_asked_again_that_finds_the_job_reserved_says_it_exists(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The job a try again finds is as asked, but already holds a reservation (another
    client runs it): not taken as made, exit 5."""
    asked: list[str] = []

    class ReservedMeanwhile(JobsServicer):
        async def AddJob(self, request: jobs_pb2.AddJobRequest, context: Any) -> Any:
            answer = super().AddJob(request, context)
            if not asked:
                got = await answer
                await asyncio.to_thread(self._service.reserve, RunRequest(job=request.job.name))
                asked.append(request.job.name)
                await held_until_asked_again(asked)
                return got
            asked.append(request.job.name)
            return await answer

    code, err = lost_add(capsys, ReservedMeanwhile, "f", "--gpus", "1")
    assert code == 5, err
    assert "job 'f' exists, holding reservation " in err
    assert "not by its try whose answer was lost (gpuctl jobs ls f)" in err


def test_jobs_add_whose_listing_fails_after_exists_names_the_job_found_registered(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A try again finds the job registered, and listing it to tell whose it is fails: the
    error names the job, says it was found registered, then what the listing got."""
    asked: list[str] = []

    class ListsNothing(JobsServicer):
        async def AddJob(self, request: jobs_pb2.AddJobRequest, context: Any) -> Any:
            answer = super().AddJob(request, context)
            return await first_answer_lost(asked, request.job.name, answer)

        async def ListJobs(self, request: jobs_pb2.ListJobsRequest, context: Any) -> Any:
            await context.abort(grpc.StatusCode.INTERNAL, "the registry is unreadable")

    code, err = lost_add(capsys, ListsNothing, "g", "--gpus", "1")
    assert code != 0
    assert "job 'g' exists, found registered when asked again after a lost answer" in err
    assert "the registry is unreadable" in err


class RefusesReserveUnavailable(JobsServicer):
    """gpud refusing every Reserve as UNAVAILABLE (starting: no GPU seen yet), as it does
    before its first sample; ``asked``: how many Reserves came."""

    asked: ClassVar[list[str]] = []

    async def Reserve(
        self, request: jobs_pb2.ReserveRequest, context: Any
    ) -> jobs_pb2.ReserveResponse:
        self.asked.append(request.request_id)
        raise Unavailable("no GPU seen yet: the daemon is starting, retry shortly")


def test_a_reserve_gpud_refused_as_unavailable_is_asked_once(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """gpud answered (it is starting): its refusal is said as it is, not asked again."""
    RefusesReserveUnavailable.asked.clear()
    with serving(jobs_api=RefusesReserveUnavailable) as n:
        code = n.ctl("run", "--job", "t", "--gpus", "1", "--", "true")
    err = capsys.readouterr().err
    assert code == 3, err
    assert len(RefusesReserveUnavailable.asked) == 1
    assert "no GPU seen yet" in err and "Asking again" not in err


def test_a_run_on_a_socket_nothing_listens_on_says_it_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No gpud at the socket: nothing was asked, so nothing is asked again; one line."""
    code = gpuctl(
        ["--socket", str(tmp_path / "none.sock"), "run", "--job", "t", "--gpus", "1", "--", "true"],
        env={},
    )
    err = capsys.readouterr().err
    assert code == 3, err
    assert err.count("gpud is not running") == 1, err
    assert "Asking again" not in err


@dataclass
class AwayThenBack:
    """A Context whose calls fail as ``failures`` says, one a call, then answer ``"made"``:
    gpud going away during a call, then not running while it restarts, then back."""

    failures: list[CliError]
    calls: int = 0
    closed: int = 0

    def call(self, method: Any, request: object, *, timeout: float | None = None) -> Any:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "made"

    def close(self) -> None:
        self.closed += 1


def went_away() -> CliError:
    return CliError("gpud on S went away during the call (Socket closed)", 3, unanswered=True)


def not_running() -> CliError:
    return CliError("gpud is not running: nothing listens on S.", 3)


class Methods:
    """A stub whose methods are their names."""

    def __getattr__(self, name: str) -> str:
        return name


class Scripted:
    """A Context whose calls answer or raise, one a call, as ``script`` says."""

    def __init__(self, script: list[object]) -> None:
        from gpud.cli.output import Output

        self.script = script
        self.out = Output(json_output=False)

    def stub(self, kind: type) -> Any:
        return Methods()

    def call(self, method: Any, request: object, *, timeout: float | None = None) -> Any:
        step = self.script.pop(0)
        if isinstance(step, BaseException):
            raise step
        return step

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("script", "said"),
    [
        (
            [went_away(), KeyboardInterrupt()],
            "gpuctl: stopped while asking again: job h may have been registered by the try"
            " whose answer was lost (gpuctl jobs ls h)\n",
        ),
        (
            [jobs_pb2.AddJobResponse(job=jobs_pb2.Job(name="h")), went_away(), KeyboardInterrupt()],
            "gpuctl: stopped while asking again: job h is registered, and may have been queued"
            " by the try whose answer was lost (gpuctl queue)\n",
        ),
    ],
    ids=["registering", "queueing"],
)
def test_ctrl_c_while_jobs_add_asks_again_names_what_the_lost_try_may_have_made(
    script: list[object], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Ctrl-C while `gpuctl jobs add --queue` asks again after a lost answer exits 130
    with one line naming what that try may have made, and where to look."""
    from gpud.cli.context import Context
    from gpud.cli.jobs import run_add
    from gpud.cli.main import build_parser

    args = build_parser().parse_args(["jobs", "add", "h", "--gpus", "1", "--queue"])
    assert run_add(cast(Context, Scripted(script)), args) == 130
    assert capsys.readouterr().err.endswith(said)


def test_a_reserve_that_went_away_is_asked_again_once_gpud_is_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The first try reached gpud, which went away during it; gpud is not running for the
    next two (restarting), and the one after is answered: gpud gives it the reservation
    that request id made, if any."""
    from gpud.cli.context import Context
    from gpud.cli.run import asked_once

    ctx = AwayThenBack([went_away(), not_running(), not_running()])
    stop = Stop()
    try:
        got = asked_once(
            cast(Context, ctx), lambda c: None, jobs_pb2.ReserveRequest(request_id="r-1"), stop
        )
    finally:
        stop.close()
    assert (got, ctx.calls, ctx.closed) == ("made", 4, 3)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "gpuctl: gpud on S went away during the call (Socket closed). Asking again as"
        " request r-1 (gpud does it once).",
        "gpuctl: gpud is not running: nothing listens on S. Asking again as request r-1"
        " while it restarts, for up to 30 s (Ctrl-C stops).",
    ]


def test_a_signal_while_gpud_restarts_ends_the_asking_as_stopped() -> None:
    """SIGTERM during the wait for gpud to be back (asking again as the same request id):
    the asking ends as a stop, not as gpud's absence (exit 3) from the try before it."""
    from gpud.cli.context import Context
    from gpud.cli.run import StoppedAsking, asked_once

    ctx = AwayThenBack([went_away(), not_running(), not_running()])
    stop = Stop()
    ticks = iter(range(1000))

    def clock() -> float:
        # the wait reads the clock: the signal lands once it has begun
        t = float(next(ticks))
        if t >= 3:
            stop.set(signal.SIGTERM)
        return t

    try:
        with pytest.raises(StoppedAsking):
            asked_once(
                cast(Context, ctx),
                lambda c: None,
                jobs_pb2.ReserveRequest(request_id="r-1"),
                stop,
                clock=clock,
            )
    finally:
        stop.close()
    assert ctx.calls == 2


@dataclass
class StoppedWhileAway(AwayThenBack):
    """As AwayThenBack, but SIGTERM lands during the try after gpud went away."""

    stop: Stop | None = None

    def call(self, method: Any, request: object, *, timeout: float | None = None) -> Any:
        if self.calls == 1 and self.stop is not None:
            self.stop.set(signal.SIGTERM)
        return super().call(method, request, timeout=timeout)

    def stub(self, stub_class: Any) -> Any:
        return type("Stub", (), {"Reserve": None})()


def test_a_run_stopped_while_gpud_restarts_says_it_stopped_before_its_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`gpuctl run` asking its Reserve again while gpud restarts is sent SIGTERM: it ends
    as a run stopped before its command started (exit 130, as README says), not with
    exit 3, gpud not running."""
    from gpud.cli.context import Context
    from gpud.cli.main import build_parser
    from gpud.cli.run import _run

    args = build_parser().parse_args(["run", "--job", "t", "--gpus", "1", "--", "true"])
    stop, after = Stop(), Stop()
    ctx = StoppedWhileAway([went_away(), not_running()], stop=stop)
    try:
        code = _run(cast(Context, ctx), args, ["true"], stop, after)
    finally:
        stop.close()
        after.close()
    err = capsys.readouterr().err
    assert code == 130, err
    assert "job t stopped (SIGTERM) before its command started" in err, err
    assert ctx.calls == 2


def test_a_gpud_still_away_past_the_restart_wait_is_said_as_not_running() -> None:
    from gpud.cli.context import Context
    from gpud.cli.run import asked_once

    ctx = AwayThenBack([went_away(), not_running(), not_running()])
    stop = Stop()
    try:
        with pytest.raises(CliError, match="gpud is not running"):
            asked_once(
                cast(Context, ctx),
                lambda c: None,
                jobs_pb2.ReserveRequest(request_id="r-1"),
                stop,
                restart_wait_s=0,
            )
    finally:
        stop.close()
    assert ctx.calls == 2


def test_gpud_refusing_a_try_again_is_said_as_its_refusal() -> None:
    """Back after a restart, gpud refuses (still starting): that is its answer."""
    from gpud.cli.context import Context
    from gpud.cli.run import asked_once

    refused = CliError("no GPU seen yet", 3, error="Unavailable")
    ctx = AwayThenBack([went_away(), refused, not_running()])
    stop = Stop()
    try:
        with pytest.raises(CliError) as raised:
            asked_once(
                cast(Context, ctx), lambda c: None, jobs_pb2.ReserveRequest(request_id="r"), stop
            )
    finally:
        stop.close()
    assert raised.value is refused and ctx.calls == 2


def test_gpuctl_env_previews_the_gpu_its_users_run_then_gets_under_mps() -> None:
    """MPS on, two GPUs, GPU 0 serving this process's user: the next run of that user joins
    GPU 0 (taking GPU 1 would leave none idle for another user). A preview asked with the
    caller's PID (``gpuctl env`` of a user other than root) is placed for the same user and
    names GPU 0 too; one without (root's, an older gpuctl's) for no known user."""
    with serving(gpus=snapshot(gpu_sample(0), gpu_sample(1))) as node:
        node.jobs.reserve(RunRequest("a", devices=(gpu_uuid(0),), holder_pid=os.getpid()))
        node.jobs.add(JobSpec("b"))
        assert node.jobs.env("b")["CUDA_VISIBLE_DEVICES"] == gpu_uuid(1)
        request = env_request("b", uid=1000, pid=os.getpid(), namespace=own_namespace())
        previewed = node.jobs.env(
            "b", holder_pid=request.holder_pid, holder_pid_namespace=request.holder_pid_namespace
        )
        run = node.jobs.reserve(RunRequest("b", holder_pid=os.getpid())).reservation
        assert previewed["CUDA_VISIBLE_DEVICES"] == ",".join(run.devices) == gpu_uuid(0)


def test_gpuctl_env_sends_its_pid_except_as_root() -> None:
    """A user's ``gpuctl env`` names its own process, so the preview is placed for that
    user; root's (a Slurm prolog, a container hook, asking for another user's job) names
    none, so it is never placed for root nor refused for root's user."""
    mine = env_request("b", uid=1000, pid=4242, namespace=4_026_531_836)
    assert (mine.holder_pid, mine.holder_pid_namespace) == (4242, 4_026_531_836)
    roots = env_request("b", uid=0, pid=4242, namespace=4_026_531_836)
    assert not roots.HasField("holder_pid") and not roots.HasField("holder_pid_namespace")
