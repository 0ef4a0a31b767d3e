"""gpuctl end to end: ``main([...])`` against an in-process ApiServer on a temporary socket."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import io
import json
import math
import os
import re
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpud.api import ApiServer, NodeServicer
from gpud.api.ports import ReloadState, StateFiles
from gpud.backend.sim import SimNode
from gpud.build import UNKNOWN
from gpud.build import current as current_build
from gpud.cli.context import CliError, Context, probe_socket
from gpud.cli.main import build_parser, main
from gpud.cli.output import Output, format_table, seconds
from gpud.cli.version import differ_line
from gpud.errors import GpuLost
from gpud.events import Event, EventLog
from gpud.net.port import LinkEnforcement, TrafficSummary
from gpud.telemetry.reader import placeholder_identity
from gpud.telemetry.snapshot import GpuSample, SeenIdentity, Snapshot
from gpud.v1 import colo_pb2, jobs_pb2, net_pb2, queue_pb2
from tests.unit.api_support import (
    NOW,
    FakeFaults,
    ServerThread,
    make_servicer,
    make_snapshot,
    node_info,
    short_dir,
)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with short_dir() as d:
        yield d


def _serve(path: Path, faults: FakeFaults | None = None) -> ServerThread:
    return ServerThread(ApiServer(path, servicers=[make_servicer(faults=faults).register]))


@pytest.fixture
def faults() -> FakeFaults:
    return FakeFaults()


@pytest.fixture
def sim_socket(sock_dir: Path, faults: FakeFaults) -> Iterator[str]:
    """The socket of a daemon on a simulated node (fake fault port)."""
    path = sock_dir / "gpud.sock"
    with _serve(path, faults):
        yield str(path)


@pytest.fixture
def real_socket(sock_dir: Path) -> Iterator[str]:
    """The socket of a daemon on real NVML (no fault port)."""
    path = sock_dir / "gpud.sock"
    with _serve(path):
        yield str(path)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv), env={})
    out, err = capsys.readouterr()
    return code, out, err


def test_status(capsys: pytest.CaptureFixture[str], sim_socket: str) -> None:
    code, out, _ = run(capsys, "--socket", sim_socket, "status")
    assert code == 0
    assert "node-a (simulated node)" in out
    assert "sim, driver 550.54.15" in out
    assert "3 (2 healthy)" in out
    assert "GPU 2 unhealthy: GPU lost" in out  # which one, and why
    assert "1h 02m" in out  # uptime 3725 s
    assert "500 ms ago" in out


def test_status_json(capsys: pytest.CaptureFixture[str], sim_socket: str) -> None:
    code, out, _ = run(capsys, "status", "--socket", sim_socket, "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["gpu_count"] == 3 and doc["healthy_gpu_count"] == 2
    assert doc["unhealthy_gpus"] == ["GPU 2: GPU lost"]
    assert doc["simulated"] is True and doc["backend"] == "sim"
    assert doc["last_sample_age_seconds"] == 0.5


_ETH9_GONE = LinkEnforcement("eth9", False, "eth9: no such network interface")


@pytest.mark.parametrize(
    ("traffic", "lines"),
    [
        (TrafficSummary(enabled=False), ["traffic:     off"]),
        (
            TrafficSummary(True, (LinkEnforcement("eth1", True), LinkEnforcement("eth2", True))),
            ["traffic:     on, 2 interfaces ok"],
        ),
        (
            TrafficSummary(True, (LinkEnforcement("eth1", True), _ETH9_GONE)),
            [
                "traffic:     on, 1 of 2 interfaces ok",
                "eth9 not enforced: no such network interface",
            ],
        ),
        (
            TrafficSummary(True, (LinkEnforcement("eth1", False),), marking_error="nft: timed out"),
            [
                "traffic:     on, 0 of 1 interface ok",
                "eth1 not enforced: not yet (no traffic pass since start)",
                "marking by cgroup (nftables) not in force: nft: timed out",
            ],
        ),
        (
            TrafficSummary(
                True,
                (LinkEnforcement("eth1", True),),
                rdma_backend="dcb",
                rdma_error="eth1: cannot run dcb: timed out after 10 seconds",
            ),
            [
                "traffic:     on, 1 interface ok",
                "RDMA DSCP map (dcb) not in force: eth1: cannot run dcb: timed out after 10 seconds",
            ],
        ),
        (
            TrafficSummary(True),
            ["traffic:     on, no interfaces (traffic.interfaces is empty): tags and marking only"],
        ),
        (
            TrafficSummary(True, marking=False),
            ["traffic:     on, no interfaces (traffic.interfaces is empty): tags only"],
        ),
    ],
)
def test_status_says_how_traffic_is_enforced(
    capsys: pytest.CaptureFixture[str], sock_dir: Path, traffic: TrafficSummary, lines: list[str]
) -> None:
    status = status_showing(capsys, sock_dir, make_servicer(traffic=traffic), lines)
    assert status["traffic"] == {
        "enabled": traffic.enabled,
        "interfaces": [
            {"name": i.name, "enforced": i.enforced, "error": i.error} for i in traffic.interfaces
        ],
        "marking_error": traffic.marking_error,
        "marking_off": not traffic.marking,
        "rdma_backend": traffic.rdma_backend,
        "rdma_error": traffic.rdma_error,
    }


def status_showing(
    capsys: pytest.CaptureFixture[str], sock_dir: Path, servicer: NodeServicer, lines: list[str]
) -> dict[str, Any]:
    """``gpuctl status`` of ``servicer``: ``lines[0]`` is one of its rows and the rest its
    last lines (each problem, after the GPUs'); its ``--json`` returned."""
    path = sock_dir / "gpud.sock"
    with ServerThread(ApiServer(path, servicers=[servicer.register])):
        code, out, _ = run(capsys, "--socket", str(path), "status")
        assert code == 0
        shown = out.splitlines()
        assert lines[0] in shown
        assert shown[len(shown) - len(lines) + 1 :] == lines[1:]
        code, out, _ = run(capsys, "--socket", str(path), "--json", "status")
    status: dict[str, Any] = json.loads(out)
    return status


@pytest.mark.parametrize(
    ("reload", "lines"),
    [
        (ReloadState(), ["config:      as loaded at start (no reload since)"]),
        (ReloadState(reloads=1, last_monotonic=NOW - 5), ["config:      reloaded 5.0 s ago"]),
        (
            ReloadState(
                reloads=2,
                last_monotonic=NOW - 5,
                error="/etc/gpud/gpud.toml:telemetry.interval_s: 0.0 is out of range",
            ),
            [
                "config:      reload FAILED 5.0 s ago: running the config loaded before, not"
                " the file's",
                "config reload failed: /etc/gpud/gpud.toml:telemetry.interval_s: 0.0 is out"
                " of range",
            ],
        ),
        (
            ReloadState(
                reloads=1, last_monotonic=NOW - 5, restart_needed=("mps.enabled", "traffic.levels")
            ),
            [
                "config:      reloaded 5.0 s ago; some keys wait for a restart",
                "config: needs a restart to change: mps.enabled, traffic.levels (running the"
                " values before)",
            ],
        ),
        (
            ReloadState(
                reloads=1,
                last_monotonic=NOW - 5,
                overridden=(
                    "daemon.log_level changed in /etc/gpud/gpud.toml but --log-level overrides it",
                ),
            ),
            [
                "config:      reloaded 5.0 s ago; flags override some of its changes",
                "config: daemon.log_level changed in /etc/gpud/gpud.toml but --log-level"
                " overrides it (running the flag's value)",
            ],
        ),
        (
            ReloadState(file_changed=True),
            [
                "config:      as loaded at start (no reload since); the file changed since",
                "config: the file changed since it was read: systemctl reload gpud to take it"
                " (gpud --check-config to check it first)",
            ],
        ),
    ],
)
def test_status_says_whether_the_running_config_is_the_file_s(
    capsys: pytest.CaptureFixture[str], sock_dir: Path, reload: ReloadState, lines: list[str]
) -> None:
    config = status_showing(capsys, sock_dir, make_servicer(reload=reload), lines)["config"]
    assert config.get("reload_error", "") == reload.error
    assert config.get("restart_needed", []) == list(reload.restart_needed)
    assert config.get("file_changed", False) == reload.file_changed
    assert config.get("overridden", []) == list(reload.overridden)


DB = "/var/lib/gpud/state.db"
EVENTS = "/var/lib/gpud/events.jsonl"


@pytest.mark.parametrize(
    ("files", "lines"),
    [
        (
            StateFiles(DB, EVENTS, event_log_lines_queued=1, event_log_write_monotonic=NOW - 0.5),
            ["state files: no failed write"],
        ),
        (
            StateFiles(DB, EVENTS, event_log_lines_queued=5, event_log_write_monotonic=NOW - 12),
            [
                "state files: no failed write; held up: event log",
                f"event log {EVENTS}: 5 lines queued for 12.0 s (its disk hangs? the journal"
                " has them)",
            ],
        ),
        (
            StateFiles(DB, EVENTS, state_db_write_monotonic=NOW - 3),
            [
                "state files: no failed write; held up: state database",
                f"state database {DB}: a write has run for 3.0 s (its disk hangs, or another"
                " process holds its lock? the change is kept once it ends)",
            ],
        ),
    ],
)
def test_status_says_a_state_file_write_held_up_though_none_failed(
    capsys: pytest.CaptureFixture[str], sock_dir: Path, files: StateFiles, lines: list[str]
) -> None:
    """A hung disk fails no write: what shows it is a write that has not ended, with the
    event log's lines queued behind it."""
    said = status_showing(capsys, sock_dir, make_servicer(state_files=files), lines)
    assert int(said["state_files"].get("event_log_lines_queued", 0)) == (
        files.event_log_lines_queued
    )


@pytest.mark.parametrize(
    ("files", "lines"),
    [
        (StateFiles(DB, EVENTS), ["state files: no failed write"]),
        (
            StateFiles(
                DB,
                EVENTS,
                state_db_error="database or disk is full",
                state_db_error_monotonic=NOW - 5,
            ),
            [
                "state files: NOT written: state database",
                f"state database {DB} cannot be written: database or disk is full (since 5.0 s"
                " ago; a refused change is not kept)",
            ],
        ),
        (
            StateFiles(
                DB, EVENTS, event_log_error="No space left on device", event_log_lines_missing=3
            ),
            [
                "state files: NOT written: event log",
                f"event log {EVENTS} cannot be written: No space left on device; it lacks 3"
                " events since (the journal and gpuctl events have them)",
            ],
        ),
        (
            StateFiles(
                DB,
                EVENTS,
                state_db_error="attempt to write a readonly database",
                state_db_error_monotonic=NOW - 60,
                event_log_error="Read-only file system",
                event_log_lines_missing=1,
            ),
            [
                "state files: NOT written: state database and event log",
                f"state database {DB} cannot be written: attempt to write a readonly database"
                " (since 1m 00s ago; a refused change is not kept)",
                f"event log {EVENTS} cannot be written: Read-only file system; it lacks 1"
                " event since (the journal and gpuctl events have them)",
            ],
        ),
    ],
)
def test_status_says_which_state_file_cannot_be_written_and_why(
    capsys: pytest.CaptureFixture[str], sock_dir: Path, files: StateFiles, lines: list[str]
) -> None:
    shown = status_showing(capsys, sock_dir, make_servicer(state_files=files), lines)
    said = shown["state_files"]
    assert said["state_db_path"] == DB and said["event_log_path"] == EVENTS
    assert said.get("state_db_error", "") == files.state_db_error
    assert (said.get("state_db_error_age_seconds") is not None) == bool(files.state_db_error)
    assert said.get("event_log_error", "") == files.event_log_error
    assert int(said.get("event_log_lines_missing", 0)) == files.event_log_lines_missing


def test_status_from_a_gpud_without_state_files_in_it_has_no_state_files_line(
    capsys: pytest.CaptureFixture[str], sim_socket: str
) -> None:
    code, out, _ = run(capsys, "--socket", sim_socket, "status")
    assert code == 0 and "state files" not in out and "cannot be written" not in out


WATCHDOG_WARNING = (
    "a loop pass held up by a GPU that stopped answering, hung helpers and another process's"
    " lock on the state database can go 93.0 s without feeding the systemd watchdog"
    " (WatchdogSec=90s, less a 2 s margin): systemd may kill gpud while it still works."
    " Give the unit WatchdogSec=95s or more"
)


def test_status_warns_of_a_config_whose_loop_pass_can_outlast_the_watchdog(
    capsys: pytest.CaptureFixture[str], sock_dir: Path
) -> None:
    """The warning gpud logs at start and at a reload is the operator's first look too:
    one line after the rows, and ``--json``'s ``watchdog_warning``."""
    servicer = make_servicer(reload=ReloadState(), watchdog_warning=WATCHDOG_WARNING)
    said = status_showing(
        capsys,
        sock_dir,
        servicer,
        [
            "config:      as loaded at start (no reload since)",
            f"config: WARNING: {WATCHDOG_WARNING}",
        ],
    )
    assert said["watchdog_warning"] == WATCHDOG_WARNING


def test_status_from_a_gpud_without_a_watchdog_warning_has_no_warning_line(
    capsys: pytest.CaptureFixture[str], sim_socket: str
) -> None:
    """A gpud older than the field sends none, as does one whose gap fits."""
    code, out, _ = run(capsys, "--socket", sim_socket, "status")
    assert code == 0 and "WARNING" not in out
    code, out, _ = run(capsys, "--socket", sim_socket, "--json", "status")
    assert code == 0 and json.loads(out)["watchdog_warning"] == ""


def test_status_from_a_gpud_without_traffic_in_it_has_no_traffic_line(
    capsys: pytest.CaptureFixture[str], sim_socket: str
) -> None:
    code, out, _ = run(capsys, "--socket", sim_socket, "status")
    assert code == 0 and "traffic" not in out


def test_gpus_table(capsys: pytest.CaptureFixture[str], sim_socket: str) -> None:
    code, out, _ = run(capsys, "--socket", sim_socket, "gpus")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == [
        "GPU",
        "MODEL",
        "UUID",
        "HEALTH",
        "MEM",
        "GiB",
        "UTIL",
        "POWER",
        "TEMP",
        "MIG",
    ]
    gpu0 = lines[1].split()
    assert gpu0[:4] == ["0", "H100-SXM5-80GB", "GPU-00000000", "ok"]
    assert "20.0 / 80.0" in lines[1] and "50%" in lines[1] and "312 W" in lines[1]
    assert "54 C" in lines[1] and lines[1].rstrip().endswith("off")
    gpu1 = lines[2]
    assert gpu1.split()[0] == "1" and "-" in gpu1.split()  # utilization and power: not supported
    assert gpu1.rstrip().endswith("on")
    assert lines[3].startswith("  1:0") and "1g.10gb" in lines[3] and "2.0 / 10.0" in lines[3]
    assert lines[4].startswith("  1:1") and "gi 8 ci 0" in lines[4]
    assert lines[5].split()[:4] == ["2", "H100-SXM5-80GB", "GPU-00000002", "UNHEALTHY"]
    assert lines[6] == "GPU 2 unhealthy: GPU lost"
    assert len(lines) == 7


def test_gpus_json_has_numbers_and_nulls(
    capsys: pytest.CaptureFixture[str], sim_socket: str
) -> None:
    code, out, _ = run(capsys, "--json", "--socket", sim_socket, "gpus")
    assert code == 0
    gpus = json.loads(out)["gpus"]
    assert [g["index"] for g in gpus] == [0, 1, 2]
    assert gpus[0]["memory"]["used_bytes"] == 20 * 1024**3  # a number, not "20 GiB" or "2147..."
    assert gpus[0]["power_watts"] == 312.5
    assert gpus[0]["processes"] == [
        {
            "pid": 100,
            "used_memory_bytes": None,
            "gpu_instance_id": None,
            "compute_instance_id": None,
        }
    ]
    assert gpus[1]["power_watts"] is None and gpus[1]["utilization"] is None
    assert gpus[1]["mig_mode"] == {"current": True, "pending": True}
    assert [d["uuid"][:6] for d in gpus[1]["mig_devices"]] == ["MIG-10", "MIG-11"]
    assert gpus[1]["mig_devices"][1]["memory"] is None
    assert gpus[2]["healthy"] is False and gpus[2]["reason"] == "GPU lost"
    # a process list not read is null beside why, never [] ("none run")
    assert gpus[0]["processes_unknown"] == ""
    assert gpus[1]["processes"] is None and "Not Supported" in gpus[1]["processes_unknown"]
    assert gpus[2]["processes"] is None and gpus[2]["processes_unknown"] == "GPU lost"
    assert [p["pid"] for p in gpus[1]["mig_devices"][0]["processes"]] == [4242]


def test_gpus_json_a_mig_device_whose_processes_were_not_read_has_null_processes(
    capsys: pytest.CaptureFixture[str], sock_dir: Path
) -> None:
    snap = make_snapshot()
    full, with_mig, lost = snap.gpus
    unread = with_mig.mig_devices[1]._replace(
        processes=(),
        processes_read=False,
        processes_error="nvmlDeviceGetComputeRunningProcesses failed on GPU 1: Not Supported",
    )
    with_mig = with_mig._replace(mig_devices=(with_mig.mig_devices[0], unread))
    snap = dataclasses.replace(snap, gpus=(full, with_mig, lost))
    path = sock_dir / "gpud.sock"
    with ServerThread(ApiServer(path, servicers=[make_servicer(snapshot=lambda: snap).register])):
        code, out, _ = run(capsys, "--json", "--socket", str(path), "gpus", "--gpu", "1")
    listed, not_listed = json.loads(out)["gpus"][0]["mig_devices"]
    assert code == 0 and listed["processes_unknown"] == "" and listed["processes"]
    assert not_listed["processes"] is None and "Not Supported" in not_listed["processes_unknown"]


def _lost_before_start() -> Snapshot:
    """GPU 0 lost before gpud started, as an earlier run last saw it; GPU 1 never read."""
    seen = SeenIdentity("GPU-5c6e1f2a-0000", "NVIDIA H100 80GB HBM3", "00000000:18:00.0")
    return Snapshot(
        wall_time=1_700_000_000.0,
        monotonic=0.0,
        gpus=(
            GpuSample(placeholder_identity(0), False, "GPU lost", 0.0, last_seen=seen),
            GpuSample(placeholder_identity(1), False, "GPU lost", 0.0),
        ),
        tick_seconds=0.0,
    )


@pytest.fixture
def lost_socket(sock_dir: Path) -> Iterator[str]:
    path = sock_dir / "gpud.sock"
    snap = _lost_before_start()
    with ServerThread(ApiServer(path, servicers=[make_servicer(snapshot=lambda: snap).register])):
        yield str(path)


def test_gpus_shows_the_product_a_gpu_lost_before_start_was_last_seen_as(
    capsys: pytest.CaptureFixture[str], sock_dir: Path
) -> None:
    """As the GPUs that answer are shown (and as its metrics are labelled): by gpud's
    product key, where the earlier run kept it; by NVML's name where it did not."""
    seen = SeenIdentity(
        "GPU-5c6e1f2a-0000", "NVIDIA H100 80GB HBM3", "00000000:18:00.0", "H100-SXM5-80GB"
    )
    live = make_snapshot().gpus[0]
    snap = Snapshot(
        wall_time=1_700_000_000.0,
        monotonic=0.0,
        gpus=(
            GpuSample(placeholder_identity(0), False, "GPU lost", 0.0, last_seen=seen),
            live._replace(identity=dataclasses.replace(live.identity, index=1)),
        ),
        tick_seconds=0.0,
    )
    path = sock_dir / "gpud.sock"
    with ServerThread(ApiServer(path, servicers=[make_servicer(snapshot=lambda: snap).register])):
        code, out, _ = run(capsys, "--socket", str(path), "gpus")
        assert code == 0
        lost, answers = (re.split(" {2,}", line)[1] for line in out.splitlines()[1:3])
        assert (lost, answers) == ("H100-SXM5-80GB (last seen)", "H100-SXM5-80GB")
        code, out, _ = run(capsys, "--json", "--socket", str(path), "gpus", "--gpu", "0")
        (gpu,) = json.loads(out)["gpus"]
        assert gpu["product"] == "H100-SXM5-80GB" and gpu["memory_total_bytes"] is None


def test_gpus_names_a_gpu_lost_before_start_as_last_seen(
    capsys: pytest.CaptureFixture[str], lost_socket: str
) -> None:
    code, out, _ = run(capsys, "--socket", lost_socket, "gpus")
    gpu0, gpu1 = out.splitlines()[1:3]
    # an earlier run's name, marked as such: not a fact read of the board now
    assert code == 0 and gpu0.startswith(
        "0    NVIDIA H100 80GB HBM3 (last seen)  GPU-5c6e1f2a  UNHEALTHY"
    )
    assert gpu1.split()[:4] == ["1", "?", "?", "UNHEALTHY"]  # never read by any run
    assert "GPU 1 unhealthy: GPU lost" in out  # listed, with its fault
    code, out, _ = run(capsys, "--json", "--socket", lost_socket, "gpus")
    gpus = json.loads(out)["gpus"]
    assert [g["index"] for g in gpus] == [0, 1]
    assert gpus[0]["uuid"] == "GPU-5c6e1f2a-0000" and gpus[0]["name"] == "NVIDIA H100 80GB HBM3"
    assert gpus[0]["pci_bus_id"] == "00000000:18:00.0" and gpus[0]["product"] is None
    unknown = {k: gpus[1][k] for k in ("uuid", "name", "product", "pci_bus_id")}
    assert unknown == dict.fromkeys(unknown)  # null, as every reading not known
    # static facts never read, by this run or (beyond the name) an earlier one: null, not a
    # GPU of 0 bytes, PCI id 0 and no MIG
    static = ("pci_device_id", "memory_total_bytes", "mig_capable")
    for gpu in gpus:
        assert {k: gpu[k] for k in static} == dict.fromkeys(static)
        assert gpu["healthy"] is False and gpu["reason"] == "GPU lost"
    code, out, _ = run(capsys, "--json", "--socket", lost_socket, "status")
    status = json.loads(out)
    assert status["healthy_gpu_count"] == 0
    assert status["unhealthy_gpus"] == ["GPU 0: GPU lost", "GPU 1: GPU lost"]


def test_gpus_shows_the_static_facts_of_a_gpu_read(
    capsys: pytest.CaptureFixture[str], sim_socket: str
) -> None:
    """Read, they are set, also where they are 0 or false: not taken for "unknown"."""
    code, out, _ = run(capsys, "--json", "--socket", sim_socket, "gpus")
    gpus = json.loads(out)["gpus"]
    assert code == 0 and gpus
    for gpu in gpus:
        assert gpu["memory_total_bytes"] > 0 and gpu["pci_device_id"] > 0
        assert gpu["mig_capable"] in (True, False)


def test_gpus_one_gpu_and_invalid_index(
    capsys: pytest.CaptureFixture[str], sim_socket: str
) -> None:
    code, out, _ = run(capsys, "--socket", sim_socket, "--json", "gpus", "--gpu", "1")
    assert code == 0 and [g["index"] for g in json.loads(out)["gpus"]] == [1]
    code, out, err = run(capsys, "--socket", sim_socket, "gpus", "--gpu", "9")
    assert code == 4  # an unknown GPU is NotFound, in every command
    assert out == "" and "gpu: no GPU 9" in err


def test_xid_lists_every_uncleared_critical_xid(
    capsys: pytest.CaptureFixture[str], sim_socket: str
) -> None:
    code, out, _ = run(capsys, "--socket", sim_socket, "xid")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["GPU", "UUID", "XID", "COUNT", "FIRST", "SEEN", "LAST", "SEEN"]
    uuid = "GPU-00000002-1111-2222-3333-444455556666"
    assert lines[1].split()[:4] == ["2", uuid, "79", "1"]
    assert lines[2].split() == ["2", uuid, "48", "3", "-", "-"]  # when: unknown
    assert len(lines) == 3
    assert run(capsys, "--socket", sim_socket, "xid", "list", "--gpu", "0")[1] == (
        "no uncleared critical Xid\n"
    )
    code, out, _ = run(capsys, "--socket", sim_socket, "--json", "xid", "list")
    assert code == 0
    assert json.loads(out)["critical_xids"] == [
        {
            "gpu": 2,
            "uuid": uuid,
            "xid": 79,
            "count": 1,
            "first_seen_unix_seconds": 1_699_999_000.0,
            "last_seen_unix_seconds": 1_699_999_000.0,
        },
        {
            "gpu": 2,
            "uuid": uuid,
            "xid": 48,
            "count": 3,
            "first_seen_unix_seconds": 0.0,
            "last_seen_unix_seconds": 0.0,
        },
    ]


def test_events(capsys: pytest.CaptureFixture[str], sim_socket: str) -> None:
    code, out, _ = run(capsys, "--socket", sim_socket, "events")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["TIME", "KIND", "MESSAGE", "FIELDS"]
    assert "gpu.unhealthy" in lines[1] and 'gpu=2 path="/x" uuid="GPU-2"' in lines[1]
    code, out, _ = run(
        capsys, "--socket", sim_socket, "events", "--kind", "gpu.", "--limit", "1", "--json"
    )
    assert code == 0
    events = json.loads(out)["events"]
    assert [e["message"] for e in events] == ["GPU 2 back"]
    assert events[0]["fields"] == {"gpu": 2}


class _OlderEventLog:
    """The event log of a gpud older than ``gpuctl events --gpu/--job``: it ignores them."""

    def __init__(self, log: EventLog) -> None:
        self._log = log

    def recent(self, limit: int = 100, kind_prefix: str = "", **_: str) -> list[Event]:
        return self._log.recent(limit, kind_prefix)

    def emit(self, kind: str, message: str, **fields: object) -> Event:
        return self._log.emit(kind, message, **fields)


@pytest.mark.parametrize("older", [False, True], ids=["gpud", "older-gpud"])
def test_events_about_a_gpu_or_a_job(
    capsys: pytest.CaptureFixture[str], sock_dir: Path, older: bool
) -> None:
    """``--gpu`` (an index or a UUID) and ``--job`` keep the events about them, of every
    kind, in the table and in --json alike; against a gpud that ignores them too."""
    log = EventLog(None)
    log.emit("gpu.unhealthy", "GPU 1 lost", gpu=1, uuid="GPU-1", reason="lost")
    log.emit("job.gpu_unhealthy", "job a: GPU 1", job="a", gpu=1, uuid="GPU-1", reservation="r")
    log.emit("mps.start", "MIG 1:0", gpu=1, uuid="MIG-1a", gpu_uuid="GPU-1", mig_uuid="MIG-1a")
    log.emit("job.add", "job b registered", job="b")
    log.emit("gpu.recovered", "GPU 0 back", gpu=0, uuid="GPU-0")
    events = _OlderEventLog(log) if older else log
    servicer = NodeServicer(snapshots=make_snapshot, node_info=node_info, events=events)
    path = str(sock_dir / "gpud.sock")
    with ServerThread(ApiServer(Path(path), servicers=[servicer.register])):
        code, out, _ = run(capsys, "--socket", path, "events", "--gpu", "1")
        assert code == 0
        kinds = [line.split()[2] for line in out.splitlines()[1:]]
        assert kinds == ["gpu.unhealthy", "job.gpu_unhealthy", "mps.start"]
        code, out, _ = run(capsys, "--socket", path, "--json", "events", "--gpu", "GPU-1")
        assert code == 0
        doc = json.loads(out)
        assert [e["message"] for e in doc["events"]] == ["GPU 1 lost", "job a: GPU 1", "MIG 1:0"]
        assert set(doc["events"][0]) == {"time_unix_seconds", "kind", "message", "fields", "seq"}
        code, out, _ = run(capsys, "--socket", path, "--json", "events", "--job", "a")
        assert [e["message"] for e in json.loads(out)["events"]] == ["job a: GPU 1"]
        code, out, _ = run(capsys, "--socket", path, "--json", "events", "--gpu", "MIG-1a")
        assert [e["message"] for e in json.loads(out)["events"]] == ["MIG 1:0"]
        code, out, _ = run(capsys, "--socket", path, "--json", "events", "--job", "zz")
        assert code == 0 and json.loads(out)["events"] == []


@pytest.mark.parametrize("older", [False, True], ids=["gpud", "older-gpud"])
def test_events_about_a_job_include_those_naming_it_among_a_devices_jobs(
    capsys: pytest.CaptureFixture[str], sock_dir: Path, older: bool
) -> None:
    """``--job`` keeps the MPS events that name the job among the jobs holding the device
    (``jobs``: its clients lost their server, or it loses MPS while the GPU is unhealthy),
    not those naming other jobs; a count of jobs (``net.untagged``) names none."""
    log = EventLog(None)
    log.emit("mps.restart", "daemon restarted", gpu=1, uuid="GPU-1", jobs=["a", "b"])
    log.emit("mps.start_skipped", "job a loses MPS", gpu=1, uuid="GPU-1", jobs=["a"])
    log.emit("mps.restart", "daemon restarted", gpu=0, uuid="GPU-0", jobs=["c"])
    log.emit("net.untagged", "3 jobs untagged", jobs=3, names=["c"])
    events = _OlderEventLog(log) if older else log
    servicer = NodeServicer(snapshots=make_snapshot, node_info=node_info, events=events)
    path = str(sock_dir / "gpud.sock")
    with ServerThread(ApiServer(Path(path), servicers=[servicer.register])):
        code, out, _ = run(capsys, "--socket", path, "--json", "events", "--job", "a")
        assert code == 0
        got = [(e["kind"], e["fields"]["gpu"]) for e in json.loads(out)["events"]]
        assert got == [("mps.restart", 1), ("mps.start_skipped", 1)]
        code, out, _ = run(capsys, "--socket", path, "--json", "events", "--job", "c")
        assert [e["kind"] for e in json.loads(out)["events"]] == ["mps.restart", "net.untagged"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (("--gpu", ""), "argument --gpu: expected a GPU index (0..N-1, gpuctl gpus lists them)"),
        (("--gpu", "gpu1"), "or a GPU-/MIG- UUID, got 'gpu1'"),
        (("--gpu", "1.5"), "got '1.5'"),
        (("--job", ""), "argument --job: give a job name, got ''"),
        (("--kind", " "), "argument --kind: give a kind or its start, got ' '"),
    ],
)
def test_events_refuses_a_filter_that_would_not_filter(
    capsys: pytest.CaptureFixture[str], sim_socket: str, argv: tuple[str, ...], said: str
) -> None:
    """An empty value (an unset variable) is not the option left out, which would list every
    event, and a GPU that is neither an index nor a UUID matches nothing: exit 2 saying so,
    not an empty or a whole listing."""
    code, out, err = run(capsys, "--socket", sim_socket, "events", *argv)
    assert (code, out) == (2, "") and said in err


def test_events_invalid_limit(capsys: pytest.CaptureFixture[str], sim_socket: str) -> None:
    code, _, err = run(capsys, "--socket", sim_socket, "events", "--limit", "-3")
    assert code == 2 and "--limit: -3 is not in 0..10000" in err


def test_sim_fault(capsys: pytest.CaptureFixture[str], sim_socket: str, faults: FakeFaults) -> None:
    assert run(capsys, "--socket", sim_socket, "sim", "fault", "--gpu", "0", "lost")[0] == 0
    assert run(capsys, "--socket", sim_socket, "sim", "fault", "--gpu", "1", "xid", "79")[0] == 0
    assert run(capsys, "--socket", sim_socket, "sim", "fault", "--gpu", "1", "slow", "2.5")[0] == 0
    code, out, _ = run(
        capsys, "--socket", sim_socket, "sim", "fault", "--gpu", "1", "slow-mig", ".2"
    )
    assert code == 0 and out.splitlines()[0] == "injected slow-mig on GPU 1"
    code, out, _ = run(
        capsys, "--socket", sim_socket, "sim", "fault", "--gpu", "2", "reset-required"
    )
    assert code == 0 and out.splitlines()[0] == "injected reset-required on GPU 2"
    code, out, _ = run(
        capsys, "--socket", sim_socket, "sim", "fault", "--gpu", "2", "not-supported", "power"
    )
    assert code == 0
    assert out.splitlines()[0] == "injected not-supported on GPU 2"
    assert "  not_supported on GPU 2" in out
    code, out, _ = run(
        capsys, "--socket", sim_socket, "--json", "sim", "fault", "--gpu", "0", "clear"
    )
    assert code == 0 and "lose on GPU 0" in json.loads(out)["active_faults"]
    assert faults.calls == [
        ("lose", 0),
        ("xid", 1, 79),
        ("slow", 1, 2.5),
        ("slow_mig", 1, 0.2),
        ("reset_required", 2),
        ("not_supported", 2, "power"),
        ("clear", 0),
    ]


def test_sim_fault_invalid_arguments(
    capsys: pytest.CaptureFixture[str], sim_socket: str, faults: FakeFaults
) -> None:
    code, _, err = run(capsys, "--socket", sim_socket, "sim", "fault", "--gpu", "5", "lost")
    assert code == 4 and "gpu: no GPU 5" in err
    code, _, err = run(capsys, "--socket", sim_socket, "sim", "fault", "--gpu", "0", "slow", "-1")
    assert code == 2 and "seconds: " in err
    code, _, err = run(
        capsys, "--socket", sim_socket, "sim", "fault", "--gpu", "0", "slow-mig", "-1"
    )
    assert code == 2 and "seconds: " in err
    code, _, err = run(capsys, "--socket", sim_socket, "sim", "fault", "--gpu", "0", "xid", "-4")
    assert code == 2 and "xid: " in err
    code, _, err = run(capsys, "--socket", sim_socket, "sim", "fault", "--gpu", "0", "melt")
    assert code == 2 and "invalid choice" in err  # argparse
    assert faults.calls == []


def test_sim_fault_refused_when_not_simulated(
    capsys: pytest.CaptureFixture[str], real_socket: str
) -> None:
    code, _, err = run(capsys, "--socket", real_socket, "sim", "fault", "--gpu", "0", "lost")
    assert code == 6  # FailedPrecondition
    assert "node is not simulated" in err
    code, _, err = run(capsys, "--socket", real_socket, "sim", "reboot")
    assert code == 6
    assert "node is not simulated" in err
    code, _, err = run(
        capsys, "--socket", real_socket, "sim", "workload", "start", "--gpu", "0", "--pid", "7"
    )
    assert code == 6
    assert "node is not simulated" in err


def test_sim_workload_on_a_mig_gpu_without_mig_names_the_option(
    capsys: pytest.CaptureFixture[str], sock_dir: Path
) -> None:
    """A process started on a GPU in MIG mode needs one of its MIG devices: the refusal
    blames --mig and lists the devices there are, rather than the PID and a Python keyword
    argument (it said "pid: GPU 0 is in MIG mode: a process runs on a MIG device (pass
    mig=)")."""
    sim = SimNode([("H100-SXM5-80GB", 2)])
    nv = sim.nvml
    nv.nvmlInit()
    handle = nv.nvmlDeviceGetHandleByIndex(0)
    nv.nvmlDeviceSetMigMode(handle, nv.NVML_DEVICE_MIG_ENABLE)
    nv.nvmlDeviceSetMigMode(nv.nvmlDeviceGetHandleByIndex(1), nv.NVML_DEVICE_MIG_ENABLE)
    sim.reboot()
    for start in (0, 1):
        place = nv.c_nvmlGpuInstancePlacement_t(start, 1)
        gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(handle, 19, ctypes.byref(place))
        nv.nvmlGpuInstanceCreateComputeInstance(gi, 0)
    servicer = NodeServicer(snapshots=make_snapshot, node_info=node_info, workloads=sim.workloads)
    path = str(sock_dir / "gpud.sock")
    with ServerThread(ApiServer(Path(path), servicers=[servicer.register])):
        start_cmd = ("--socket", path, "sim", "workload", "start", "--pid", "4242")
        code, out, err = run(capsys, *start_cmd, "--gpu", "0")
        assert code == 2 and out == ""
        assert err == (
            "gpuctl: mig: GPU 0 is in MIG mode: a process runs on one of its MIG devices;"
            " name one: a MIG device index, 0..1, or its MIG UUID (--mig)\n"
        )
        code, out, err = run(capsys, *start_cmd, "--gpu", "1")
        assert code == 2 and out == ""
        assert err == (
            "gpuctl: mig: GPU 1 is in MIG mode and has no MIG devices: no process runs on it"
            " until a MIG apply creates some\n"
        )
        assert run(capsys, *start_cmd, "--gpu", "0", "--mig", "1")[0] == 0


def test_sim_workload_lists_the_processes(
    capsys: pytest.CaptureFixture[str], sock_dir: Path
) -> None:
    sim = SimNode([("H100-SXM5-80GB", 3)])
    servicer = NodeServicer(snapshots=make_snapshot, node_info=node_info, workloads=sim.workloads)
    path = str(sock_dir / "gpud.sock")
    with ServerThread(ApiServer(Path(path), servicers=[servicer.register])):
        start = ("--socket", path, "sim", "workload", "start", "--pid")
        code, out, err = run(
            capsys, *start, "4242", "--gpu", "0", "--memory", "8GiB", "--sm", "0.6"
        )
        assert code == 0, err
        assert out.splitlines() == [
            "started simulated process 4242 on GPU 0",
            "PID   GPU  GI  CI  MEM GiB  SM",
            "4242  0    -   -   8.0      60%",
        ]
        code, out, _ = run(capsys, "--json", *start, "4343", "--gpu", "1")
        assert code == 0
        doc = json.loads(out)
        assert doc["processes"] == [
            {
                "pid": 4242,
                "gpu": 0,
                "gpu_instance_id": None,
                "compute_instance_id": None,
                "used_memory_bytes": 8 << 30,
                "sm_ratio": 0.6,
            },
            {
                "pid": 4343,
                "gpu": 1,
                "gpu_instance_id": None,
                "compute_instance_id": None,
                "used_memory_bytes": 1 << 30,
                "sm_ratio": 0.5,
            },
        ]
        # what a gpuctl that reads only the lines prints
        assert doc["workloads"] == [
            "pid 4242 on GPU 0: 8.0 GiB, 60% SM",
            "pid 4343 on GPU 1: 1.0 GiB, 50% SM",
        ]
        # the same PID on the same GPU again: already exists, not a bad argument
        code, out, err = run(capsys, *start, "4242", "--gpu", "0")
        assert code == 5 and out == ""
        assert "pid 4242 already runs on GPU 0" in err
        # an unknown MIG device: not found, as in every other command
        code, out, err = run(capsys, *start, "4444", "--gpu", "0", "--mig", "9")
        assert code == 4 and out == ""
        assert "GPU 0 has no MIG device 9" in err
        # a GPU fallen off the bus: no process starts there (nor shows once it is back)
        sim.faults.lose(2)
        code, out, err = run(capsys, *start, "4545", "--gpu", "2")
        assert code == 6 and out == ""
        assert "GPU 2 has fallen off the bus (sim fault lost): no process starts on it" in err
        code, out, err = run(capsys, "--json", *start, "4545", "--gpu", "2")
        assert code == 6 and out == ""
        assert json.loads(err)["error"]["class"] == "FailedPrecondition"
        sim.faults.clear(2)
        assert {w.pid for w in sim.workloads.list()} == {4242, 4343}
        stop = ("--socket", path, "sim", "workload", "stop", "--pid")
        code, out, _ = run(capsys, *stop, "4242")
        assert code == 0 and out.splitlines()[0] == "stopped simulated process 4242"
        assert [line.split()[0] for line in out.splitlines()[1:]] == ["PID", "4343"]
        code, out, _ = run(capsys, *stop, "4343")
        assert code == 0
        assert out == "stopped simulated process 4343\nno simulated processes running\n"


def test_daemon_error_exit_code_comes_from_the_error_class(
    capsys: pytest.CaptureFixture[str], sim_socket: str, faults: FakeFaults
) -> None:
    faults.fail = GpuLost("GPU 0 fell off the bus", gpu=0)
    code, _, err = run(capsys, "--socket", sim_socket, "sim", "fault", "--gpu", "0", "lost")
    assert code == 10  # GpuLost, not 3 (daemon not running) although both are UNAVAILABLE
    assert "GPU 0 fell off the bus" in err


# (argv after --socket, exit code, code, class): a daemon error, a gRPC error without
# gpud's metadata, gpuctl's own failures, and usage errors of argparse and of gpuctl
JSON_ERRORS = [
    (("gpus", "--gpu", "9"), 4, "NOT_FOUND", "NotFound"),
    (("sim", "fault", "--gpu", "0", "lost"), 10, "UNAVAILABLE", "GpuLost"),
    (("jobs", "ls"), 9, "UNIMPLEMENTED", None),
    (("mig", "show", "--gpu", "x"), 2, "INVALID_ARGUMENT", None),
    (("jobs", "frobnicate"), 2, "INVALID_ARGUMENT", None),
    (("--timeout", "0", "status"), 2, "INVALID_ARGUMENT", None),
    (("run", "--job", "a", "--"), 2, "INVALID_ARGUMENT", None),
    (("run", "--job", "a", "--", ""), 2, "INVALID_ARGUMENT", None),
]


@pytest.mark.parametrize(("argv", "exit_code", "status", "error_class"), JSON_ERRORS)
def test_errors_under_json_are_one_json_document_on_stderr(  # noqa: PLR0917 (parametrized)
    capsys: pytest.CaptureFixture[str],
    sim_socket: str,
    faults: FakeFaults,
    argv: tuple[str, ...],
    exit_code: int,
    status: str,
    error_class: str | None,
) -> None:
    """The same message and exit code as without --json, as JSON a script can read; the
    people's line (argparse's usage and error included) is unchanged."""
    faults.fail = GpuLost("GPU 0 fell off the bus", gpu=0)
    code, out, text = run(capsys, "--socket", sim_socket, *argv)
    assert code == exit_code and out == ""
    assert not text.startswith("{")
    json_code, out, err = run(capsys, "--socket", sim_socket, "--json", *argv)
    assert json_code == exit_code and out == ""
    doc = json.loads(err)  # one document, nothing else
    assert doc == {
        "error": {
            "message": doc["error"]["message"],
            "code": status,
            "exit_code": exit_code,
            "class": error_class,
        }
    }
    message = doc["error"]["message"]
    if ": error: " in text:  # argparse's: "PROG: error: MESSAGE", then "try 'PROG --help'"
        assert message.endswith(text.splitlines()[0].split(": error: ", 1)[1])
    else:
        assert text == f"gpuctl: {message}\n"


def test_json_errors_of_gpuctl_itself(capsys: pytest.CaptureFixture[str], sock_dir: Path) -> None:
    missing = str(sock_dir / "gpud.sock")
    code, out, err = run(capsys, "--socket", missing, "gpus", "--json")
    doc = json.loads(err)["error"]
    assert code == 3 and out == "" and doc["code"] == "UNAVAILABLE" and doc["exit_code"] == 3
    assert doc["message"].startswith(f"gpud is not running: no socket at {missing}.")
    code, out, err = run(capsys, "--json")  # no command: no help text
    assert code == 2 and out == "" and json.loads(err)["error"]["exit_code"] == 2
    # a --json after `--` is the command's, not gpuctl's
    code, _, err = run(capsys, "run", "--bogus", "--", "tool", "--json")
    assert code == 2 and err.startswith("gpuctl run: error: ") and not err.startswith("{")


# Every command under --json, answered or failing (gpud's Node service alone answers here,
# its fault port a fake one: the other services' calls fail UNIMPLEMENTED, exit 9; those of
# workloads and reboot are refused, exit 6): (argv after --socket, exit code)
JSON_SWEEP = [
    (("status",), 0),
    (("gpus",), 0),
    (("gpus", "--gpu", "1"), 0),
    (("gpus", "--gpu", "9"), 4),
    (("gpus", "--gpu", "x"), 2),
    (("events",), 0),
    (("events", "--gpu", "2", "--kind", "gpu."), 0),
    (("events", "--gpu", "zz"), 2),
    (("xid",), 0),
    (("xid", "list"), 0),
    (("xid", "clear"), 2),
    (("version",), 0),
    (("sim", "fault", "--gpu", "0", "xid", "48"), 0),
    (("sim", "fault", "--gpu", "0", "bogus"), 2),
    (("sim", "workload", "start", "--gpu", "0", "--pid", "4242"), 6),  # the fake: no workloads
    (("sim", "workload", "start", "--gpu", "0", "--pid", "0"), 2),
    (("sim", "reboot"), 6),
    (("mig",), 9),
    (("mig", "export", "-c", ""), 2),
    (("mig", "forget", ""), 2),
    (("mig", "apply", "-f", "/nonexistent.yaml", "-c", "a"), 2),
    (("mps", "set", "--gpu", "0", "--threads", "abc"), 2),
    (("mps",), 9),
    (("jobs",), 9),
    (("jobs", "add", ""), 2),
    (("jobs", "history", "--limit", "-1"), 2),
    (("env", "--job", "a"), 9),
    (("env",), 2),
    (("queue",), 9),
    (("colo",), 9),
    (("colo", "advise", "a", "--sm", "2"), 2),
    (("net",), 9),
    (("net", "pin", "--job", "a", "--level", "x"), 2),
    (("cluster",), 9),
    (("cluster", "attributes", "--job", ""), 2),
    (("run", "--job", "a", "--gpus", "1", "--", "true"), 9),
    (("nosuchcommand",), 2),
]


def _json_contract(code: int, out: str, err: str) -> Any:
    """What ``--json`` promises: stdout one strict JSON document (nothing on it but that),
    or nothing when gpuctl failed; stderr nothing, or the failure's one document with its
    exit code; every key snake_case. Returns the answer's document (None if failed)."""
    doc = _strict_json(out) if out else None
    if err:
        error = _strict_json(err)["error"]
        assert set(error) == {"message", "code", "exit_code", "class"}, error
        assert error["exit_code"] == code and error["message"], error
    assert (doc is None) == bool(err) == (code != 0), (code, out, err)

    def keys(value: Any) -> Iterator[str]:
        if isinstance(value, dict):
            for key, item in value.items():
                yield key
                yield from keys(item)
        elif isinstance(value, list):
            for item in value:
                yield from keys(item)

    assert all(re.fullmatch(r"[a-z0-9_]+", key) for key in keys(doc)), doc
    return doc


@pytest.mark.parametrize(
    ("argv", "exit_code"), JSON_SWEEP, ids=[" ".join(a) for a, _ in JSON_SWEEP]
)
def test_every_command_under_json_keeps_the_contract(
    capsys: pytest.CaptureFixture[str], sim_socket: str, argv: tuple[str, ...], exit_code: int
) -> None:
    """``gpuctl --json X`` and ``gpuctl X --json`` alike: one strict JSON document on
    stdout or one error document on stderr, with the documented exit code."""
    before = run(capsys, "--socket", sim_socket, "--json", *argv)
    _json_contract(*before)
    assert before[0] == exit_code, before
    words = list(argv)
    at = words.index("--") if "--" in words else len(words)
    after = run(capsys, "--socket", sim_socket, *words[:at], "--json", *words[at:])
    _json_contract(*after)
    assert after[0] == exit_code, after


@pytest.mark.parametrize(
    ("argv", "exit_code"), JSON_SWEEP, ids=[" ".join(a) for a, _ in JSON_SWEEP]
)
def test_every_command_under_json_says_gpud_is_not_running_as_json(
    capsys: pytest.CaptureFixture[str], sock_dir: Path, argv: tuple[str, ...], exit_code: int
) -> None:
    """Exit 3 and its error document, whatever the command; a usage error still comes
    first (exit 2), and `version` answers for the client alone."""
    code, out, err = run(capsys, "--socket", str(sock_dir / "gpud.sock"), "--json", *argv)
    doc = _json_contract(code, out, err)
    if argv == ("version",):
        assert code == 0 and doc["daemon"] is None and doc["daemon_error"]
    else:
        assert code == (2 if exit_code == 2 else 3), (code, err)


def test_not_running(capsys: pytest.CaptureFixture[str], sock_dir: Path) -> None:
    missing = sock_dir / "gpud.sock"
    code, out, err = run(capsys, "--socket", str(missing), "status")
    assert code == 3 and out == ""
    assert str(missing) in err and "systemctl start gpud" in err
    # a stale socket file: it exists, nobody listens
    dead = socket.socket(socket.AF_UNIX)
    dead.bind(str(missing))
    dead.close()
    code, _, err = run(capsys, "--socket", str(missing), "gpus", "--json")
    assert code == 3 and "nothing listens on" in err
    # a path that is no socket at all: a file, a directory, or none named
    plain = sock_dir / "gpud.conf"
    plain.write_text("")
    for path, what in ((plain, "a file"), (sock_dir, "a directory")):
        code, _, err = run(capsys, "--socket", str(path), "status")
        assert code == 3 and f"there is {what}, not a socket, at {path}." in err
    code, _, err = run(capsys, "--socket", "", "status")
    assert code == 2 and "--socket: must name gpud's socket" in err


def test_socket_from_environment(capsys: pytest.CaptureFixture[str], sim_socket: str) -> None:
    assert main(["status"], env={"GPUD_SOCKET": sim_socket}) == 0
    assert "node-a" in capsys.readouterr().out
    # --socket wins over the environment
    assert main(["--socket", sim_socket, "status"], env={"GPUD_SOCKET": "/nonexistent"}) == 0


def test_version(capsys: pytest.CaptureFixture[str], sim_socket: str, sock_dir: Path) -> None:
    code, out, _ = run(capsys, "--socket", sim_socket, "version")
    assert code == 0 and out.splitlines()[0].startswith("gpuctl ") and "gpud   0." in out
    code, out, _ = run(capsys, "--socket", str(sock_dir / "nope.sock"), "--json", "version")
    doc = json.loads(out)
    assert code == 0 and doc["daemon"] is None and "not running" in doc["daemon_error"]
    assert doc["client_build"] == current_build() and doc["daemon_build"] is None


def _version_against(
    capsys: pytest.CaptureFixture[str], sock_dir: Path, daemon_build: str
) -> tuple[str, dict[str, object]]:
    path = sock_dir / "gpud.sock"
    servicer = make_servicer(build=daemon_build)
    with ServerThread(ApiServer(path, servicers=[servicer.register])):
        code, text, _ = run(capsys, "--socket", str(path), "version")
        assert code == 0
        code, out, _ = run(capsys, "--socket", str(path), "--json", "version")
        assert code == 0
    return text, json.loads(out)


def test_version_when_gpud_runs_the_installed_build(
    capsys: pytest.CaptureFixture[str], sock_dir: Path
) -> None:
    text, doc = _version_against(capsys, sock_dir, current_build())
    assert text == (
        f"gpuctl 0.1.0 (build {current_build()})\ngpud   0.1.0 (build {current_build()})\n"
    )
    assert doc["daemon_build"] == doc["client_build"] == current_build()
    assert doc["builds_differ"] is False


def test_version_says_gpud_was_not_restarted_after_the_code_changed(
    capsys: pytest.CaptureFixture[str], sock_dir: Path
) -> None:
    text, doc = _version_against(capsys, sock_dir, "9e8d7c6b5a43")
    assert text.splitlines() == [
        f"gpuctl 0.1.0 (build {current_build()})",
        "gpud   0.1.0 (build 9e8d7c6b5a43)",
        f"builds differ: gpud runs build 9e8d7c6b5a43, the installed code is build"
        f" {current_build()}: gpud was not restarted since the code changed"
        " (systemctl restart gpud)",
    ]
    assert doc["client_build"] == current_build() and doc["daemon_build"] == "9e8d7c6b5a43"
    assert doc["builds_differ"] is True


def test_version_of_an_older_gpud_without_a_build(
    capsys: pytest.CaptureFixture[str], sock_dir: Path
) -> None:
    text, doc = _version_against(capsys, sock_dir, "")  # a gpud older than the field
    assert text.splitlines()[1] == "gpud   0.1.0 (older gpud, no build)"
    assert "differ" not in text
    assert doc["daemon"] == "0.1.0" and doc["daemon_build"] is None
    assert doc["builds_differ"] is False


def test_version_compares_no_unknown_build() -> None:
    assert differ_line(UNKNOWN, "9e8d7c6b5a43") is None
    assert differ_line("3f2a9c1d04ab", UNKNOWN) is None
    assert differ_line("3f2a9c1d04ab", "3f2a9c1d04ab") is None


def test_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        run(
            capsys,
        )[0]
        == 2
    )  # no command: help on stderr
    assert run(capsys, "frobnicate")[0] == 2
    for absurd in ("0", "-1", "nan", "inf", "1e309", "1e12", "86400.01", "abc", "10s"):
        for argv in (("--timeout", absurd, "status"), ("status", "--timeout", absurd)):
            code, out, err = run(capsys, *argv)
            prog = "gpuctl" if argv[0] == "--timeout" else "gpuctl status"
            assert (code, out) == (2, ""), argv
            assert err.splitlines() == [
                f"{prog}: error: argument --timeout: {absurd!r} is not a number of seconds"
                " (0 < s <= 86400)",
                f"try '{prog} --help'",
            ]
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "status" in out and "sim" in out


def test_no_option_takes_a_bare_int_or_float() -> None:
    """Every number an option takes goes through gpuctl's typed parsers (a range, named in
    its refusal), never argparse's ``invalid float value: 'abc'``."""
    pending = [build_parser()]
    bare = []
    while pending:
        parser = pending.pop()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                pending.extend(action.choices.values())
            elif action.type in {int, float}:
                bare.append(f"{parser.prog} {'/'.join(action.option_strings) or action.dest}")
    assert bare == []


@pytest.mark.parametrize(
    ("argv", "prog", "said"),
    [
        (("run", "--threads", "abc", "--", "true"), "gpuctl run", "argument --threads: 'abc'"),
        (("jobs", "add", "x", "--gpus", "-1"), "gpuctl jobs add", "argument --gpus: -1 is not"),
        (("run", "--", "true"), "gpuctl run", "the following arguments are required: --job"),
        (("frobnicate",), "gpuctl", "argument COMMAND: invalid choice: 'frobnicate'"),
    ],
    ids=["run --threads abc", "jobs add --gpus -1", "run without --job", "frobnicate"],
)
def test_a_usage_error_is_its_line_and_where_the_usage_is(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], prog: str, said: str
) -> None:
    """argparse's error on one line, then where the command's usage is, not the whole
    usage before it; --json keeps its one document; exit 2 either way."""
    code, out, err = run(capsys, *argv)
    assert (code, out) == (2, "")
    assert err.startswith(f"{prog}: error: {said}") and "usage:" not in err, err
    assert err.splitlines()[1:] == [f"try '{prog} --help'"]
    code, out, err = run(capsys, "--json", *argv)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert json.loads(err)["error"]["exit_code"] == 2 and said in err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (
            ("net", "pin", "--job", "a", "--level", "99999999999"),
            "--level: '99999999999' is not a level",
        ),
        (("net", "report", "--job", "a", "--iterations", str(2**64)), "--iterations: 1844"),
        # a report's numbers are refused naming the flag, not the API field gpud would name
        *(
            (
                ("net", "report", "--job", "a", "--iterations", "1", f"--ideal={ideal}"),
                f"--ideal: {ideal} is not in 1e-06..86400",
            )
            for ideal in ("nan", "inf", "-inf", "0.0", "-1.0", "1e-07", "86401.0")
        ),
        *(
            (
                ("net", "report", "--job", "a", "--iterations", "1", f"--timestamp={ts}"),
                f"--timestamp: {ts!r} is not unix seconds: a finite number over 0",
            )
            for ts in ("nan", "inf", "-inf", "-1", "0", "1e400", "now")
        ),
        (("jobs", "add", "x", "--threads", "5000000000"), "--threads: 5000000000 is not in 1..100"),
        # the percentages gpud takes, as jobs add and run say them
        (("mps", "set", "--gpu", "0", "--threads", "abc"), "'abc' is not an integer in 1..100"),
        (("mps", "set", "--gpu", "0", "--threads", "0"), "--threads: 0 is not in 1..100"),
        (("mps", "set", "--gpu", "0", "--threads", "101"), "--threads: 101 is not in 1..100"),
        (("jobs", "add", "x", "--priority", "abc"), "--priority: 'abc' is not an integer in 0..1"),
        (
            ("mig", "apply", "-f", "x", "-c", "y", "--drain", "--drain-timeout", "nan"),
            "--drain-timeout: 'nan' is not a number of seconds (0 < s <= 86400)",
        ),
        (("run", "--job", "x", "--threads", "0", "--", "true"), "--threads: 0 is not in 1..100"),
        (("jobs", "add", "x", "--gpus", "-1"), "--gpus: -1 is not in 1..4294967295"),
        (("jobs", "add", "x", "--gpus", "0"), "--gpus: 0 is not in 1..4294967295"),
        (("run", "--job", "x", "--gpus", "0", "--", "true"), "--gpus: 0 is not in 1..4294967295"),
        # every option taking a GPU index: one type, one message, a UUID or -1 refused
        *(
            (
                argv,
                f"GPU index: expected a number 0..N-1 for a node of N GPUs (gpuctl gpus lists them), got {bad!r}",
            )
            for bad in ("GPU-nonexistent", "-1", "3000000000")
            for argv in (
                ("gpus", "--gpu", bad),
                ("xid", "list", "--gpu", bad),
                ("xid", "clear", bad),
                ("xid", "clear", "--gpu", bad),
                ("sim", "fault", "--gpu", bad, "clear"),
                ("sim", "workload", "start", "--gpu", bad, "--pid", "9"),
            )
        ),
        (("sim", "workload", "stop", "--pid", "-4"), "--pid: -4 is not in 1.."),
        (("events", "--limit", "1e3"), "--limit: '1e3' is not an integer"),
        (("jobs", "history", "--limit", "-1"), "--limit: -1 is not in 0..4294967295"),
        (("jobs", "add", "x", "--memory", "99999999999TiB"), "more than any device holds"),
        # a p99 SLO no service can be held to: one range and one message for both commands
        (
            ("colo", "advise", "x", "--kind", "inference", "--slo-ms", "0.001"),
            "--slo-ms/--slo-p99-ms: 0.001 ms is outside 0.01..3600000 ms",
        ),
        (
            ("colo", "advise", "x", "--kind", "inference", "--slo-p99-ms", "nan"),
            "--slo-ms/--slo-p99-ms: nan ms is outside 0.01..3600000 ms",
        ),
        (("colo", "advise", "x", "--slo-ms=-inf"), "-inf ms is outside 0.01..3600000 ms"),
        (("colo", "advise", "x", "--slo-ms", "50ms"), "'50ms' is not a number of milliseconds"),
        # every number advise sends is held to the range Advise takes, naming the flag
        *(
            (("colo", "advise", "x", "--sm", sm), f"--sm: {sm} is not over 0 and at most 1")
            for sm in ("nan", "inf", "-0.5", "0.0", "1.5")
        ),
        (("colo", "advise", "x", "--sm", "half"), "--sm: 'half' is not a number over 0 and"),
        *(
            (
                ("colo", "advise", "x", f"--peak-load={load}"),
                f"--peak-load: {load} is not in 0..1e+07",
            )
            for load in ("nan", "inf", "-1.0", "100000000.0")
        ),
        (("sim", "fault", "--gpu", "0", "slow", "nan"), "seconds: nan is not in 0..86400"),
        (("sim", "fault", "--gpu", "0", "slow", "inf"), "seconds: inf is not in 0..86400"),
        (
            ("sim", "workload", "start", "--gpu", "0", "--pid", "9", "--sm", "nan"),
            "--sm: nan is not in 0..1",
        ),
        (
            ("jobs", "add", "x", "--kind", "inference", "--slo-p99-ms", "0.001"),
            "--slo-p99-ms: 0.001 ms is outside 0.01..3600000 ms",
        ),
        (("jobs", "add", "x", "--slo-p99-ms", "0"), "--slo-p99-ms: 0 ms is outside 0.01.."),
        # the value as given, not rounded to one that reads as inside the range
        (
            ("jobs", "add", "x", "--slo-p99-ms", "3600001"),
            "--slo-p99-ms: 3600001 ms is outside 0.01..3600000 ms",
        ),
        (("events", "--kind", "gpu.\udcff"), "an argument is not valid UTF-8: 'gpu.\\udcff'"),
    ],
)
def test_a_number_a_request_cannot_carry_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], sim_socket: str, argv: tuple[str, ...], words: str
) -> None:
    code, _, err = run(capsys, "--socket", sim_socket, *argv)
    assert code == 2 and words in err and "Traceback" not in err


def _connect_as_nobody(socket_path: Path) -> int:
    """Run gpuctl in a forked child that dropped root, and return its exit code."""
    with warnings.catch_warnings():
        # Python 3.12+ warns about fork() in a process with threads (the server's); the
        # child only drops privileges, connects and exits.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # child: no pytest machinery past this point, only os._exit
        code = 1
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 2)
            code = main(["--socket", str(socket_path), "status"], env={})
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_permission_denied(capsys: pytest.CaptureFixture[str], sock_dir: Path) -> None:
    private = sock_dir / "private"
    private.mkdir()
    path = private / "gpud.sock"
    with _serve(path):
        if os.geteuid() == 0:
            # root bypasses file modes: ask as an unprivileged user instead
            private.chmod(0o700)
            assert _connect_as_nobody(path) == 77
        else:
            private.chmod(0o000)
            try:
                code, _, err = run(capsys, "--socket", str(path), "status")
            finally:
                private.chmod(0o700)
            assert code == 77 and "permission denied" in err and "group" in err


class _RpcError(grpc.RpcError):
    def __init__(
        self, code: grpc.StatusCode, details: str, metadata: tuple[tuple[str, str], ...] = ()
    ) -> None:
        self._code, self._details, self._metadata = code, details, metadata

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata


@pytest.mark.parametrize(
    ("error", "exit_code", "words", "unanswered"),
    [
        (
            _RpcError(grpc.StatusCode.UNAVAILABLE, "GOAWAY received"),
            3,
            "went away during the",
            True,
        ),
        (
            _RpcError(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses"),
            3,
            "systemctl start gpud",
            False,
        ),
        (_RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), 3, "within 2 s", True),
        (
            _RpcError(grpc.StatusCode.UNIMPLEMENTED, "Method not found!"),
            9,
            "UNIMPLEMENTED: Method not found!: the server on /run/gpud/gpud.sock does not serve"
            " this call: it is not gpud, or a gpud older than this gpuctl",
            False,
        ),
        (_RpcError(grpc.StatusCode.PERMISSION_DENIED, "no"), 77, "no", False),
        (
            _RpcError(grpc.StatusCode.UNAVAILABLE, "GPU 3 lost", (("gpud-exit-code", "10"),)),
            10,
            "GPU 3 lost",
            False,
        ),
        (_RpcError(grpc.StatusCode.DATA_LOSS, "?"), 1, "DATA_LOSS", False),
    ],
)
def test_grpc_errors_become_exit_codes(
    error: _RpcError, exit_code: int, words: str, unanswered: bool
) -> None:
    """``unanswered``: only a call gpud may have taken and not answered (gone during it,
    past its deadline) is one a retry with a request id may repeat; a refusal gpud sent
    (its exit code in the metadata) and a gpud not reached are not."""
    ctx = Context(
        socket_path=Path("/run/gpud/gpud.sock"), timeout=2.0, output=Output(json_output=False)
    )
    err = ctx.translate(error)
    assert err.exit_code == exit_code and words in str(err)
    assert err.unanswered is unanswered


def test_json_of_plain_values_holding_messages() -> None:
    """``jobs add --queue --json`` prints the job and its queue entry side by side."""
    stream = io.StringIO()
    out = Output(json_output=True, stream=stream)
    job = jobs_pb2.Job(name="a", devices=["0"])
    out.print_json({"job": job, "entries": [queue_pb2.QueueEntry(job="a")]})
    doc = json.loads(stream.getvalue())
    assert doc["job"]["name"] == "a" and doc["job"]["devices"] == ["0"]
    assert doc["entries"][0]["job"] == "a"


def test_json_shows_a_link_rate_as_a_whole_number_of_bits() -> None:
    """``gpuctl net show --json``: a rate gpud sets in whole bits, carried as a double."""
    stream = io.StringIO()
    out = Output(json_output=True, stream=stream)
    iface = net_pb2.NetInterface(name="eth0", rate_bits_per_second=100_000_000.0)
    out.print_json(net_pb2.ShowNetResponse(enabled=True, interfaces=[iface]))
    assert '"rate_bits_per_second": 100000000,' in stream.getvalue()
    shown = json.loads(stream.getvalue())["interfaces"][0]["rate_bits_per_second"]
    assert shown == 100_000_000 and isinstance(shown, int)


def _strict_json(text: str) -> Any:
    """``text`` parsed as JSON proper: ``NaN``, ``Infinity`` refused, as jq refuses them."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_has_no_nan_nor_infinity() -> None:
    """A number that is not one (NaN, an infinity) is null: Python's json would write
    ``NaN``/``Infinity``, which jq and every strict parser refuse, the whole document lost."""
    stream = io.StringIO()
    out = Output(json_output=True, stream=stream)
    out.print_json(
        colo_pb2.ShowColoResponse(price_residual=math.inf, predictor_mean_abs_error=math.nan)
    )
    doc = _strict_json(stream.getvalue())
    assert doc["price_residual"] is None and doc["predictor_mean_abs_error"] is None
    stream.seek(0)
    stream.truncate()
    out.print_json_line({"a": [-math.inf, 1.5]})
    assert stream.getvalue() == '{"a": [null, 1.5]}\n'


def test_events_with_a_field_that_is_no_number_are_shown(
    capsys: pytest.CaptureFixture[str], sock_dir: Path
) -> None:
    """An event's field that is NaN or infinite (a ratio of nothing) reads as null: not a
    crash of `gpuctl events` with and without --json, nor NaN in its JSON."""
    log = EventLog(None)
    log.emit("colo.guard", "job a: p99 unknown", job="a", p99_ms=math.nan, ratio=math.inf)
    servicer = NodeServicer(snapshots=make_snapshot, node_info=node_info, events=log)
    path = str(sock_dir / "gpud.sock")
    with ServerThread(ApiServer(Path(path), servicers=[servicer.register])):
        code, out, err = run(capsys, "--socket", path, "events")
        assert code == 0, err
        assert 'job="a" p99_ms=null ratio=null' in out
        code, out, err = run(capsys, "--socket", path, "--json", "events")
        assert code == 0, err
        fields = _strict_json(out)["events"][0]["fields"]
        assert fields == {"job": "a", "p99_ms": None, "ratio": None}


def test_display_helpers() -> None:
    assert [seconds(v) for v in (0.0123, 4.25, 125, 3725, 90061)] == [
        "12 ms",
        "4.2 s",
        "2m 05s",
        "1h 02m",
        "1d 1h 01m",
    ]
    assert format_table(("A", "BB"), [("xyz", "1"), ("", "22")]) == "A    BB\nxyz  1\n     22"
    # a column padded to at most 4: the long cell pushes only its own row's rest right
    rows = [("a", "x" * 10, "1"), ("b", "yy", "2")]
    assert format_table(("K", "MSG", "F"), rows, pad_at_most={1: 4}).splitlines() == [
        "K  MSG   F",
        "a  xxxxxxxxxx  1",
        "b  yy    2",
    ]


def test_gpud_dying_during_a_call_is_not_called_not_running(sock_dir: Path) -> None:
    ctx = Context(socket_path=sock_dir / "gpud.sock", timeout=5.0, output=Output(json_output=False))
    died = ctx.translate(_RpcError(grpc.StatusCode.UNAVAILABLE, "Stream removed (Socket closed)"))
    assert died.exit_code == 3
    assert str(died).startswith(f"gpud on {sock_dir / 'gpud.sock'} went away during the call")
    assert "whether what this command asks for was done is unknown" in str(died)
    refused = ctx.translate(
        _RpcError(
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: ... Connection refused",
        )
    )
    assert refused.exit_code == 3 and str(refused).startswith("gpud is not running")


def test_a_gpud_that_takes_the_connection_and_never_answers_is_not_called_not_running(
    sock_dir: Path,
) -> None:
    ctx = Context(socket_path=sock_dir / "gpud.sock", timeout=5.0, output=Output(json_output=False))
    hung = ctx.translate(
        _RpcError(
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: UNKNOWN: unix:/x: connection"
            " attempt timed out before receiving SETTINGS frame",
        )
    )
    assert hung.exit_code == 3 and hung.status == "DEADLINE_EXCEEDED" and hung.deadline_s == 5.0
    assert str(hung).startswith(f"gpud did not answer within 5 s on {sock_dir / 'gpud.sock'}")
    assert "not running" not in str(hung)


def test_a_gpud_whose_queue_filled_after_the_probe_is_said_busy_not_not_running(
    sock_dir: Path,
) -> None:
    # the probe connected; gRPC's own connect then met a queue full under a burst of gpuctl
    ctx = Context(socket_path=sock_dir / "gpud.sock", timeout=5.0, output=Output(json_output=False))
    busy = ctx.translate(
        _RpcError(
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: UNKNOWN: unix:/x: Delayed close"
            " due to in-progress write (recvmsg:Invalid argument (22)) (sendmsg: Transport"
            " endpoint is not connected (107))",
        )
    )
    assert busy.exit_code == 3 and busy.status == "UNAVAILABLE"
    assert str(busy).startswith(f"gpud on {sock_dir / 'gpud.sock'} runs but did not take")
    assert "Transport endpoint is not connected" in str(busy) and "busy" in str(busy)
    assert "not running" not in str(busy)
    gone = ctx.translate(
        _RpcError(
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses; last error: UNKNOWN: unix:/x: No such file or"
            " directory",
        )
    )
    assert str(gone).startswith("gpud is not running")


_FAILED_TO_CONNECT = "failed to connect to all addresses; last error: "


def _connect_failed(sock_dir: Path, last_error: str) -> CliError:
    """What gpuctl says when gRPC's own connect to gpud's socket, after the probe's,
    failed with ``last_error``."""
    ctx = Context(socket_path=sock_dir / "gpud.sock", timeout=5.0, output=Output(json_output=False))
    return ctx.translate(_RpcError(grpc.StatusCode.UNAVAILABLE, _FAILED_TO_CONNECT + last_error))


@pytest.mark.parametrize(
    "last_error",
    [
        "UNAVAILABLE: unix:/x: recvmsg:Connection reset by peer (104)",
        "UNAVAILABLE: unix:/x: Socket closed",
        # gpud died during gRPC's handshake write: gRPC's "Delayed close" wraps the reset
        "UNAVAILABLE: unix:/x: Delayed close due to in-progress write (recvmsg:Connection"
        " reset by peer (104)) (sendmsg: Broken pipe (32))",
    ],
)
def test_a_gpud_killed_with_gpuctls_connection_queued_is_said_to_have_closed_it_not_busy(
    sock_dir: Path, last_error: str
) -> None:
    # gpud ended (kill -9) while gRPC's connection sat in its socket's queue
    closed = _connect_failed(sock_dir, last_error)
    assert closed.exit_code == 3 and closed.status == "UNAVAILABLE"
    assert str(closed).startswith(
        f"gpud on {sock_dir / 'gpud.sock'} closed gpuctl's connection before answering ("
    )
    assert last_error in str(closed)
    assert "it stopped or restarted just now; nothing was sent" in str(closed)
    assert closed.unanswered  # gpud restarting: a request id's try again is answered once
    assert "busy" not in str(closed) and "retry" not in str(closed)


def test_a_socket_closed_to_gpuctl_after_the_probe_is_permission_denied_not_busy(
    sock_dir: Path,
) -> None:
    # the socket's mode or group changed between the probe and gRPC's own connect
    denied = _connect_failed(
        sock_dir,
        "FAILED_PRECONDITION: unix:/x: connect failed: addr: unix:/x error: Permission denied",
    )
    assert denied.exit_code == 77 and denied.status == "PERMISSION_DENIED"
    assert str(denied).startswith(f"permission denied on {sock_dir / 'gpud.sock'}: ")
    assert "busy" not in str(denied)


@pytest.mark.parametrize(
    "last_error",
    [
        "UNAVAILABLE: unix:/x: Delayed close due to in-progress write (recvmsg:Invalid argument"
        " (22)) (sendmsg: Transport endpoint is not connected (107))",
        "UNAVAILABLE: unix:/x: sendmsg: Transport endpoint is not connected (107)",
        "UNAVAILABLE: unix:/x: connect: Resource temporarily unavailable (11)",
    ],
)
def test_a_gpud_whose_queue_was_full_is_said_busy(sock_dir: Path, last_error: str) -> None:
    busy = _connect_failed(sock_dir, last_error)
    assert busy.exit_code == 3
    assert str(busy).startswith(f"gpud on {sock_dir / 'gpud.sock'} runs but did not take")
    assert last_error in str(busy) and "it is busy" in str(busy)


@pytest.mark.parametrize("dir_name", ["Socket closed", "Permission denied", "Not a directory"])
def test_a_socket_path_that_reads_like_a_reason_does_not_change_what_gpuctl_says(
    sock_dir: Path, dir_name: str
) -> None:
    # only the kernel's words in gRPC's text say why; the socket's path, which it names, does not
    path = sock_dir / dir_name / "gpud.sock"
    ctx = Context(socket_path=path, timeout=5.0, output=Output(json_output=False))
    busy = ctx.translate(
        _RpcError(
            grpc.StatusCode.UNAVAILABLE,
            f"{_FAILED_TO_CONNECT}UNAVAILABLE: unix:{path}: sendmsg: Transport endpoint is not"
            " connected (107)",
        )
    )
    assert busy.exit_code == 3
    assert str(busy).startswith(f"gpud on {path} runs but did not take"), str(busy)
    assert "it is busy" in str(busy)
    unknown = ctx.translate(
        _RpcError(
            grpc.StatusCode.UNAVAILABLE, f"{_FAILED_TO_CONNECT}UNKNOWN: unix:{path}: Bad frob"
        )
    )
    assert str(unknown).startswith("gpud is not running: cannot reach it"), str(unknown)
    denied = ctx.translate(
        _RpcError(
            grpc.StatusCode.UNAVAILABLE,
            f"{_FAILED_TO_CONNECT}FAILED_PRECONDITION: unix:{path}: connect failed: addr:"
            f" unix:{path} error: Permission denied",
        )
    )
    assert denied.exit_code == 77 and denied.status == "PERMISSION_DENIED"


def test_a_failure_to_connect_gpuctl_cannot_read_is_not_called_busy(sock_dir: Path) -> None:
    # only the kernel's own words for a full queue say gpud runs and is busy
    unknown = _connect_failed(sock_dir, "UNKNOWN: unix:/x: Bad frob")
    assert unknown.exit_code == 3
    assert str(unknown).startswith(
        f"gpud is not running: cannot reach it ({_FAILED_TO_CONNECT}UNKNOWN: unix:/x: Bad frob)"
        f" on {sock_dir / 'gpud.sock'}."
    )
    assert "busy" not in str(unknown)


@pytest.mark.parametrize(
    "command", [("events", "--follow"), ("cluster", "attributes", "--watch"), ("status",)]
)
def test_a_follower_of_a_hung_gpud_gives_up_after_the_timeout_saying_it_does_not_answer(
    capsys: pytest.CaptureFixture[str], sock_dir: Path, command: tuple[str, ...]
) -> None:
    # a stopped gpud: the kernel takes the connection into the listen backlog, and no
    # HTTP/2 settings ever come back
    path = sock_dir / "gpud.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as hung:
        hung.bind(str(path))
        hung.listen(8)
        code, out, err = run(capsys, "--socket", str(path), "--timeout", "1", "--json", *command)
    doc = json.loads(err)["error"]
    assert code == 3 and out == "" and doc["code"] == "DEADLINE_EXCEEDED", err
    assert doc["message"].startswith(f"gpud did not answer within 1 s on {path}"), err


def _full_queue(held: contextlib.ExitStack, path: Path) -> socket.socket:
    """A socket listening at ``path`` whose queue of connections not yet accepted is full
    (with ``held`` those waiting in it)."""
    listening = held.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    listening.bind(str(path))
    listening.listen(0)
    while True:
        waiting = held.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        waiting.setblocking(False)
        try:
            waiting.connect(str(path))
        except BlockingIOError:
            return listening


def test_a_gpud_whose_queue_of_connections_is_full_is_not_called_not_running(
    capsys: pytest.CaptureFixture[str], sock_dir: Path
) -> None:
    path = sock_dir / "gpud.sock"
    with contextlib.ExitStack() as held:
        _full_queue(held, path)  # a gpud that never accepts them
        code, out, err = run(capsys, "--socket", str(path), "--timeout", "1", "status")
    assert code == 3 and out == "", err
    assert err.startswith(f"gpuctl: gpud on {path} takes no more connections: "), err
    assert "stayed full for 1 s" in err, err
    assert "not running" not in err and err.count("\n") == 1, err


def test_a_gpud_whose_queue_of_connections_is_full_for_a_moment_is_waited_for(
    sock_dir: Path,
) -> None:
    # a live gpud busy for a moment under a burst of gpuctl: once it accepts again, the
    # connection that waited for room in its queue goes through
    path = sock_dir / "gpud.sock"
    with contextlib.ExitStack() as held:
        busy = _full_queue(held, path)

        def accept_again() -> None:
            time.sleep(0.3)  # the probe finds the queue full first
            busy.accept()[0].close()

        thread = threading.Thread(target=accept_again)
        thread.start()
        try:
            probe_socket(path, 60.0)
        finally:
            thread.join()


@pytest.mark.parametrize(
    ("group", "reader"),
    [("mig", "show"), ("mps", "show"), ("net", "show"), ("colo", "show"), ("cluster", "status")],
)
def test_a_command_group_alone_runs_its_reading(group: str, reader: str) -> None:
    parser = build_parser()
    alone, named = parser.parse_args([group]), parser.parse_args([group, reader])
    assert alone.run is named.run
    # the reading's own options have their defaults when the group is given alone
    assert {k: v for k, v in vars(named).items() if not k.endswith("_command")} == {
        k: v for k, v in vars(alone).items() if not k.endswith("_command")
    }


def test_sim_reboot_samples_the_node_once(
    capsys: pytest.CaptureFixture[str], sock_dir: Path
) -> None:
    """``gpuctl sim reboot``: the reboot samples the node again itself (before a pass
    waiting on it runs), and the API samples no second time after it."""
    calls: list[str] = []
    servicer = NodeServicer(
        snapshots=make_snapshot,
        node_info=node_info,
        reboot=lambda: calls.append("reboot"),
        sample_again=lambda: calls.append("sample"),
    )
    path = str(sock_dir / "gpud.sock")
    with ServerThread(ApiServer(Path(path), servicers=[servicer.register])):
        code, _, err = run(capsys, "--socket", path, "sim", "reboot")
    assert code == 0, err
    assert calls == ["reboot"]
