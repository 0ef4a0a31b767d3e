"""The daemon's life on a simulated node, driven in-process: start-up errors and reloads."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import json
import logging
import math
import re
import shutil
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from gpud.build import current as current_build
from gpud.cluster.model import NodeReport
from gpud.config import MAX_CONFIG_BYTES, Config, Layers, file_stamp
from gpud.daemon import (
    COLO_NAME,
    MPS_WAIT_S,
    STOP_CLOSE_WAIT_S,
    STOP_HOOK_FLOOR_S,
    TRAFFIC_WAIT_S,
    Daemon,
    Step,
    config_watchdog_warning,
)
from gpud.dirlock import DirLocks
from gpud.errors import (
    ConfigError,
    FailedPrecondition,
    GpudError,
    InUse,
    ResourceExhausted,
    StateDamaged,
    StateInUse,
    StateUnwritable,
    Unavailable,
)
from gpud.events import EventLog
from gpud.jobs.registry import JobKind, JobSpec
from gpud.jobs.service import RunRequest
from gpud.main import (
    build_parser,
    exit_leaving_stuck_threads,
    load_layers,
    lock_dirs,
    mps_control_command,
    open_backend,
    serve_until_stopped,
)
from gpud.metrics import build_registry
from gpud.metrics_http import METRICS_POLL_S
from gpud.mig.layout import load_config
from gpud.mig.manager import MigManager
from gpud.notify import Notifier
from gpud.store import APPLICATION_ID, DB_NAME, StateStore
from gpud.telemetry.seen import SCHEMA as SEEN_SCHEMA
from gpud.v1 import mig_pb2, mig_pb2_grpc, node_pb2, node_pb2_grpc
from tests.unit.mps_support import short_dir
from tests.unit.store_support import LetGoWhenSaid, held_write_lock, lock_waits

MIG_LAYOUTS = Path(__file__).parent.parent / "data" / "mig-parted" / "config.yaml"


def make_config(root: Path, **overrides: object) -> Config:
    base = {
        "daemon.state_dir": root / "state",
        "daemon.run_dir": root / "run",
        "backend.kind": "sim",
        "backend.simulate": "A100-SXM4-40GB:1",
        "metrics.address": "127.0.0.1:0",
        "mig.on_start": "report",
    }
    base.update(overrides)
    return Config().with_overrides(base, source="test")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path


def build(
    config: Config,
    *,
    reload_to: list[Config | ConfigError] | None = None,
    clock: Callable[[], float] = time.monotonic,
    code_build: str | None = None,
    dir_locks: DirLocks | None = None,
    reload_config: Callable[[], Layers] | None = None,
    config_path: Path | None = None,
    file_config: Config | None = None,
    notifier: Notifier | None = None,
) -> Daemon:
    """``reload_config``: the file's config as a reload reads it (default: each of
    ``reload_to`` in turn); ``config_path``: the file, stamped now as read at start;
    ``file_config``: the file's own values at start (flags not applied); ``notifier``:
    systemd's (default: none, not watched)."""
    backend, sim = open_backend(config)
    pending = reload_to if reload_to is not None else []

    def next_config() -> Layers:
        read = pending.pop(0)  # a ConfigError: the file is bad
        if isinstance(read, ConfigError):
            raise read
        return Layers(read, read)  # no flags

    return Daemon(
        config,
        backend=backend,
        sim=sim,
        mps_control_command=mps_control_command(config),
        notifier=notifier or Notifier(None),
        reload_config=reload_config or next_config,
        clock=clock,
        build=code_build,
        dir_locks=dir_locks,
        config_path=str(config_path or ""),
        config_stamp=file_stamp(config_path) if config_path is not None else None,
        file_config=file_config,
    )


def test_metrics_address_in_use_names_the_key(root: Path) -> None:
    """Held by another process: no config error (exit 2 is never restarted), Unavailable."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        d = build(make_config(root, **{"metrics.address": f"127.0.0.1:{port}"}))
        with pytest.raises(Unavailable, match=r"metrics\.address"):
            asyncio.run(asyncio.wait_for(d.run(), timeout=20))
    assert not d.config.socket_path.exists()


def test_reload_says_which_changes_need_a_restart(root: Path) -> None:
    changed = make_config(
        root,
        **{
            "telemetry.history": 5,
            "telemetry.call_timeout_s": 1.0,
            "mig.drain_timeout_s": 10.0,
            "daemon.tick_s": 0.25,
            "telemetry.interval_s": 0.5,
        },
    )
    d = build(make_config(root), reload_to=[changed])
    try:
        d.reload()
        event = d.events.recent(1, "config.reload")[0]
        assert set(event.fields["restart_needed"]) == {
            "telemetry.history",
            "telemetry.call_timeout_s",
            "mig.drain_timeout_s",
        }
        assert d.config.telemetry.history == 60
        assert d.sampler.interval_s == 0.5
        assert d.loop_interval_s() == 0.25
        # and the cluster's times that follow the tick: an order fresh for three ticks
        report_s = d.config.cluster.report_timeout_s
        assert d.cluster.agent.fail_static.fresh_s == pytest.approx(3 * 0.25 + report_s)
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_the_status_call_says_whether_the_running_config_is_the_file_s(root: Path) -> None:
    """A failed reload, and keys kept until a restart, show in ``gpuctl status``; a file
    changed back clears them."""
    now = [100.0]
    bad = ConfigError("0.0 is out of range", path="/etc/gpud/gpud.toml", key="t.i")
    files = [bad, make_config(root, **{"mps.enabled": True}), make_config(root)]
    d = build(make_config(root), reload_to=files, clock=lambda: now[0])

    def status() -> node_pb2.ConfigStatus:
        request = node_pb2.GetStatusRequest()
        resp = asyncio.run(d.node_servicer.GetStatus(request, None))  # type: ignore[arg-type]
        assert resp.HasField("config")
        return resp.config

    try:
        assert not status().HasField("last_reload_age_seconds")
        d.reload()  # a bad file: the running config is kept, and said
        now[0] += 3
        first = status()
        assert first.reloads == 1 and first.last_reload_age_seconds == 3.0
        assert first.reload_error == "/etc/gpud/gpud.toml:t.i: 0.0 is out of range"
        d.reload()  # the file mended, with a key that needs a restart
        assert status().reload_error == "" and list(status().restart_needed) == ["mps.enabled"]
        assert d.config.mps.enabled is False
        d.reload()  # changed back: nothing waits
        assert status().reload_error == "" and list(status().restart_needed) == []
        assert status().reloads == 3
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_a_reload_says_a_changed_key_a_flag_overrides(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A key the file changes that a flag sets over it (``--log-level``, ``--socket``,
    ``--run-dir``, ...) keeps the flag's value, as before, but no longer silently: one
    warning, the reload's event and ``gpuctl status`` name the key, the file and the flag.
    The file changed back, nothing is said."""
    path = root / "gpud.toml"
    path.write_text('[daemon]\nlog_level = "info"\n')
    args = build_parser().parse_args(
        [
            "--config",
            str(path),
            "--simulate",
            "A100-SXM4-40GB:1",
            "--log-level",
            "warning",
            "--state-dir",
            str(root / "state"),
            "--run-dir",
            str(root / "run"),
            "--metrics-address",
            "127.0.0.1:0",
        ]
    )
    layers = load_layers(args)
    d = build(
        layers.final,
        reload_config=lambda: load_layers(args),
        config_path=path,
        file_config=layers.file,
    )
    level = logging.getLogger().level
    try:
        path.write_text(
            f'[daemon]\nlog_level = "debug"\nrun_dir = "{root / "elsewhere"}"\n'
            "[telemetry]\ninterval_s = 0.5\n"
        )
        with caplog.at_level(logging.WARNING, logger="gpud.daemon"):
            d.reload()
        said = [
            f"daemon.run_dir changed in {path} but --run-dir overrides it",
            f"daemon.log_level changed in {path} but --log-level overrides it",
        ]
        assert [r.getMessage() for r in caplog.records if r.name == "gpud.daemon"] == [
            f"config reloaded; {'; '.join(said)}"
        ]
        event = d.events.recent(1, "config.reload")[0]
        assert event.fields["overridden"] == said and event.fields["restart_needed"] == []
        assert list(status_of(d).overridden) == said
        assert d.config.daemon.log_level == "warning"  # the flag's, as before
        assert d.config.daemon.run_dir == root / "run"
        assert d.sampler.interval_s == 0.5  # the rest of the file is taken
        path.write_text('[daemon]\nlog_level = "info"\n')  # back as at start
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gpud.daemon"):
            d.reload()
        assert not [r for r in caplog.records if r.name == "gpud.daemon"]
        assert d.events.recent(1, "config.reload")[0].fields["overridden"] == []
        assert list(status_of(d).overridden) == []
    finally:
        logging.getLogger().setLevel(level)
        d.sampler.close()
        d.store.close()
        d.backend.close()


def status_of(d: Daemon) -> node_pb2.ConfigStatus:
    """The ``config`` of ``gpuctl status`` (GetStatus)."""
    request = node_pb2.GetStatusRequest()
    resp = asyncio.run(d.node_servicer.GetStatus(request, None))  # type: ignore[arg-type]
    assert resp.HasField("config")
    return resp.config


def test_a_failed_reload_keeps_the_keys_an_earlier_one_left_for_a_restart(root: Path) -> None:
    """The running config still holds a key at its start value after a failed reload:
    status goes on saying so, beside the failure."""
    bad = ConfigError("0.0 is out of range", path="/etc/gpud/gpud.toml", key="t.i")
    d = build(make_config(root), reload_to=[make_config(root, **{"mps.enabled": True}), bad])
    try:
        d.reload()
        assert list(status_of(d).restart_needed) == ["mps.enabled"]
        d.reload()
        failed = status_of(d)
        assert failed.reload_error == "/etc/gpud/gpud.toml:t.i: 0.0 is out of range"
        assert list(failed.restart_needed) == ["mps.enabled"]
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_a_reload_of_a_file_over_the_limit_fails_and_says_so(root: Path) -> None:
    """The file as ``gpud`` reads it on SIGHUP: refused unread, the running config kept,
    the event and ``gpuctl status`` naming the file and why."""
    path = root / "gpud.toml"
    path.write_text("#" * (MAX_CONFIG_BYTES + 1))
    args = build_parser().parse_args(["--config", str(path)])
    d = build(make_config(root), reload_config=lambda: load_layers(args))
    try:
        d.reload()
        event = d.events.recent(1, "config.reload_failed")[0]
        why = f"{path}: cannot read: {MAX_CONFIG_BYTES + 1} bytes, more than a config file may hold"
        assert event.message.startswith(why), event.message
        assert event.fields["path"] == str(path)
        assert status_of(d).reload_error.startswith(why)
        assert d.config.daemon.state_dir == root / "state"  # the running config kept
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_status_says_when_the_file_changed_since_it_was_read(root: Path) -> None:
    """Edited without a reload, the file is not what gpud runs, whatever the last reload
    did; a reload reads it again, a failed one included."""
    path = root / "gpud.toml"
    path.write_text("# as at start\n")
    bad = ConfigError("not valid TOML", path=str(path))
    d = build(make_config(root), reload_to=[make_config(root), bad], config_path=path)
    try:
        assert status_of(d).file_changed is False
        path.write_text("# edited, not reloaded\n")
        assert status_of(d).file_changed is True
        d.reload()
        assert status_of(d).file_changed is False
        replaced = root / "gpud.toml.new"
        replaced.write_text("[broken\n")
        replaced.rename(path)  # as editors write: another inode
        assert status_of(d).file_changed is True
        d.reload()  # failed: but what the file says is known, and said
        assert status_of(d).file_changed is False and status_of(d).reload_error
        path.unlink()
        assert status_of(d).file_changed is True
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_a_reload_reads_the_file_off_the_event_loop(root: Path) -> None:
    """A big file's read and parse (or a slow mount) takes a while: the API answers
    meanwhile; the new config applies once read."""
    reading = threading.Event()
    release = threading.Event()
    checked = threading.Event()  # the scenario looked whether the loop ran during the read

    def slow_read() -> Layers:
        reading.set()
        release.wait(10)
        read = make_config(root, **{"telemetry.interval_s": 0.5})
        return Layers(read, read)

    d = build(make_config(root, **{"daemon.tick_s": 0.05}), reload_config=slow_read)
    answered: list[bool] = []

    async def scenario() -> None:
        run = asyncio.create_task(d.run())
        while d.events.recent(1, "daemon.start") == []:
            await asyncio.sleep(0.05)
        d.request_reload()
        assert await asyncio.to_thread(reading.wait, 5)
        await asyncio.sleep(0.1)  # runs only while the loop is free
        answered.append(not release.is_set())
        checked.set()
        release.set()
        while d.events.recent(1, "config.reload") == []:
            await asyncio.sleep(0.05)
        d.request_stop()
        assert await asyncio.wait_for(run, timeout=20) == 0

    def let_go() -> None:
        # A read on the loop blocks it, so the check never comes: end the read so the
        # check runs, late, and fails. The wait starts at the read, not before gpud starts.
        if reading.wait(20):
            checked.wait(10)
        release.set()

    threading.Thread(target=let_go, daemon=True).start()
    asyncio.run(scenario())
    assert answered == [True]
    assert d.sampler.interval_s == 0.5


def test_reload_takes_a_new_admission_mig_config(root: Path) -> None:
    layouts = Path(__file__).parent.parent / "data" / "mig-parted" / "config.yaml"
    changed = make_config(root, **{"admission.mig_config": str(layouts)})
    d = build(make_config(root), reload_to=[changed, make_config(root)])
    try:
        d.sampler.tick()  # the node's GPUs, which the file's configs are resolved on
        assert d.admission._mig_layouts() == {}
        d.reload()
        assert d.events.recent(1, "config.reload")[0].fields["restart_needed"] == []
        assert "all-balanced" in d.admission._mig_layouts()
        d.reload()  # and unset again: no remedies offered
        assert d.admission._mig_layouts() == {}
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_each_loop_pass_is_timed_and_one_past_the_tick_names_its_slowest_step(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [1000.0]
    d = build(make_config(root, **{"daemon.tick_s": 1.0}), clock=lambda: now[0])
    slow = [0.2]

    def taking(seconds: list[float], fail: bool = False) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            now[0] += seconds[0]
            if fail:
                raise RuntimeError("broken")

        return run

    d.steps = [
        Step("quick", taking([0.002])),
        Step("slow", taking(slow)),
        Step("failing", taking([0.1], fail=True)),
    ]
    registry = build_registry(d.collector, process=False)

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    try:
        caplog.set_level("DEBUG", logger="gpud.loopstats")
        asyncio.run(d.run_steps())  # 0.302 s: within the tick
        assert value("gpud_loop_overruns_total") == 0
        assert not [r for r in caplog.records if "loop pass" in r.getMessage()]
        slow[0] = 1.5
        asyncio.run(d.run_steps())  # 1.602 s: past it
        assert value("gpud_loop_duration_seconds_count") == 2
        assert value("gpud_loop_duration_seconds_bucket", le="0.5") == 1
        assert value("gpud_loop_duration_seconds_bucket", le="1.0") == 1
        assert value("gpud_loop_duration_seconds_bucket", le="2.5") == 2
        assert value("gpud_loop_duration_seconds_sum") == pytest.approx(1.904)
        assert value("gpud_loop_overruns_total") == 1
        (line,) = [r.getMessage() for r in caplog.records if "loop pass" in r.getMessage()]
        assert line == (
            "loop pass took 1.602 s, over the 1 s tick; slowest step slow; steps: slow 1.500 s,"
            " failing 0.100 s, quick 0.002 s"
        )
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_a_step_that_works_again_after_failing_says_so_once(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The journal's last word on a step is not its failure once it works again."""
    now = [1000.0]
    d = build(make_config(root), clock=lambda: now[0])
    broken = [True]

    async def run() -> None:
        now[0] += 10.0
        if broken[0]:
            raise RuntimeError("nft: no such table")

    d.steps = [Step("traffic", run)]
    try:
        caplog.set_level("INFO", logger="gpud.daemon")
        for _ in range(3):
            asyncio.run(d.run_steps())
        broken[0] = False
        asyncio.run(d.run_steps())
        asyncio.run(d.run_steps())
        lines = [(r.levelname, r.getMessage()) for r in caplog.records if "step" in r.getMessage()]
        assert lines == [
            ("WARNING", "step traffic failed (1 failures so far): nft: no such table"),
            ("INFO", "step traffic works again, after 3 failed passes over 30 s"),
        ]
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_the_status_call_says_how_traffic_is_enforced(root: Path) -> None:
    d = build(make_config(root))
    try:
        resp = asyncio.run(d.node_servicer.GetStatus(node_pb2.GetStatusRequest(), None))  # type: ignore[arg-type]
        assert resp.HasField("traffic") and not resp.traffic.enabled
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_the_status_call_says_which_state_file_cannot_be_written_and_why(root: Path) -> None:
    """A full disk under the state directory: the database's refused change and the event
    log's failing writes reach ``gpuctl status``, naming each file."""
    now = [1000.0]
    d = build(make_config(root), clock=lambda: now[0])
    state = d.config.daemon.state_dir
    try:
        resp = asyncio.run(d.node_servicer.GetStatus(node_pb2.GetStatusRequest(), None))  # type: ignore[arg-type]
        assert resp.state_files == node_pb2.StateFilesStatus(
            state_db_path=str(state / "state.db"), event_log_path=str(state / "events.jsonl")
        )
        with d.store.transaction() as conn:
            pages = conn.execute("PRAGMA page_count").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {pages}")  # no room for one more page
        with pytest.raises(StateUnwritable), d.store.transaction() as conn:
            conn.execute("CREATE TABLE filler (v TEXT)")
            conn.executemany("INSERT INTO filler VALUES (?)", [("x" * 4000,) for _ in range(20)])
        (state / "events.jsonl").unlink(missing_ok=True)
        (state / "events.jsonl").mkdir()  # its writes fail, as on a full disk
        d.events.emit("job.add", "not in the file")
        now[0] = 1005.0
        resp = asyncio.run(d.node_servicer.GetStatus(node_pb2.GetStatusRequest(), None))  # type: ignore[arg-type]
        said = resp.state_files
        assert said.state_db_error == "database or disk is full"
        assert said.state_db_error_age_seconds == 5.0
        assert (said.event_log_error, said.event_log_lines_missing) == ("Is a directory", 1)
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_a_start_waits_for_another_process_s_write_to_the_open_s_deadline(
    root: Path,
) -> None:
    """A sqlite3 shell's write under way when gpud starts: the open passes (WAL), and the
    first tables wait for it as the open would, saying so, rather than the start stopping
    after write_wait_s; built, not yet run, a write still waits to the open's deadline."""
    config = make_config(root)
    StateStore(config.daemon.state_dir).close()
    with (
        held_write_lock(config.daemon.state_dir / DB_NAME) as holder,
        LetGoWhenSaid(holder).listening() as said,
    ):
        d = build(config)
    try:
        assert len(said.said) == 1 and "in use by another process" in said.said[0]
        with d.store.transaction() as conn:  # the open's deadline: some 27 s left
            assert conn.execute("PRAGMA busy_timeout").fetchone()[0] > 5000
    finally:
        _close(d)


def test_a_start_up_write_held_up_by_another_process_is_waited_for_and_gpud_serves(
    root: Path,
) -> None:
    """A sqlite3 shell's write begun once the tables were made, still held when the start-up
    steps write (the first jobs tick): the start says it waits, naming the file, and serves
    once the shell lets go, rather than exiting after write_wait_s (systemd restarting it
    into the same lock); once it serves, a held-up write is refused within write_wait_s."""
    config = make_config(root)
    d = build(config)
    path = config.daemon.state_dir / DB_NAME

    async def scenario() -> tuple[node_pb2.GetStatusResponse, list[str], int]:
        with held_write_lock(path) as holder, LetGoWhenSaid(holder).listening() as said:
            run = asyncio.create_task(d.run())
            for _ in range(600):
                if run.done() or d.events.recent(1, "daemon.start"):
                    break
                await asyncio.sleep(0.05)
            if run.done():
                await run  # its error is the test's
        async with grpc.aio.insecure_channel(f"unix:{d.config.socket_path}") as ch:
            resp = await node_pb2_grpc.NodeStub(ch).GetStatus(
                node_pb2.GetStatusRequest(), timeout=10
            )
        with d.store.transaction() as conn:
            waits_ms = conn.execute("PRAGMA busy_timeout").fetchone()[0]
        d.request_stop()
        assert await run == 0
        return resp, said.said, waits_ms

    resp, said, waits_ms = asyncio.run(scenario())
    assert len(said) == 1 and f"state database {path} is in use by another process" in said[0]
    assert resp.state_files.state_db_path == str(path)
    assert not resp.state_files.state_db_error
    assert waits_ms <= 5000


def test_a_loop_pass_while_another_process_holds_the_state_lock_stays_within_the_watchdog(
    root: Path,
) -> None:
    """A backup tool holds the state database's lock: the pass's writing steps (mps, jobs,
    admission, colo, sim-jobs, cluster) are each refused, the first after ``write_wait_s``,
    the others after a short look each, not 5 s each in turn: the pass's waits and the
    loop's interval (half ``WatchdogSec`` at most) stay within the shipped unit's
    ``WatchdogSec``. Let go, the next pass writes again."""
    unit = Path(__file__).parents[2] / "systemd" / "gpud.service"
    (line,) = [s for s in unit.read_text().splitlines() if s.startswith("WatchdogSec=")]
    watchdog_s = float(line.removeprefix("WatchdogSec=").removesuffix("s"))
    d = build(make_config(root, **{"daemon.tick_s": 0.05, "mps.enabled": True}))
    d.store.start_done()
    waits = lock_waits(d.store)
    writers = {"mps", "jobs", "admission", "colo", "sim-jobs", "cluster"}

    async def scenario() -> None:
        with held_write_lock(d.store.path):
            await d.run_steps()
        assert waits[0] == 5000 and waits[1:] == [500] * (len(waits) - 1), waits
        assert len(waits) >= len(writers) - 1  # mps's: refused after its step's wait
        assert sum(waits) / 1000 + watchdog_s / 2 < watchdog_s, waits
        assert sum(waits) / 1000 <= d.store.worst_refusals_s(len(d.steps)), waits
        await d.run_steps()  # let go; the MPS reconcile's refusal is its step's now
        refused = {s.name for s in d.steps if s.failing.failures}
        assert refused <= writers and {"jobs", "admission", "cluster"} <= refused
        assert [s.name for s in d.steps if s.failing.failed_runs] == ["mps"]
        assert d.store.write_problem() is None

    try:
        asyncio.run(scenario())
    finally:
        _close(d)


def test_the_status_call_says_how_long_a_state_database_write_has_run(root: Path) -> None:
    """A commit stuck in its fsync (a hung disk) fails nothing: the status call says the
    write under way and since when, read without the store's lock."""
    now = [1000.0]
    d = build(make_config(root), clock=lambda: now[0])
    try:
        with d.store.transaction():
            now[0] = 1012.0
            resp = asyncio.run(d.node_servicer.GetStatus(node_pb2.GetStatusRequest(), None))  # type: ignore[arg-type]
        assert resp.state_files.state_db_write_seconds == 12.0
        assert resp.state_files.event_log_lines_queued == 0
        assert not resp.state_files.HasField("event_log_write_seconds")
        resp = asyncio.run(d.node_servicer.GetStatus(node_pb2.GetStatusRequest(), None))  # type: ignore[arg-type]
        assert not resp.state_files.HasField("state_db_write_seconds")
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


class _HungTraffic:
    """A traffic tick stuck in a hung ``nft`` or ``dcb`` until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        self.release.wait(timeout=30)
        raise RuntimeError("dcb did not finish within 10 s")


def test_a_hung_traffic_tick_holds_no_other_step_back(root: Path) -> None:
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))
    hung = _HungTraffic()
    d.traffic = hung  # type: ignore[assignment]
    passes: list[str] = []

    async def other() -> None:
        passes.append("other")

    (traffic,) = [s for s in d.steps if s.name == "traffic"]
    d.steps = [traffic, Step("other", other)]

    async def scenario() -> None:
        for _ in range(3):
            await asyncio.wait_for(d.run_steps(), timeout=5)
        assert passes == ["other"] * 3 and hung.ticks == 1  # no second tick meanwhile
        hung.release.set()
        while traffic.failing.failures == 0:
            await asyncio.wait_for(d.run_steps(), timeout=5)
        assert hung.ticks == 2  # the pass that finds it ended starts the next one

    try:
        asyncio.run(scenario())
    finally:
        hung.release.set()
        d.store.close()
        d.backend.close()


class _HungMps:
    """MPS control daemons whose queries hang (a hung driver) until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.passes = 0

    def reconcile(self, snapshot: object = None) -> None:
        self.passes += 1
        self.release.wait(timeout=30)
        raise RuntimeError("MPS control did not answer within 10s")


def test_hung_mps_control_daemons_hold_no_other_step_back(root: Path) -> None:
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))
    hung = _HungMps()
    d.mps = hung  # type: ignore[assignment]
    passes: list[str] = []

    async def other() -> None:
        passes.append("other")

    (mps,) = [s for s in d.steps if s.name == "mps"]
    d.steps = [mps, Step("other", other)]

    async def scenario() -> None:
        for _ in range(3):
            await asyncio.wait_for(d.run_steps(), timeout=5)
        assert passes == ["other"] * 3 and hung.passes == 1  # no second pass meanwhile
        hung.release.set()
        while mps.failing.failures == 0:
            await asyncio.wait_for(d.run_steps(), timeout=5)
        assert hung.passes == 2  # the loop pass that finds it ended starts the next one

    try:
        asyncio.run(scenario())
    finally:
        hung.release.set()
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_an_mps_reconcile_still_running_at_the_stop_is_waited_for_and_its_error_said(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reconcile held up (another process's lock on the state database) past its step's
    wait, then refused once the stop began: the stop waits for it before leaving the
    control daemons, and says its error as a warning, not asyncio's "Task exception was
    never retrieved" with a traceback at the exit."""
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))
    release = threading.Event()
    order: list[str] = []
    why = f"state database {d.store.path} is in use by another process"

    def held_up(snapshot: object = None) -> None:
        order.append("reconcile")
        release.wait(timeout=30)
        order.append("refused")
        raise StateInUse(why)

    async def scenario() -> None:
        reconcile_held = asyncio.Event()

        async def after_mps() -> None:
            if "reconcile" in order:  # its step's wait is over; the reconcile runs on
                reconcile_held.set()

        (mps,) = [s for s in d.steps if s.name == "mps"]
        d.steps = [mps, Step("after-mps", after_mps)]
        run = await _started(d)
        d.mps.reconcile = held_up  # type: ignore[method-assign]
        d.mps.leave = lambda: order.append("leave")  # type: ignore[method-assign]
        await asyncio.wait_for(reconcile_held.wait(), timeout=30)
        d.request_stop()  # no pass starts from now on: none retrieves the error
        release.set()
        assert await asyncio.wait_for(run, timeout=d.worst_stop_s() + 5) == 0

    caplog.set_level(logging.WARNING)
    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert f"mps step failed as gpud stopped: {why}" in caplog.text
    assert order == ["reconcile", "refused", "leave"]
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_a_long_mig_apply_holds_no_loop_pass_back(root: Path) -> None:
    d = build(make_config(root))
    (mig,) = [s for s in d.steps if s.name == "mig"]
    applying, release = threading.Event(), threading.Event()

    def apply() -> None:  # holds the GPUs as an apply draining for minutes does
        with d.mig._lock:
            applying.set()
            release.wait(30)

    holder = threading.Thread(target=apply)
    holder.start()
    try:
        assert applying.wait(5)
        asyncio.run(asyncio.wait_for(mig.run(), timeout=5))
        assert mig.failing.failures == 0
    finally:
        release.set()
        holder.join()
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_a_stop_lets_a_running_mig_apply_end_before_closing_its_store(root: Path) -> None:
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))
    applying, ended, waited_for = threading.Event(), threading.Event(), threading.Event()
    seen: list[object] = []
    wait_idle = d.mig.wait_idle

    def stop_waiting(timeout_s: float) -> bool:
        if timeout_s > 0:
            waited_for.set()
        return wait_idle(timeout_s)

    d.mig.wait_idle = stop_waiting  # type: ignore[method-assign]

    def apply() -> None:  # a MIG apply in its last steps when gpud is told to stop
        with d.mig._lock:
            applying.set()
            # its last write comes once the stop waits for it (a hang guard: a stop that
            # does not wait has closed the store meanwhile)
            waited_for.wait(30)
            try:
                with d.store.transaction() as conn:
                    seen.append(conn.execute("SELECT 1").fetchone()[0])
            except Exception as err:  # the store closed under it
                seen.append(err)
        ended.set()

    async def scenario() -> None:
        run = asyncio.create_task(d.run())
        while d.events.recent(1, "daemon.start") == []:
            await asyncio.sleep(0.05)
        threading.Thread(target=apply).start()
        assert await asyncio.to_thread(applying.wait, 5)
        d.request_stop()
        assert await asyncio.wait_for(run, timeout=20) == 0

    asyncio.run(scenario())
    assert ended.wait(30)
    assert seen == [1]


def test_a_stop_ends_within_its_budget_when_a_shutdown_hook_hangs(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A hung ``nft`` or ``dcb`` under the traffic shutdown: the stop leaves it after what
    is left of the budget, and the store and the driver are still closed before systemd's
    SIGKILL would come."""
    now = [0.0]  # the daemon's clock: moved on only by the hung hook below
    d = build(make_config(root, **{"daemon.tick_s": 0.05}), clock=lambda: now[0])
    d.stop_budget_s = 1.5
    release = threading.Event()
    later: list[str] = []
    hung_ended: list[str] = []

    def hung(name: str) -> None:
        release.wait(60)
        hung_ended.append(name)

    def hung_past_the_budget() -> None:  # by the time its wait ends, the budget is spent
        now[0] += d.stop_budget_s
        hung("hook")

    d.on_shutdown(lambda: later.append("ran"))  # runs after the hung one (reverse order)
    d.on_shutdown(hung_past_the_budget)
    d.traffic.shutdown = lambda: hung("traffic")  # type: ignore[method-assign]
    closed: list[str] = []
    store_close, backend_close = d.store.close, d.backend.close

    def close_store(wait_s: float | None = None) -> None:
        store_close(wait_s=wait_s)
        closed.append("store")

    def close_backend() -> None:
        backend_close()
        closed.append("backend")

    d.store.close = close_store  # type: ignore[method-assign,assignment]
    d.backend.close = close_backend  # type: ignore[method-assign]

    async def scenario() -> None:
        run = await _started(d)
        d.request_stop()
        assert await asyncio.wait_for(run, timeout=20) == 0  # a hang guard
        assert hung_ended == []  # left to the exit: not waited for to their end

    try:
        asyncio.run(scenario())
        # asyncio.run waits for its executor's threads: the hooks' are not among them
        assert hung_ended == []
    finally:
        release.set()
    # the first hung hook what was left of the budget, the traffic's after it its floor
    given = [float(s) for s in re.findall(r"did not end within the ([0-9.]+) s", caplog.text)]
    assert given == [d.stop_budget_s, STOP_HOOK_FLOOR_S], caplog.text
    assert later == ["ran"]
    (stopped,) = d.events.recent(1, "daemon.stop")
    assert float(stopped.fields["took_s"]) == d.stop_budget_s  # as the daemon's clock says
    assert closed == ["store", "backend"]


def test_a_cluster_round_under_way_at_the_stop_leaves_the_clusters_hook_its_whole_share(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A report to the leader in flight at the stop, with the budget spent: it is waited
    for before the shutdown hooks, so the cluster's hook, on its floor, still gives up the
    leadership and withdraws this node's problem rather than being cut off waiting."""
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))
    d.stop_budget_s = 0.3
    d.pass_stop_wait_s = 0.1
    closed: list[str] = []
    close = d.cluster.agent.close

    async def closing() -> None:
        closed.append("closed")
        await close()

    d.cluster.agent.close = closing  # type: ignore[method-assign]

    async def scenario() -> None:
        run = await _started(d)
        lock = d.cluster.agent._tick_lock
        await lock.acquire()  # a round under way (a report in flight): it never ends
        try:
            d.request_stop()
            assert await asyncio.wait_for(run, timeout=20) == 0
        finally:
            lock.release()

    asyncio.run(scenario())
    assert closed == ["closed"]
    assert "a cluster round (a report to the leader, a leader's round) still ran" in caplog.text
    assert "ClusterRuntime.stop" not in caplog.text


def test_two_stop_requests_at_once_end_the_clusters_rounds_and_say_no_round_was_left(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A second SIGTERM right behind the first skips every shutdown hook, the cluster's
    included: its rounds end all the same (none, a leader's included, runs while the store
    and the driver close), and with no round under way the stop does not say one was left
    running."""
    d = build(make_config(root, **{"daemon.tick_s": 600}))  # one loop pass, no other
    reports: list[str] = []
    local_report = d.cluster.agent.local_report

    def counted() -> NodeReport:
        reports.append("report")
        return local_report()

    d.cluster.agent.local_report = counted  # type: ignore[method-assign]

    async def scenario() -> None:
        run = await _started(d)
        while not reports or d.cluster.agent.round_running:  # the first pass's round
            await asyncio.sleep(0.01)
        d.request_stop()
        d.request_stop()
        assert await asyncio.wait_for(run, timeout=20) == 0
        reports.clear()
        await d.cluster.agent.tick()  # this node leads (single): a round would report

    asyncio.run(scenario())
    assert reports == []
    assert "shutdown: skipped at a second stop" in caplog.text
    assert "a cluster round" not in caplog.text


async def _ended(run: asyncio.Task[int], release: threading.Event, *, timeout: float) -> None:
    """Wait for ``run`` to stop cleanly, then ``release`` the threads the test holds
    (asyncio.run waits for its executor's threads). They block until released, for longer
    than ``timeout``, a hang guard: a stop that ends at all did not wait for them."""
    try:
        assert await asyncio.wait_for(run, timeout=timeout) == 0
    finally:
        release.set()


def test_a_stop_waits_for_an_admission_pass_that_blocks_only_its_share_of_the_budget(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An admission pass blocked (behind the placement lock, as behind a reservation whose
    MPS query hangs) when SIGTERM came held the whole stop back: past the unit's
    TimeoutStopSec, systemd's SIGKILL came with the store and the driver still open."""
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))
    d.pass_stop_wait_s = 0.5
    in_pass, release = threading.Event(), threading.Event()

    def blocked_pass() -> None:
        in_pass.set()
        release.wait(60)

    async def scenario() -> None:
        run = await _started(d)
        d.admission.tick = blocked_pass  # type: ignore[method-assign]
        assert await asyncio.to_thread(in_pass.wait, 5)
        d.request_stop()
        await _ended(run, release, timeout=20)

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert "the loop's admission step did not end within 0.5 s" in caplog.text
    assert d.events.recent(1, "daemon.stop")


def test_a_worker_thread_stuck_in_a_driver_call_does_not_keep_a_stopped_gpud() -> None:
    """A GPU that stops answering mid-apply leaves a worker thread in a driver call that
    may never return: the daemon stops without it (and says so), and so must the process,
    not wait for the thread at the event loop's close or at interpreter exit."""
    release = threading.Event()
    cancelled: list[bool] = []

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def daemon_run() -> int:
        asyncio.get_running_loop().run_in_executor(None, release.wait, 60)  # the hung call
        asyncio.get_running_loop().create_task(forever())  # as asyncio.run, cancelled
        await asyncio.sleep(0.05)
        return 0

    before = set(threading.enumerate())

    def stuck() -> list[threading.Thread]:
        now = set(threading.enumerate()) - before
        return [t for t in now if t.name.startswith("gpud-worker")]

    try:
        assert serve_until_stopped(daemon_run()) == 0
        assert [t.is_alive() for t in stuck()] == [True]  # left, not waited for
        assert cancelled == [True]
        exits: list[int] = []
        exit_leaving_stuck_threads(0, exit_now=exits.append)
        assert exits == [0]  # a thread is stuck: exit at once
    finally:
        release.set()
    for thread in stuck():
        thread.join(30)  # a hang guard: released, it ends at once
    assert stuck() == []
    exits.clear()
    exit_leaving_stuck_threads(3, exit_now=exits.append)
    assert exits == []  # nothing stuck: the ordinary exit


def test_a_failed_sample_after_a_mig_apply_leaves_the_apply_answered(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The apply was made: a sample that fails after it is logged, not the apply's error."""
    d = build(make_config(root))

    def broken() -> None:
        raise RuntimeError("sampler broke")

    d.sampler.tick = broken  # type: ignore[method-assign]
    try:
        d._devices_changed()
    finally:
        d.store.close()
    assert "sampling again after a change failed" in caplog.text


def _mig_mps_config(root: Path, product: str) -> Config:
    """One simulated ``product`` GPU, MIG reconciled at start, MPS on."""
    return make_config(
        root,
        **{"backend.simulate": f"{product}:1", "mig.on_start": "reconcile", "mps.enabled": True},
    )


def test_the_mps_step_after_a_mig_reconcile_starts_no_daemon_on_a_destroyed_device() -> None:
    """The reconcile step destroys MIG devices (their MPS control daemons stopped first);
    the MPS step that follows in the same pass works from a sample taken after it, so no
    daemon is started for a device gone (to be stopped again as "device gone" a tick later),
    and the new devices get theirs at once."""
    with short_dir() as root:  # the daemons' pipes: a unix socket path has 107 bytes
        d = build(_mig_mps_config(root, "H100-SXM5-80GB"))
        layouts = load_config(MIG_LAYOUTS)
        other = StateStore(root / "other")
        try:
            assert d.mig.apply(layouts, "all-3g.40gb").result == "success"
            # changed behind gpud's back: the reconcile step puts it back
            drift = MigManager(d.backend, other, EventLog(None)).apply(layouts, "all-1g.10gb")
            assert drift.result == "success"
            d.mps.reconcile(d.sampler.tick())
            doomed = {s.target.uuid for s in d.mps.status() if s.up}
            assert len(doomed) == 7
            before = len(d.events.recent(kind_prefix="mps.start"))
            asyncio.run(next(s for s in d.steps if s.name == "mig").run())
            d.mps.reconcile(d.sampler.latest())  # the MPS step's pass
            starts = d.events.recent(kind_prefix="mps.start")[before:]
            assert len(starts) == 2 and not {e.fields["uuid"] for e in starts} & doomed
            serving = {s.target.uuid for s in d.mps.status() if s.up}
            assert len(serving) == 2 and not serving & doomed
        finally:
            d.mps.stop()
            other.close()
            _close(d)


class _RefusesResets:
    """The backend, with every GPU reset refused (a process held the GPU then)."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def reset_gpu(self, gpu: int) -> None:
        raise InUse(f"GPU {gpu} cannot be reset: in use by another client")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


def test_the_mps_step_after_a_reconcile_that_only_reset_a_gpu_sees_mig_off() -> None:
    """An apply turning MIG off on an A100 failed at its GPU reset (the mode change left
    pending, the instances gone); the reconcile step's retry whose only change is that reset
    samples again, so the MPS step that follows works from the GPU with MIG off and starts
    its control daemon at once, not a tick later."""
    with short_dir() as root:  # the daemons' pipes: a unix socket path has 107 bytes
        d = build(_mig_mps_config(root, "A100-SXM4-40GB"))
        layouts = load_config(MIG_LAYOUTS)
        try:
            assert d.mig.apply(layouts, "all-1g.5gb").result == "success"
            refused = MigManager(_RefusesResets(d.backend), d.store, EventLog(None))
            failed = refused.apply(layouts, "all-disabled")
            assert failed.result == "failed" and "in use" in failed.gpus[0].detail, failed
            (gpu,) = d.sampler.tick().gpus
            assert gpu.mig_mode is not None and gpu.mig_mode.current and not gpu.mig_devices
            asyncio.run(next(s for s in d.steps if s.name == "mig").run())
            (gpu,) = d.sampler.latest().gpus  # type: ignore[union-attr]
            assert gpu.mig_mode is not None and not gpu.mig_mode.current
            d.mps.reconcile(d.sampler.latest())  # the MPS step's pass
            assert [s.target.uuid for s in d.mps.status() if s.up] == [gpu.identity.uuid]
        finally:
            d.mps.stop()
            _close(d)


def test_colocation_sees_a_run_without_memory_at_its_devices_mps_default(root: Path) -> None:
    """The co-location loop's memory view of a run that sets no ``--memory``: the device's
    MPS default pinned memory limit (``gpuctl mps set --memory``), as its client gets it."""
    d = build(make_config(root))
    try:
        snap = d.sampler.tick()
        d.mps.reconcile(snap)
        uuid = d.mps.targets()[0].uuid
        d.mps.set_limits(uuid, memory_bytes=30 << 30)
        d.jobs.reserve(RunRequest(job="plain"))
        d.jobs.reserve(RunRequest(job="sized", memory_bytes=5 << 30))
        seen = {r.name: r.memory_bytes for r in d._colo_running()}
        assert seen == {"plain": 30 << 30, "sized": 5 << 30}
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_colocation_keeps_which_registration_of_a_job_it_learned(root: Path) -> None:
    """The co-location loop sees each running job's registration (the registry's
    ``created_at``) and colo.json keeps it: what a restart tells a job removed and added
    again under its name by, should gpud be killed before colo.json was written."""
    import json

    from gpud.daemon import COLO_NAME

    d = build(make_config(root))
    try:
        snap = d.sampler.tick()
        d.mps.reconcile(snap)
        d.jobs.reserve(RunRequest(job="sweep"))
        created = d.jobs.registry.registrations()["sweep"]
        assert [r.registered_at for r in d._colo_running()] == [created]
        d.colo.tick(snap)
        path = d.config.daemon.state_dir / COLO_NAME
        assert json.loads(path.read_text())["jobs"]["sweep"]["registered_at"] == created
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_a_stop_writes_what_colocation_holds_and_the_next_start_reads_it_back(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A service's SLO guard throttled the training beside it, in co-location ticks whose
    writes of colo.json were refused (the disk full for a moment: a directory where the
    file's temporary one goes); the disk answers again, and ``systemctl stop gpud`` comes
    before the next tick: the stop writes what co-location holds, and gpud started again
    on the state directory tells the training the duty it was told, rather than what the
    last write before the refusals held (full duty)."""
    config = make_config(root, **{"daemon.tick_s": 0.05, "colocate.tick_s": 3600.0})
    path = config.daemon.state_dir / COLO_NAME
    refusing = path.with_name(f".{path.name}.tmp")  # write_atomically's temporary file
    skew = [0.0]  # the loop's clock, moved on a second per tick below

    def clock() -> float:
        return time.monotonic() + skew[0]

    d = build(config, clock=clock)

    async def scenario() -> float:
        run = await _started(d)
        for _ in range(400):  # the first pass's tick, before any job runs
            if path.exists():
                break
            await asyncio.sleep(0.05)
        d.jobs.add(JobSpec(name="chat", kind=JobKind.INFERENCE, slo_p99_ms=100.0))
        d.jobs.add(JobSpec(name="train", kind=JobKind.TRAINING))
        d.jobs.reserve(RunRequest(job="chat"))
        d.jobs.reserve(RunRequest(job="train"))
        with d.colo._save_lock:  # a write the reservations began has put its temp file away
            refusing.mkdir()
        for _ in range(30):  # p99 near the SLO: the guard cuts the training's duty
            skew[0] += 1
            d.colo.report_latency("chat", [0.095] * 30)
            await asyncio.to_thread(d.colo.tick, d.sampler.latest())
            if d.colo.duty("train") < 1.0:
                break
        told = d.colo.duty("train")
        assert told < 1.0
        assert "train" not in json.loads(path.read_text())["jobs"]
        refusing.rmdir()
        d.request_stop()
        assert await asyncio.wait_for(run, timeout=d.worst_stop_s() + 5) == 0
        return told

    caplog.set_level(logging.WARNING)
    try:
        told = asyncio.run(scenario())
    finally:
        with contextlib.suppress(FileNotFoundError):
            refusing.rmdir()
    assert f"co-location state {path} not written" in caplog.text  # the ticks'
    assert "at the stop" not in caplog.text
    again = build(config)
    try:
        assert again.colo.duty("train") == told
    finally:
        _close(again)


def test_a_stop_whose_colocation_write_fails_says_so_and_stops(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """colo.json cannot be written at the stop (the disk full, as it was at the last tick):
    the log names the file and why, and the rest of the stop goes on (gpud exits 0)."""
    config = make_config(root, **{"daemon.tick_s": 0.05, "colocate.tick_s": 3600.0})
    path = config.daemon.state_dir / COLO_NAME
    refusing = path.with_name(f".{path.name}.tmp")
    d = build(config)

    async def scenario() -> None:
        run = await _started(d)
        d.jobs.add(JobSpec(name="chat", kind=JobKind.INFERENCE, slo_p99_ms=100.0))
        d.jobs.reserve(RunRequest(job="chat"))
        with d.colo._save_lock:  # a write the reservation began has put its temp file away
            refusing.mkdir()
        await asyncio.to_thread(d.colo.tick, d.sampler.latest())
        d.request_stop()
        assert await asyncio.wait_for(run, timeout=d.worst_stop_s() + 5) == 0

    caplog.set_level(logging.WARNING)
    try:
        asyncio.run(scenario())
    finally:
        refusing.rmdir()
    (line,) = [r.getMessage() for r in caplog.records if "at the stop (" in r.getMessage()]
    assert line.startswith(f"co-location state {path} not written at the stop (")
    assert "Is a directory" in line
    assert d.events.recent(1, "daemon.stop")


def test_a_run_that_ended_is_not_shown_placed_until_the_next_colocation_pass(
    root: Path,
) -> None:
    """``gpuctl jobs ls`` (COLO ON, SHARE, DUTY) and ``gpuctl colo show`` read the last
    co-location pass: a run released since is not on its GPU any more, though the next
    pass is seconds away."""
    from gpud.colo.api import ColoServicer

    d = build(make_config(root))
    try:
        snap = d.sampler.tick()
        d.mps.reconcile(snap)
        ended = d.jobs.reserve(RunRequest(job="ended"))
        d.jobs.reserve(RunRequest(job="runs"))
        d.colo.tick(snap)
        servicer = ColoServicer(d.colo, snapshots=d.sampler.latest)
        assert {p.job for p in servicer._show().placements} == {"ended", "runs"}
        d.jobs.release(ended.reservation.id)
        assert {p.job for p in servicer._show().placements} == {"runs"}
        assert {r.name for r in d.colo.show().running} == {"runs"}
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_the_build_reaches_the_status_the_metric_and_the_cluster_report(root: Path) -> None:
    """One build, computed at start, in everything that shows which code gpud runs."""
    d = build(make_config(root))
    try:
        assert d.build == current_build()  # by default, the code running
        assert d.node_info().build == d.build
    finally:
        _close(d)
    d = build(make_config(root), code_build="3f2a9c1d04ab")
    try:
        assert d.node_info().build == "3f2a9c1d04ab"
        assert d.cluster.agent.local_report().build == "3f2a9c1d04ab"
        registry = CollectorRegistry()
        registry.register(d.collector)
        labels = {"version": "0.1.0", "build": "3f2a9c1d04ab"}
        assert registry.get_sample_value("gpud_build_info", labels) == 1
    finally:
        _close(d)


def _close(d: Daemon) -> None:
    """What a daemon built but never run holds open."""
    d.sampler.close()
    d.store.close()
    d.backend.close()


def test_the_loop_binds_a_removed_socket_again(root: Path) -> None:
    """``rm -rf`` of the run directory while gpud runs: the next pass listens again."""
    d = build(make_config(root))
    path = d.config.socket_path
    (step,) = [s for s in d.steps if s.name == "socket"]

    async def scenario() -> None:
        await d.api.start()
        try:
            path.unlink()
            await step.run()
            assert path.is_socket()
        finally:
            await d.api.stop(0)

    try:
        asyncio.run(scenario())
    finally:
        d.store.close()
        d.backend.close()


def test_the_loop_saves_a_removed_wal_at_once_and_says_it_once(root: Path) -> None:
    """``rm state.db-wal`` while gpud runs: the next pass checkpoints what it held into
    ``state.db`` (a crash before any change is tried keeps it) and says so in one event."""
    d = build(make_config(root))
    (step,) = [s for s in d.steps if s.name == "state"]
    wal = d.store.path.with_name(d.store.path.name + "-wal")
    try:
        asyncio.run(step.run())
        assert d.events.recent(10, "daemon.state_files") == []
        wal.unlink()
        asyncio.run(step.run())
        asyncio.run(step.run())
        (event,) = d.events.recent(10, "daemon.state_files")
        assert event.message.startswith(f"write-ahead log {wal} of the state database was")
        assert event.message.endswith("kept in the database file; restart gpud")
        copy = root / "crashed.db"  # what a crash leaves: the database file alone
        copy.write_bytes(d.store.path.read_bytes())
        left = sqlite3.connect(copy)
        try:
            tables = {r[0] for r in left.execute("SELECT name FROM sqlite_master")}
        finally:
            left.close()
        assert "jobs" in tables
    finally:
        _close(d)


def test_a_stop_ends_the_event_watchers_streams_cleanly(root: Path) -> None:
    """``gpuctl events --follow`` when gpud stops: its stream ends (OK) at once, not
    cancelled at the end of the API's grace."""
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))

    async def scenario() -> None:
        run = await _started(d)
        async with grpc.aio.insecure_channel(f"unix:{d.config.socket_path}") as ch:
            stream = node_pb2_grpc.NodeStub(ch).WatchEvents(
                node_pb2.WatchEventsRequest(kind_prefix="daemon.", limit=1)
            )
            assert (await stream.read()).event.kind == "daemon.start"
            d.request_stop()
            assert await stream.read() == grpc.aio.EOF
            assert await stream.code() == grpc.StatusCode.OK
        # a loaded machine may take the stop up to its worst (its waits, its hooks' floors)
        assert await asyncio.wait_for(run, timeout=d.worst_stop_s() + 5) == 0

    asyncio.run(scenario())


def test_a_queued_job_waits_for_declared_sim_processes_until_their_host_processes_exit(
    root: Path,
) -> None:
    """``gpuctl sim workload start --pid`` of a real process holds its memory until that
    process exits, gpud running or not: a queued job that needs the memory waits for it."""
    from gpud.admission.service import QUEUED, STARTED

    config = make_config(root, **{"backend.simulate": "H100-SXM5-80GB:1"})
    holders = [subprocess.Popen(["sleep", "600"]) for _ in range(2)]
    try:
        d = build(config)
        try:
            assert d.sim is not None
            for holder in holders:  # jobs a and b, 16 GiB each
                d.sim.workloads.start(0, holder.pid, 16 << 30, 0.5)
            snap = d.sampler.tick()
            d.mps.reconcile(snap)
            d.jobs.tick(snap)
            entry = d.admission.enqueue(RunRequest(job="g", memory_bytes=70 << 30)).entry
            d.admission.tick()
            assert d.admission.view(entry.id).entry.state == QUEUED
        finally:
            d.sampler.close()
            d.store.close()
            d.backend.close()
        for holder in holders:  # killed while gpud is down
            holder.kill()
            holder.wait()
        d = build(config)
        try:
            assert d.sim is not None
            snap = d.sampler.tick()
            d.mps.reconcile(snap)
            d.jobs.tick(snap)
            assert d.sim.workloads.list() == []  # the driver freed their memory
            d.admission.tick()
            assert d.admission.view(entry.id).entry.state == STARTED
        finally:
            d.sampler.close()
            d.store.close()
            d.backend.close()
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


def _run_dir_removed(root: Path, then: Callable[[Daemon, Step], Awaitable[None]]) -> None:
    """A daemon holding its directories' locks, its API started and its run directory
    removed (``rm -rf``); ``then`` with it and its socket step."""
    cfg = make_config(root)
    for directory in (cfg.daemon.state_dir, cfg.daemon.run_dir):
        directory.mkdir()
    locks = lock_dirs(cfg)
    d = build(cfg, dir_locks=locks)
    (step,) = [s for s in d.steps if s.name == "socket"]

    async def scenario() -> None:
        await d.api.start()
        try:
            shutil.rmtree(cfg.daemon.run_dir)
            await then(d, step)
        finally:
            await d.api.stop(0)

    try:
        asyncio.run(scenario())
    finally:
        locks.close()
        _close(d)


def test_a_removed_run_directory_gets_its_lock_and_sim_state_back(root: Path) -> None:
    """``rm -rf`` of the run directory while gpud runs: the next pass makes ``gpud.lock``
    again and holds it, so that a second gpud started on the same run directory is refused
    as already running, and writes the simulated node's state again."""
    other = make_config(root, **{"daemon.state_dir": root / "other"})
    (root / "other").mkdir()

    async def then(d: Daemon, step: Step) -> None:
        await step.run()
        with pytest.raises(ConfigError, match="already running"):
            lock_dirs(other).close()
        assert d.config.socket_path.is_socket()
        assert (d.config.daemon.run_dir / "sim" / "node.json").is_file()

    _run_dir_removed(root, then)


def test_the_sim_state_is_written_again_when_the_socket_cannot_be_bound_again(
    root: Path,
) -> None:
    """The run directory removed and its lock taken again, but the socket's bind failing
    (its group gone meanwhile): the simulated node's state is written all the same."""

    async def then(d: Daemon, step: Step) -> None:
        d.api.socket_group = "gpud-no-such-group"
        with pytest.raises(ConfigError, match="does not exist"):
            await step.run()
        assert (d.config.daemon.run_dir / "sim" / "node.json").is_file()

    _run_dir_removed(root, then)


def test_a_stop_answers_a_running_mig_apply_and_refuses_new_changes(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``systemctl restart gpud`` during a ``gpuctl mig apply`` whose steps take seconds
    (``gpuctl sim fault slow-mig``): the stop waits for the apply and answers its caller with
    the result, instead of cutting the call off at the API's grace (gpuctl: outcome unknown);
    a change asked for meanwhile is refused, UNAVAILABLE "gpud is stopping"."""
    config = make_config(root, **{"backend.simulate": "H100-SXM5-80GB:1", "daemon.tick_s": 0.05})
    d = build(config)
    assert d.sim is not None
    source = mig_pb2.MigConfigSource(name="all-3g.40gb", text=MIG_LAYOUTS.read_text())

    async def scenario() -> tuple[mig_pb2.ApplyMigResponse, grpc.aio.AioRpcError]:
        run = asyncio.create_task(d.run())
        for _ in range(400):
            if d.events.recent(1, "daemon.start"):
                break
            await asyncio.sleep(0.05)
        d.sim.faults.slow_mig(0, 1.0)  # 5 steps: about 5 s, past the API's 2 s grace
        async with grpc.aio.insecure_channel(f"unix:{d.config.socket_path}") as ch:
            stub = mig_pb2_grpc.MigStub(ch)
            apply = asyncio.ensure_future(stub.ApplyMig(mig_pb2.ApplyMigRequest(config=source)))
            for _ in range(250):  # its steps begin
                if apply.done() or not await asyncio.to_thread(d.mig.wait_idle, 0.01):
                    break
                await asyncio.sleep(0.02)
            assert not apply.done(), await apply
            await asyncio.sleep(0.3)
            d.request_stop()
            await asyncio.sleep(0.3)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.ApplyMig(mig_pb2.ApplyMigRequest(config=source))
            answer = await apply
        assert await asyncio.wait_for(run, timeout=30) == 0
        return answer, refused.value

    caplog.set_level(logging.WARNING)
    answer, refused = asyncio.run(scenario())
    assert answer.result == "success", answer
    assert refused.code() == grpc.StatusCode.UNAVAILABLE
    assert (refused.details() or "").startswith("gpud is stopping: ApplyMig was not started")
    assert dict(refused.trailing_metadata() or ())["gpud-exit-code"] == "3"
    # answered within the calls' share of the budget: nothing was cut off or left running
    assert "still ran" not in caplog.text and "still running" not in caplog.text
    event = d.events.recent(kind_prefix="mig.apply")[-1]
    assert event.fields["result"] == "success" and event.fields["client_gone"] is False


async def _started(d: Daemon) -> asyncio.Task[int]:
    run = asyncio.create_task(d.run())
    for _ in range(400):
        if d.events.recent(1, "daemon.start"):
            return run
        await asyncio.sleep(0.05)
    raise AssertionError("gpud did not start")


def _stuck_pass_with_a_reserve_behind_it(
    d: Daemon, then: Callable[[Daemon], Awaitable[None]]
) -> list[object]:
    """Run ``d``; once its admission step blocks holding the placement lock (as in a driver
    call that hangs) with a ``Reserve`` call waiting for that lock, ask a stop and run
    ``then``; how the stop's wait for the calls ended: "cancelled", or whether they were
    drained. The pass and the call block longer than the stop's hang guard."""
    from gpud.v1 import jobs_pb2, jobs_pb2_grpc

    in_pass, release = threading.Event(), threading.Event()
    waits: list[object] = []
    drained = d.calls.drained

    async def recorded(timeout_s: float) -> bool:
        try:
            waits.append(await drained(timeout_s))
        except asyncio.CancelledError:
            waits.append("cancelled")
            raise
        return bool(waits[-1])

    d.calls.drained = recorded  # type: ignore[method-assign]

    def stuck_pass() -> None:
        with d.jobs.locked():
            in_pass.set()
            release.wait(60)

    async def scenario() -> None:
        run = await _started(d)
        d.admission.tick = stuck_pass  # type: ignore[method-assign]
        assert await asyncio.to_thread(in_pass.wait, 5)
        async with grpc.aio.insecure_channel(f"unix:{d.config.socket_path}") as ch:
            reserve = asyncio.ensure_future(
                jobs_pb2_grpc.JobsStub(ch).Reserve(jobs_pb2.ReserveRequest(job="a", gpu_count=1))
            )
            for _ in range(250):
                if d.calls.running:
                    break
                await asyncio.sleep(0.02)
            assert d.calls.running == 1
            d.request_stop()
            await then(d)
            try:
                assert await asyncio.wait_for(run, timeout=20) == 0
            finally:
                release.set()  # asyncio.run waits for its executor's threads
            with pytest.raises(grpc.aio.AioRpcError):
                await reserve  # cut off: gpuctl says the outcome is unknown

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert d.events.recent(1, "daemon.stop")
    return waits


async def _nothing(d: Daemon) -> None:
    return None


def test_a_stuck_loop_pass_ends_the_wait_for_the_calls_queued_behind_it(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pass stuck in the driver holding the placement lock, a reservation waiting for that
    lock: the stop gives the pass up after its share and the reservation with it, instead of
    waiting the calls' whole share (which would take the stop past TimeoutStopSec)."""
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))
    d.pass_stop_wait_s = 0.5
    d.call_stop_wait_s = 30.0
    d.stop_budget_s = 60.0
    # the calls' 30 s: ended with the pass's 0.5 s, not waited to their end
    assert _stuck_pass_with_a_reserve_behind_it(d, _nothing) == ["cancelled"]
    assert "the loop's admission step did not end within 0.5 s" in caplog.text
    assert "1 call(s) changing the node still ran" in caplog.text


async def _stop_again(d: Daemon) -> None:
    for _ in range(250):  # the stop is waiting for the pass and the calls
        if d.calls.closed():
            break
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    d.request_stop()


def test_a_second_stop_ends_the_wait_for_a_stuck_pass_and_its_calls_at_once(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``systemctl kill -s INT gpud`` (or Ctrl-C) again while the stop waits: no more waiting,
    and the log says why the pass was left, not that it had its whole share."""
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))
    d.pass_stop_wait_s = 30.0
    d.call_stop_wait_s = 30.0
    d.stop_budget_s = 60.0
    # ended by the stop asked again (the pass given up ends the calls' wait, or the cut
    # does), not waited its 30 s: past the stop's hang guard
    assert _stuck_pass_with_a_reserve_behind_it(d, _stop_again) in (["cancelled"], [False])
    assert "the loop's admission step still ran at a second stop" in caplog.text
    assert "did not end within" not in caplog.text
    assert "1 call(s) changing the node still ran" in caplog.text


def test_a_second_stop_ends_the_wait_for_a_running_mig_apply(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A MIG apply whose steps hang in the driver: the stop waits for it its share of the
    budget, but not past a second SIGTERM or SIGINT; its plan is kept for the next start."""
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))
    d.mig_stop_wait_s = 30.0
    d.stop_budget_s = 60.0
    applying, release, waiting = threading.Event(), threading.Event(), threading.Event()
    waits: list[bool] = []
    wait_idle = d.mig.wait_idle

    def stop_waiting(timeout_s: float) -> bool:
        waiting.set()
        waits.append(wait_idle(timeout_s))
        return waits[-1]

    d.mig.wait_idle = stop_waiting  # type: ignore[method-assign]

    def apply() -> None:  # a MIG apply stuck in a driver call
        with d.mig._lock:
            applying.set()
            release.wait(60)

    async def scenario() -> None:
        run = await _started(d)
        threading.Thread(target=apply, daemon=True).start()
        assert await asyncio.to_thread(applying.wait, 5)
        d.request_stop()
        assert await asyncio.to_thread(waiting.wait, 20)  # the stop waits for the apply
        d.request_stop()
        assert await asyncio.wait_for(run, timeout=20) == 0  # a hang guard, below the 30 s
        assert waits == []  # the stop's wait, left: not waited to its end

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert d.events.recent(1, "daemon.stop")
    assert "a MIG apply is still running" in caplog.text


def test_a_second_stop_skips_the_shutdown_hooks_and_the_closes_waits_and_keeps_the_state(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``systemctl kill -s INT gpud`` again while a shutdown hook hangs (an ``nft`` that does
    not answer), with the store's lock held by a pass left running and ``nvmlShutdown``
    hung: the stop ends at once instead of a floor per hook and two unbounded closes, and
    a job added just before is there at the next start. The store's close waits for its
    lock half the short wait it is left, so that its own warning says why it was left."""
    config = make_config(root, **{"daemon.tick_s": 0.05})
    d = build(config)
    # each hook's share and each close's wait, uncut, far past the stop's hang guard
    d.stop_budget_s = 60.0
    d.close_wait_s = 600.0
    d.pass_stop_wait_s = 0.2  # the loop's pass waits for the store's lock too
    release = threading.Event()
    hooked: list[str] = []

    def hung() -> None:
        hooked.append("ran")
        release.wait(60)

    for _ in range(3):  # run first (reverse order), then the daemon's own four
        d.on_shutdown(hung)

    def hung_driver() -> None:  # nvmlShutdown on a GPU that stopped answering
        hooked.append("nvmlShutdown")
        release.wait(60)

    d.backend.close = hung_driver  # type: ignore[method-assign]
    in_transaction = threading.Event()

    def pass_left_running() -> None:  # its transaction holds the store's lock
        with d.store.transaction():
            in_transaction.set()
            release.wait(60)

    async def scenario() -> None:
        run = await _started(d)
        d.jobs.add(JobSpec(name="kept", kind=JobKind.TRAINING))
        threading.Thread(target=pass_left_running, daemon=True).start()
        assert await asyncio.to_thread(in_transaction.wait, 5)
        d.request_stop()
        while not hooked:  # the first hook hangs
            await asyncio.sleep(0.01)
        d.request_stop()
        await _ended(run, release, timeout=30)

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert hooked == ["ran", "nvmlShutdown"]
    assert "skipped at a second stop" in caplog.text
    assert "backend.close was left at a second stop" in caplog.text
    assert "a transaction still ran at the stop; left to the exit" in caplog.text
    assert "store.close was left" not in caplog.text
    again = build(config)
    try:
        assert again.jobs.registry.names() == ["kept"]
    finally:
        _close(again)


def test_a_store_close_held_up_by_a_pass_left_running_says_why_in_its_own_words(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pass left running holds the store's lock at the stop: the store's own warning says
    a transaction still ran, within the close's wait, not the stop's generic "did not end"
    over it; the driver is closed after it."""
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))
    d.pass_stop_wait_s = 0.2
    release = threading.Event()
    in_transaction = threading.Event()
    closed: list[str] = []
    driver_close = d.backend.close

    def close_driver() -> None:
        closed.append("nvmlShutdown")
        driver_close()

    d.backend.close = close_driver  # type: ignore[method-assign]

    def pass_left_running() -> None:  # its transaction holds the store's lock
        with d.store.transaction():
            in_transaction.set()
            release.wait(60)

    async def scenario() -> None:
        run = await _started(d)
        threading.Thread(target=pass_left_running, daemon=True).start()
        assert await asyncio.to_thread(in_transaction.wait, 5)
        d.request_stop()
        await _ended(run, release, timeout=30)

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert "a transaction still ran at the stop; left to the exit" in caplog.text
    assert "store.close did not end within" not in caplog.text
    assert closed == ["nvmlShutdown"]


@pytest.mark.parametrize("step", ["backend.close", "events.flush"])
def test_a_second_stop_during_a_close_leaves_it_its_short_wait(
    root: Path, caplog: pytest.LogCaptureFixture, step: str
) -> None:
    """``nvmlShutdown`` hangs (or the event log's flush, its disk hung) and a second SIGTERM
    comes while the stop waits for it: the wait ends 0.1 s later (STOP_CUT_CLOSE_S), not at
    the end of the step's whole time."""
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))
    d.close_wait_s = 600.0  # the step's whole time: far past the stop's hang guard
    release = threading.Event()
    closing = threading.Event()

    def hung(*_: object) -> bool:  # nvmlShutdown on a GPU that stopped answering, a disk
        closing.set()
        release.wait(60)
        return False

    if step == "backend.close":
        d.backend.close = hung  # type: ignore[method-assign,assignment]
    else:
        d.events.flush = hung  # type: ignore[method-assign,assignment]

    async def scenario() -> None:
        run = await _started(d)
        d.request_stop()
        assert await asyncio.to_thread(closing.wait, 20)
        d.request_stop()
        await _ended(run, release, timeout=30)

    try:
        asyncio.run(scenario())
    finally:
        release.set()
    assert f"{step} was left at a second stop (SIGTERM/SIGINT)" in caplog.text


def test_the_worst_stop_ends_before_the_units_stop_timeout(root: Path) -> None:
    """Every wait of a stop takes what is left of its budget, and each shutdown hook at least
    its floor; then the /metrics listener stops (serve_forever's poll), the store and the
    driver close, and the exit waits its grace for worker threads: together they end before
    systemd's SIGKILL at the shipped unit's TimeoutStopSec, with a margin for the rest (the
    signal's delivery, the loop's turns between the waits, the interpreter's exit)."""
    unit = Path(__file__).parents[2] / "systemd" / "gpud.service"
    (line,) = [s for s in unit.read_text().splitlines() if s.startswith("TimeoutStopSec=")]
    timeout_s = float(line.removeprefix("TimeoutStopSec=").removesuffix("s"))
    d = build(make_config(root))
    try:
        worst = d.worst_stop_s()
        assert worst == (
            d.stop_budget_s
            + 4 * STOP_HOOK_FLOOR_S
            + METRICS_POLL_S
            + STOP_CLOSE_WAIT_S / 2
            + 2 * STOP_CLOSE_WAIT_S
            + inspect.signature(exit_leaving_stuck_threads).parameters["grace_s"].default
        )
        assert worst <= timeout_s - 2, (worst, timeout_s)
        assert max(d.call_stop_wait_s, d.pass_stop_wait_s, d.mig_stop_wait_s) <= d.stop_budget_s
    finally:
        _close(d)


def test_a_gpu_that_answers_again_takes_jobs_after_one_sampler_tick(root: Path) -> None:
    """GPU 0 was lost before gpud started (no UUID known). Once the sampler's next tick
    reads it, with no loop pass since: a job asking two GPUs gets both by their UUIDs (not
    ""), one pinned to its UUID is placed, and ``gpuctl jobs`` marks nothing unhealthy; a
    GPU lost since is refused at once, likewise."""
    d = build(make_config(root, **{"backend.simulate": "H100-SXM5-80GB:2"}))
    assert d.sim is not None
    try:
        d.sim.faults.lose(0)
        snap = d.sampler.tick()
        d.mps.reconcile(snap)  # a loop pass
        d.jobs.tick(snap)
        assert set(d.jobs.unhealthy_devices()) == {(0, None)}
        with pytest.raises(ResourceExhausted):
            d.jobs.reserve(RunRequest(job="both", gpu_count=2))
        d.sim.faults.clear(0)
        uuids = tuple(g.identity.uuid for g in d.sampler.tick().gpus)
        assert all(uuids)
        assert d.jobs.unhealthy() == {} and d.jobs.unhealthy_devices() == {}
        both = d.jobs.reserve(RunRequest(job="both", gpu_count=2))
        assert sorted(both.reservation.devices) == sorted(uuids)
        d.jobs.release(both.reservation.id)
        pinned = d.jobs.reserve(RunRequest(job="pinned", devices=(uuids[0],)))
        assert pinned.reservation.devices == (uuids[0],)
        d.jobs.release(pinned.reservation.id)
        d.sim.faults.lose(1)
        d.sampler.tick()
        assert set(d.jobs.unhealthy_devices()) == {(1, None)}
        with pytest.raises(FailedPrecondition, match="on GPU 1, which is unhealthy"):
            d.jobs.reserve(RunRequest(job="pinned", devices=(uuids[1],)))
    finally:
        _close(d)


def test_a_failing_part_of_the_health_listener_skips_neither_the_other_nor_a_tick(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The sampler's listener: the MPS devices' update failing still lets the GPUs' health
    be taken from the tick (a GPU lost is refused at once); its failure is logged once per
    WARNING_INTERVAL_S, not at every tick, and its working again is said."""
    now = [1000.0]
    d = build(make_config(root, **{"backend.simulate": "H100-SXM5-80GB:2"}), clock=lambda: now[0])
    assert d.sim is not None

    def broken(snap: object) -> None:
        raise RuntimeError("observe broke")

    working = d.mps.observe_snapshot
    try:
        d.mps.observe_snapshot = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.INFO, logger="gpud"):
            d.sim.faults.lose(1)
            for _ in range(3):
                d.sampler.tick()
            assert set(d.jobs.unhealthy()) == {1}
            said = [r.getMessage() for r in caplog.records if "observe broke" in r.getMessage()]
            assert said == [
                "the sampler's MPS devices update failed (1 failures so far): observe broke"
            ]
            now[0] += d.WARNING_INTERVAL_S
            d.sampler.tick()
            said = [r.getMessage() for r in caplog.records if "observe broke" in r.getMessage()]
            assert len(said) == 2 and said[1].startswith(
                "the sampler's MPS devices update failed (4"
            )
            d.mps.observe_snapshot = working  # type: ignore[method-assign]
            d.sampler.tick()
        assert any(
            r.getMessage().startswith(
                "the sampler's MPS devices update works again, after 4 failed ticks"
            )
            for r in caplog.records
        )
    finally:
        _close(d)


def _unit_watchdog_s() -> float:
    unit = Path(__file__).parents[2] / "systemd" / "gpud.service"
    (line,) = [s for s in unit.read_text().splitlines() if s.startswith("WatchdogSec=")]
    return float(line.removeprefix("WatchdogSec=").removesuffix("s"))


class Feeds(Notifier):
    """systemd's watchdog as gpud sees it (``WATCHDOG_USEC``), each ``WATCHDOG=1`` noted
    with the daemon's clock, and each ``READY=1``'s status line (``systemctl status``)."""

    def __init__(self, watchdog_s: float, clock: Callable[[], float]) -> None:
        super().__init__(None, round(watchdog_s * 1_000_000))
        self.fed: list[float] = []
        self.ready_statuses: list[str] = []
        self._now = clock

    def watchdog(self) -> bool:
        self.fed.append(self._now())
        return True

    def ready(self, status: str = "") -> bool:
        self.ready_statuses.append(status)
        return True


def test_the_worst_watchdog_gap_ends_before_the_units_watchdog_sec(root: Path) -> None:
    """With a tick past half WatchdogSec (the interval is half WatchdogSec then), hung
    ``nft``/``dcb`` and MPS control daemons, a GPU that stopped answering and a state
    database another process holds: the interval, then the longest step that returns (the
    traffic or MPS step's wait for its task, a sample out of turn behind a tick and every
    refused write of a pass) stay below the shipped unit's WatchdogSec, with a margin for
    the loop's turns and the datagram's way to systemd. The waits for the traffic tick and
    the MPS reconcile no longer grow with the interval past a quarter of it."""
    watchdog_s = _unit_watchdog_s()
    now = [0.0]
    feeds = Feeds(watchdog_s, lambda: now[0])
    d = build(make_config(root, **{"daemon.tick_s": 60.0}), notifier=feeds)
    try:
        assert d.loop_interval_s() == watchdog_s / 2
        assert d.overrun_wait_s(TRAFFIC_WAIT_S) == d.overrun_wait_s(MPS_WAIT_S) == watchdog_s / 4
        gap = d.worst_watchdog_gap_s()
        assert gap == watchdog_s / 2 + max(
            watchdog_s / 4,
            2 * d.sampler.tick_bound_s() + d.store.worst_refusals_s(len(d.steps)),
        )
        assert gap is not None and gap <= watchdog_s - 2, (gap, watchdog_s)
    finally:
        _close(d)
    unwatched = build(make_config(root, **{"daemon.tick_s": 60.0}))
    try:
        assert unwatched.worst_watchdog_gap_s() is None
        assert unwatched.overrun_wait_s(TRAFFIC_WAIT_S) == 60.0  # the pass takes its result
    finally:
        _close(unwatched)


def test_a_pass_held_up_by_hung_helpers_feeds_the_watchdog_between_its_steps(
    root: Path,
) -> None:
    """A pass an interval after the last WATCHDOG=1 whose MPS step waits for hung control
    daemons, whose writing steps meet another process's lock on the state database and
    whose traffic step waits for a hung ``nft``: each step that returns is the loop moving,
    and once a quarter of WatchdogSec passed since the last feed, its end feeds the
    watchdog; no two feeds are further apart than the worst gap, below WatchdogSec."""
    watchdog_s = _unit_watchdog_s()
    now = [0.0]
    feeds = Feeds(watchdog_s, lambda: now[0])
    d = build(make_config(root, **{"daemon.tick_s": 60.0}), notifier=feeds, clock=lambda: now[0])

    def taking(seconds: float) -> Callable[[], Awaitable[None]]:
        async def step() -> None:
            now[0] += seconds

        return step

    # the hung helpers' own timeouts: an MPS control daemon's query, nft's
    mps_s, traffic_s = 10.0, 10.0
    first_refusal_s, later_refusal_s = 5.0, 0.5  # the store's write_wait_s, in_use_wait_s
    try:
        d.steps = []
        d.add_step("mps", taking(mps_s))
        d.add_step("jobs", taking(first_refusal_s))
        d.add_step("admission", taking(later_refusal_s))
        d.add_step("traffic", taking(traffic_s))
        interval = watchdog_s / 2
        now[0] = interval  # the last feed (at 0: the daemon's start) an interval ago
        asyncio.run(d.run_steps())
        assert feeds.fed == [
            interval + mps_s,
            interval + mps_s + first_refusal_s + later_refusal_s + traffic_s,
        ]
        gaps = [b - a for a, b in zip([0.0, *feeds.fed], feeds.fed, strict=False)]
        assert max(gaps) <= watchdog_s - 2, gaps
    finally:
        _close(d)


def test_a_step_that_never_returns_feeds_the_watchdog_no_more(root: Path) -> None:
    """A step hung for good (a driver call that never comes back) is no loop that moves:
    the steps before it fed the watchdog, and nothing does while it hangs, so that systemd
    kills gpud at WatchdogSec and starts it again."""
    watchdog_s = _unit_watchdog_s()
    now = [0.0]
    feeds = Feeds(watchdog_s, lambda: now[0])
    d = build(make_config(root, **{"daemon.tick_s": 60.0}), notifier=feeds, clock=lambda: now[0])
    entered = asyncio.Event()

    async def slow() -> None:
        now[0] += watchdog_s / 4

    async def hung() -> None:
        entered.set()
        now[0] += watchdog_s
        await asyncio.Future()  # never done

    async def scenario() -> None:
        steps = asyncio.ensure_future(d.run_steps())
        await entered.wait()
        for _ in range(20):  # the loop's turns: a feed, if any, would be sent meanwhile
            await asyncio.sleep(0)
        assert not steps.done()
        steps.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await steps

    try:
        d.steps = []
        d.add_step("mig", slow)
        d.add_step("hung", hung)
        d.add_step("traffic", slow)
        asyncio.run(scenario())
        assert feeds.fed == [watchdog_s / 4]
    finally:
        _close(d)


def test_a_slow_reload_before_a_pass_feeds_the_watchdog_before_the_steps(root: Path) -> None:
    """A SIGHUP reload whose read of the file takes a while (a slow disk, a cluster file on
    a hung mount) runs between the interval and the pass's first step: its end feeds the
    watchdog once a quarter of WatchdogSec passed, so that the reload's time does not add to
    the pass's and no two feeds are further apart than the worst gap."""
    watchdog_s = _unit_watchdog_s()
    now = [0.0]
    feeds = Feeds(watchdog_s, lambda: now[0])
    config = make_config(root, **{"daemon.tick_s": 60.0})
    reload_s, mps_s = watchdog_s / 3, watchdog_s / 3

    def slow_read() -> Layers:
        now[0] += reload_s
        return Layers(config, config)

    d = build(config, notifier=feeds, clock=lambda: now[0], reload_config=slow_read)

    async def hung_mps() -> None:  # hung control daemons, waited for their query timeout
        now[0] += mps_s
        d._stop.set()

    try:
        d.steps = []
        d.add_step("mps", hung_mps)
        d.request_reload()
        asyncio.run(d._loop())
        # the reload's end, the MPS step's end, the pass's end
        assert feeds.fed == [reload_s, reload_s + mps_s, reload_s + mps_s]
        gap = d.worst_watchdog_gap_s()
        assert gap is not None and max(reload_s, mps_s) <= gap <= watchdog_s - 2
    finally:
        _close(d)


def test_a_telemetry_wait_that_pushes_the_watchdog_gap_past_watchdog_sec_is_said_once_at_start(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A slower sample (telemetry.interval_s 2 s: a hung GPU is waited for 1 s, four times
    in a pass at worst) behind a tick past half WatchdogSec leaves less than 2 s of the
    shipped unit's WatchdogSec: taken (a node may run well with it), but said once at start,
    naming the keys, the gap, WatchdogSec and the WatchdogSec that fits; as --check-config,
    run by systemd, says it."""
    watchdog_s = _unit_watchdog_s()
    config = make_config(root, **{"daemon.tick_s": 60.0, "telemetry.interval_s": 2.0})
    d = build(config, notifier=Feeds(watchdog_s, time.monotonic))

    async def start_and_stop() -> None:
        run = asyncio.create_task(d.run())
        while d.events.recent(1, "daemon.start") == []:
            await asyncio.sleep(0.05)
        d.request_stop()
        assert await asyncio.wait_for(run, timeout=20) == 0

    try:
        gap = d.worst_watchdog_gap_s()
        assert gap is not None and gap > watchdog_s - 2
        warning = d.watchdog_warning()
        assert warning is not None
        for said in (
            f"{gap:.1f} s",
            f"WatchdogSec={watchdog_s:g}s",
            f"WatchdogSec={math.ceil(gap + 2)}s",
            "telemetry.interval_s (2 s)",
            "telemetry.call_timeout_s (5 s)",
            "daemon.tick_s (60 s)",
        ):
            assert said in warning, (said, warning)
        assert config_watchdog_warning(config, watchdog_s) == warning
        assert config_watchdog_warning(config, None) is None
        with caplog.at_level(logging.WARNING, logger="gpud.daemon"):
            asyncio.run(start_and_stop())
        assert [r.getMessage() for r in caplog.records].count(warning) == 1
    finally:
        _close(d)
    fits = build(
        make_config(root, **{"daemon.tick_s": 60.0}), notifier=Feeds(watchdog_s, time.monotonic)
    )
    try:
        assert fits.watchdog_warning() is None
        assert config_watchdog_warning(fits.config, watchdog_s) is None
    finally:
        _close(fits)
    unwatched = build(config)
    try:
        assert unwatched.watchdog_warning() is None
    finally:
        _close(unwatched)


def test_a_reload_that_pushes_the_watchdog_gap_past_watchdog_sec_says_so(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A SIGHUP reload that raises daemon.tick_s past half WatchdogSec (with a slower
    sample) is taken, as at start, but says what start says: in the log, in the
    ``config.reload`` event and in systemd's status line; a reload back to a config that
    fits says nothing of it."""
    watchdog_s = _unit_watchdog_s()
    fits = make_config(root)
    late = make_config(root, **{"daemon.tick_s": 60.0, "telemetry.interval_s": 2.0})
    feeds = Feeds(watchdog_s, time.monotonic)
    d = build(fits, reload_to=[late, fits], notifier=feeds)
    try:
        assert d.watchdog_warning() is None
        with caplog.at_level(logging.WARNING, logger="gpud.daemon"):
            d.reload()
        assert d.config.daemon.tick_s == 60.0
        warning = d.watchdog_warning()
        assert warning is not None and "daemon.tick_s (60 s)" in warning
        assert any(warning in r.getMessage() for r in caplog.records)
        assert warning in d.events.recent(1, "config.reload")[0].message
        assert warning in feeds.ready_statuses[-1]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="gpud.daemon"):
            d.reload()
        assert d.watchdog_warning() is None
        assert "WatchdogSec" not in d.events.recent(1, "config.reload")[0].message
        assert "WatchdogSec" not in feeds.ready_statuses[-1]
        assert caplog.records == []
    finally:
        _close(d)


def test_the_status_call_carries_the_watchdog_gap_warning_while_the_config_makes_one(
    root: Path,
) -> None:
    """``gpuctl status`` is the operator's first look: the status call says what start and
    a reload log of a gap past ``WatchdogSec``, for as long as the running config makes
    it, and nothing once a reload fits it again."""
    watchdog_s = _unit_watchdog_s()
    fits = make_config(root)
    late = make_config(root, **{"daemon.tick_s": 60.0, "telemetry.interval_s": 2.0})
    d = build(fits, reload_to=[late, fits], notifier=Feeds(watchdog_s, time.monotonic))

    def status() -> node_pb2.GetStatusResponse:
        return asyncio.run(d.node_servicer.GetStatus(node_pb2.GetStatusRequest(), None))  # type: ignore[arg-type]

    try:
        assert status().watchdog_warning == ""
        d.reload()
        warning = d.watchdog_warning()
        assert warning is not None and "daemon.tick_s (60 s)" in warning
        assert status().watchdog_warning == warning
        d.reload()
        assert status().watchdog_warning == ""
    finally:
        _close(d)


def test_a_mig_apply_s_busy_check_while_another_process_holds_the_state_lock_reads_the_gpus(
    root: Path,
) -> None:
    """A sqlite3 shell holds the state database's write lock: the apply's busy check still
    finds the job's reservation on an instance it would destroy (a snapshot read of what is
    committed), and the GPU is not taken for one that does not answer while the check
    waits on the database."""
    config = make_config(
        root,
        **{"backend.simulate": "H100-SXM5-80GB:1", "telemetry.call_timeout_s": 0.5},
    )
    d = build(config)
    layouts = load_config(MIG_LAYOUTS)
    try:
        assert d.mig.apply(layouts, "all-1g.10gb").result == "success"
        d._devices_changed()
        (device,) = d.jobs.reserve(RunRequest("train", mig_profile="1g.10gb")).reservation.devices
        with held_write_lock(d.store.path):
            preview = d.mig.apply(layouts, "all-3g.40gb", dry_run=True)
        (gpu,) = preview.gpus
        assert gpu.status == "busy", gpu
        assert "reserved by job train" in gpu.detail and "not answering" not in gpu.detail
        assert device in {m.uuid for m in d.backend.mig_devices(0)}
    finally:
        _close(d)


def test_placement_reopens_after_a_mig_apply_on_the_instances_the_driver_has_now(
    root: Path,
) -> None:
    """An apply replaces 1g.10gb instances with 3g.40gb ones: the first run reserved once it
    returns is placed on an instance the driver has (not on one just destroyed), and one
    asking for the destroyed profile is refused rather than handed a device gone."""
    d = build(make_config(root, **{"backend.simulate": "H100-SXM5-80GB:1"}))
    layouts = load_config(MIG_LAYOUTS)
    try:
        assert d.mig.apply(layouts, "all-1g.10gb").result == "success"
        d._devices_changed()
        assert d.mig.apply(layouts, "all-3g.40gb").result == "success"
        there = {m.uuid for m in d.backend.mig_devices(0)}
        with pytest.raises(GpudError) as refused:
            d.jobs.reserve(RunRequest("late", mig_profile="1g.10gb"))
        placed = d.jobs.reserve(RunRequest("next", mig_profile="3g.40gb")).reservation
        assert set(placed.devices) <= there, (placed.devices, there)
        assert "1g.10gb" in str(refused.value)
    finally:
        d.admission.passes.close(10.0)  # the pass the hold's end asked for
        _close(d)


def test_a_run_that_ended_before_colocation_read_it_leaves_its_gpu_to_the_next(
    root: Path,
) -> None:
    """A `gpuctl run` whose command fails at once (not found) reserves the GPU advice gave
    it and releases it before the co-location loop reads the reservations: the next run of
    the job is told the GPU is free, not held waiting beside the one that ended."""
    d = build(make_config(root))
    try:
        snap = d.sampler.tick()
        d.mps.reconcile(snap)
        first = d.colo.advise("sweep", reserving=True, snapshot=snap)
        assert first.gpu == 0, first.reason
        launch = d.jobs.reserve(RunRequest(job="sweep", advised_devices=(first.device,)))
        d.jobs.release(launch.reservation.id)
        again = d.colo.advise("sweep", reserving=True, snapshot=snap)
        assert (again.gpu, again.reason) == (0, first.reason)
    finally:
        d.sampler.close()
        d.store.close()
        d.backend.close()


def test_a_changing_call_stuck_in_its_worker_step_is_cut_at_the_stop_before_the_store_closes(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An XID injected whose simulated driver call hangs past the calls' share of the stop:
    the stop cuts the call ("cut at the stop", naming its GPU) before the store closes, and
    what follows its worker step (its ``sim.fault.xid`` event) never runs, even once the
    driver call returns."""
    d = build(make_config(root, **{"daemon.tick_s": 0.05}))
    assert d.sim is not None
    d.call_stop_wait_s = 0.3
    started, go_on, step_done = (threading.Event() for _ in range(3))

    def stuck_xid(gpu: int, code: int) -> None:
        started.set()
        go_on.wait(60)
        step_done.set()

    d.sim.faults.xid = stuck_xid  # type: ignore[method-assign]
    at_close: list[bool] = []
    store_close = d.store.close

    def close_store(wait_s: float | None = None) -> None:
        at_close.append("InjectFault: cut at the stop (gpu=0)" in caplog.text)
        store_close(wait_s=wait_s)

    d.store.close = close_store  # type: ignore[method-assign,assignment]

    async def scenario() -> int:
        run = await _started(d)
        async with grpc.aio.insecure_channel(f"unix:{d.config.socket_path}") as ch:
            call = asyncio.ensure_future(
                node_pb2_grpc.NodeStub(ch).InjectFault(
                    node_pb2.InjectFaultRequest(gpu=0, kind=node_pb2.FAULT_KIND_XID, xid=79)
                )
            )
            assert await asyncio.to_thread(started.wait, 30)
            d.request_stop()
            code = await asyncio.wait_for(run, timeout=20)  # a hang guard
            with pytest.raises(grpc.aio.AioRpcError):
                await call
        return code

    caplog.set_level(logging.WARNING)
    try:
        assert serve_until_stopped(scenario()) == 0
    finally:
        go_on.set()
    assert step_done.wait(30)
    assert at_close == [True]
    assert not d.events.recent(kind_prefix="sim.fault")


def _unstamped_database(state: Path, *statements: str) -> None:
    """An earlier gpud's database (tables, no ``application_id``)."""
    state.mkdir(parents=True)
    with contextlib.closing(sqlite3.connect(state / DB_NAME)) as conn:
        for statement in statements:
            conn.execute(statement)
        conn.commit()


def _application_id(state: Path) -> int:
    with contextlib.closing(sqlite3.connect(state / DB_NAME)) as conn:
        return int(conn.execute("PRAGMA application_id").fetchone()[0])


def test_an_earlier_gpud_s_database_is_stamped_gpud_s_by_the_start(root: Path) -> None:
    config = make_config(root)
    _unstamped_database(config.daemon.state_dir, *SEEN_SCHEMA)
    d = build(config)
    _close(d)
    assert _application_id(config.daemon.state_dir) == APPLICATION_ID


def test_a_traffic_table_of_another_layout_is_refused_and_never_stamped_with_traffic_off(
    root: Path,
) -> None:
    """With traffic off, net_shaped and net_original were never checked, yet the start
    stamped the file gpud's as if every table had been found as declared."""
    config = make_config(root, **{"traffic.enabled": False})
    state = config.daemon.state_dir
    _unstamped_database(state, *SEEN_SCHEMA, "CREATE TABLE net_original (iface TEXT)")
    with pytest.raises(StateDamaged, match="table net_original has no column handle, kind"):
        build(config)
    assert _application_id(state) == 0
