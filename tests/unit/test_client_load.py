"""A client made in a training program or a service, where gRPC cannot be loaded or its
channel made, never raises into the program: it reports nothing and says why."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# the program, in a fresh interpreter: %(before)s breaks gRPC's load, then a client is made
# and used as a training loop or a service would, its steps and exit never waiting on gpud
_PROGRAM = """
import sys, threading
%(before)s
import gpud.client
%(make)s
for _ in range(3):
    %(use)s
flushed = client.flush()
client.close()
assert threading.active_count() == 1, threading.enumerate()  # no sender thread
print(client.last_error)
print(f"dropped {client.dropped}, flushed {flushed}")
"""

_CLIENTS = {
    "Progress": ('client = gpud.client.Progress("train-a")', "client.step()"),
    "Latency": ('client = gpud.client.Latency("chat", flush_every_s=0)', "client.observe(0.01)"),
}


def _run(client: str, before: str, socket: bytes | None = None) -> subprocess.CompletedProcess[str]:
    make, use = _CLIENTS[client]
    env = dict(os.environb)
    env.pop(b"GPUD_SOCKET", None)
    if socket is not None:
        env[b"GPUD_SOCKET"] = socket
    return subprocess.run(
        [sys.executable, "-c", _PROGRAM % {"before": before, "make": make, "use": use}],
        check=False,
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        errors="backslashreplace",
        timeout=60,  # a guard against a hang, not a measurement
    )


@pytest.mark.parametrize("client", sorted(_CLIENTS))
def test_a_client_without_grpc_reports_nothing_and_says_so(client: str) -> None:
    run = _run(client, "sys.modules['grpc'] = None  # a broken or absent grpc")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("gRPC not loaded (ModuleNotFoundError("), run.stdout
    assert run.stdout.splitlines()[0].endswith("nothing is reported")
    assert "is not reported: gRPC not loaded" in run.stderr  # the warning, once


@pytest.mark.parametrize("client", sorted(_CLIENTS))
def test_a_client_without_grpc_counts_each_report_it_was_given_as_dropped(client: str) -> None:
    """A Progress's steps are dropped reports, as a Latency's requests are, and a flush
    finds every one accounted for: a job reading ``dropped`` sees what gpud never got."""
    run = _run(client, "sys.modules['grpc'] = None  # a broken or absent grpc")
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[1] == "dropped 3, flushed True", run.stdout


@pytest.mark.parametrize("client", sorted(_CLIENTS))
def test_a_socket_path_grpc_cannot_take_is_named_not_raised(client: str) -> None:
    run = _run(client, "", socket=b"/tmp/gpud-\xff.sock")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(
        "no gRPC channel to gpud at '/tmp/gpud-\\udcff.sock' ($GPUD_SOCKET, socket= or target=):"
    ), run.stdout


def _python(program: str) -> subprocess.CompletedProcess[str]:
    """``program`` run in a fresh interpreter (a job's), from the repository's root."""
    return subprocess.run(
        [sys.executable, "-c", program],
        check=False,
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,  # a guard against a hang, not a measurement
    )


# what a job sees asking for its attributes where gRPC cannot be loaded: printed as caught
_QUERY = """
import sys
sys.modules['grpc'] = None  # a broken or absent grpc
import gpud.client
try:
    %(query)s
except gpud.client.GrpcUnavailable as err:
    print(err)
    print(type(err.__cause__).__name__)
"""


@pytest.mark.parametrize(
    "query",
    ['gpud.client.attributes("train-a")', 'next(gpud.client.watch_attributes("train-a"))'],
    ids=["attributes", "watch_attributes"],
)
def test_attributes_without_grpc_raise_an_error_that_names_the_job_and_why(query: str) -> None:
    run = _python(_QUERY % {"query": query})
    assert run.returncode == 0, run.stderr
    said, cause = run.stdout.splitlines()
    assert said.startswith(
        "attributes of job train-a not read: gRPC not loaded (ModuleNotFoundError("
    ), said
    assert said.endswith("gpud is not asked"), said
    assert cause == "ModuleNotFoundError"  # raised from the import's error, kept as its cause


@pytest.mark.parametrize(
    ("broken", "use"),
    [
        ("gpud.v1.cluster_pb2", 'gpud.client.attributes("train-a")'),
        ("gpud.v1.colo_pb2", 'print(gpud.client.colo.Throttle("train-a").point())'),
    ],
    ids=["attributes", "throttle"],
)
def test_generated_code_that_cannot_be_loaded_is_said_as_such_not_as_a_channel(
    broken: str, use: str
) -> None:
    program = (
        "import logging, sys\n"
        f"sys.modules[{broken!r}] = None  # generated code missing from the install\n"
        "import gpud.client\n"
        "try:\n"
        f"    {use}\n"
        "except gpud.client.GrpcUnavailable as err:\n"
        "    print(err)\n"
    )
    run = _python(program)
    assert run.returncode == 0, run.stderr
    said = f"gRPC not loaded ({broken}, gpud's generated code: ModuleNotFoundError("
    assert said in run.stdout + run.stderr, run.stdout + run.stderr
    assert "no gRPC channel" not in run.stdout + run.stderr


def test_a_throttle_without_grpc_leaves_the_job_at_full_duty_and_says_why() -> None:
    """The process's throttle and one made apart: no call is tried (the import is not
    tried again at each back-off), the loop is never slowed, and the reason is kept."""
    program = (
        "import os, sys\n"
        "sys.modules['grpc'] = None  # a broken or absent grpc\n"
        "os.environ['GPUD_JOB'] = 'train-a'\n"
        "import gpud.client\n"
        "from gpud.client.colo import Throttle\n"
        "t = Throttle()\n"
        "slept = [gpud.client.throttle_point() + t.point() for _ in range(3)]\n"
        "print(t.last_error)\n"
        "print(slept, gpud.client.directive())\n"
    )
    run = _python(program)
    assert run.returncode == 0, run.stderr
    why, done = run.stdout.splitlines()
    assert why.startswith("gRPC not loaded (ModuleNotFoundError("), why
    assert why.endswith("this process runs at full duty, not throttled by gpud"), why
    assert done == "[0.0, 0.0, 0.0] (1.0, False, '')"
    assert "job train-a is not throttled: gRPC not loaded" in run.stderr  # the warning


def test_a_throttle_made_in_a_worker_forked_mid_grpc_import_is_inert_not_hung() -> None:
    """A worker forked while a thread of the program was inside grpc's import: its import
    of grpc would wait for good on that module's lock; its throttle says why instead."""
    run = _throttle_in_a_worker_forked_mid_import(
        "grpc", 't.last_error.startswith("gRPC was half-imported at a fork (grpc,")'
    )
    assert run.returncode == 0, run.stderr[-3000:]


def _throttle_in_a_worker_forked_mid_import(
    held: str, holds: str
) -> subprocess.CompletedProcess[str]:
    """A program forked while a thread of it was inside the import of ``held``: the worker
    makes a throttle ``t``, calls two points (gpud away) and exits 0 where ``holds``."""
    from tests.unit.api_support import fork_mid_grpc_import, short_dir

    with short_dir() as d:
        return fork_mid_grpc_import(
            d / "gpud.sock",
            make=f"threading.Thread(target=lambda: __import__({held!r}), daemon=True).start()",
            sent="False",
            held=held,
            child='t = gpud.client.colo.Throttle("train-a", socket=sock); t.point(); t.point();'
            " print(repr(t.last_error), file=sys.stderr, flush=True);"
            f" os._exit(0 if {holds} else 1)",
        )


def test_reading_the_directive_loads_no_grpc_the_first_throttle_point_does() -> None:
    """A watcher thread polling directive() beside a main thread that forks workers must
    not import gRPC there (a fork mid-import leaves the child's grpc half-imported): the
    import waits for the first call, made by the training loop's throttle_point()."""
    program = (
        "import os, sys\n"
        "os.environ['GPUD_JOB'] = 'train-a'\n"
        "os.environ['GPUD_SOCKET'] = '/nonexistent/gpud.sock'\n"
        "import gpud.client\n"
        "print(gpud.client.directive(), 'grpc' in sys.modules)\n"
        "gpud.client.throttle_point()\n"
        "print('grpc' in sys.modules)\n"
    )
    run = _python(program)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["(1.0, False, '') False", "True"], run.stdout


def test_a_throttle_made_in_a_worker_forked_mid_import_of_a_module_it_does_not_use_reports() -> (
    None
):
    """Another thread of the program inside the import of gpud.v1.cluster_pb2 (attributes())
    at the fork: the worker's throttle needs only grpc and colo_pb2*, so it loads them and
    reports (a gpud away is no error of its load), not inert for a module it never imports."""
    run = _throttle_in_a_worker_forked_mid_import("gpud.v1.cluster_pb2", 't.last_error == ""')
    assert run.returncode == 0, run.stderr[-3000:]


# a client whose parent already dropped reports: the forked child reads what it dropped
_FORKED = """
import os, sys, time
%(before)s
import gpud.client
%(make)s
for _ in range(5):
    %(use)s
while client.dropped < %(dropped)d:  # a live one's sender counts them: waited for, not timed
    time.sleep(0.01)
pid = os.fork()
if pid == 0:
    %(use)s
    print(f"child dropped {client.dropped}, flushed {client.flush(0)}", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print(f"parent dropped {client.dropped}")
"""


@pytest.mark.parametrize(
    ("before", "make", "use", "dropped", "child"),
    [
        ("sys.modules['grpc'] = None", *_CLIENTS["Progress"], 5, "child dropped 0, flushed True"),
        (
            "",
            'client = gpud.client.Progress("train-a", socket="/nonexistent/gpud.sock",'
            " max_buffer=1)",
            "client.step()",
            4,
            "child dropped 0, flushed True",
        ),
        ("sys.modules['grpc'] = None", *_CLIENTS["Latency"], 5, "child dropped 1, flushed True"),
    ],
    ids=["inert-progress", "live-progress", "inert-latency"],
)
def test_a_forked_child_counts_none_of_its_parents_dropped_reports(
    before: str, make: str, use: str, dropped: int, child: str
) -> None:
    """A forked copy of a Progress drops nothing (its steps are not its to send), inert or
    not; a child's inert Latency counts its own requests, not its parent's again."""
    program = _FORKED % {"before": before, "make": make, "use": use, "dropped": dropped}
    run = _python(program)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [child, f"parent dropped {dropped}"], run.stdout
