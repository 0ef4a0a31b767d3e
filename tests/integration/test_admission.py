"""The admission queue end to end: a real gpud on a simulated node, real ``gpuctl run``s."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.integration.conftest import BIN, RunningDaemon, start_daemon, stop_daemon

pytestmark = pytest.mark.integration

WHOLE = ("--gpus", "1", "--memory", "60GiB")


def wait_for(check: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError("condition not met in time")


def queue(daemon: RunningDaemon) -> list[dict[str, object]]:
    entries: list[dict[str, object]] = json.loads(daemon.gpuctl("queue", "--json").stdout).get(
        "entries", []
    )
    return entries


def test_second_job_waits_with_a_quote_and_survives_a_restart(tmp_path: Path) -> None:
    root = tmp_path / "g"
    daemon = start_daemon(root, "--simulate", "H100-SXM5-80GB:1")
    gpuctl = (str(BIN / "gpuctl"), "--socket", str(daemon.socket))
    go = tmp_path / "go"
    ran = tmp_path / "b-ran"
    first = second = None
    try:
        # A little history, so that the queue can quote a wait.
        for i in range(3):
            daemon.gpuctl("run", "--job", f"warm{i}", *WHOLE, "--", "sleep", "0.3")
        wait_cmd = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.1)"
        first = subprocess.Popen(
            [*gpuctl, "run", "--job", "a", *WHOLE, "--", sys.executable, "-c", wait_cmd]
        )
        wait_for(lambda: "GPU-" in daemon.gpuctl("jobs", "ls", "a", check=False).stdout)
        refused = daemon.gpuctl("run", "--job", "c", *WHOLE, "--no-wait", "--", "true", check=False)
        assert refused.returncode == 7, refused.stderr
        with (tmp_path / "b.err").open("w") as second_log:
            second = subprocess.Popen(
                [*gpuctl, "run", "--job", "b", *WHOLE, "--", "touch", str(ran)], stderr=second_log
            )
        wait_for(lambda: [e["job"] for e in queue(daemon)] == ["b"])
        # it says why it queued: the numbers of the device it waits for
        wait_for(lambda: "cannot start now: job 'b' asks 60GiB" in (tmp_path / "b.err").read_text())
        (entry,) = queue(daemon)
        assert entry["position"] == 1
        # a quote, or, once a has run past the 0.3 s its history says, a named overdue
        overdue = [r["job"] for r in entry.get("overdue", [])]  # type: ignore[attr-defined]
        quoted = (entry.get("quote_seconds") or 0) > 0  # type: ignore[operator]
        assert quoted or overdue == ["a"], entry
        explained = json.loads(daemon.gpuctl("queue", "--explain", "--json").stdout)
        (model,) = [c for c in explained["classes"] if c["request"] == "1 GPU 60GiB"]
        assert model["k_eff"] == 1 and model["binding"] in ("memory", "gpus")
        assert "gpud_admission_queue_length" in daemon.metrics()

        # gpud restarts while b waits: the queue and a's reservation survive it.
        stop_daemon(daemon)
        daemon = start_daemon(root, "--simulate", "H100-SXM5-80GB:1")
        assert [(e["id"], e["job"]) for e in queue(daemon)] == [(entry["id"], "b")]
        assert not ran.exists()
        assert second.poll() is None

        go.touch()  # a ends and releases its GPU: b starts
        assert first.wait(timeout=30) == 0
        assert second.wait(timeout=30) == 0
        assert ran.exists()
        assert queue(daemon) == []
        history = json.loads(daemon.gpuctl("jobs", "history", "--json").stdout)["records"]
        runs = [r for r in history if r["job"] == "b"]
        assert len(runs) == 1  # started once, across the restart
        assert runs[0]["started_unix_seconds"] > runs[0]["queued_unix_seconds"]
        assert "quote_seconds" in runs[0]
        waited = (tmp_path / "b.err").read_text()
        # told when it queued, which may be before a ran past its estimate and the listing
        # above after: the quote it was given (if any) is the one measured below
        quoted = "expected wait" in waited
        told = "expected wait" if quoted else "no wait can be quoted: what holds its devices"
        assert "position 1" in waited and told in waited, waited
        # The metrics after a queued run: wait histogram, quote error, Little's law.
        daemon.gpuctl("status")  # one more tick after b started
        time.sleep(1.5)
        text = daemon.metrics()
        assert 'gpud_admission_queue_length{feasibility="quotable"} 0.0' in text
        # counted as runs start, since this gpud started: b alone (a counter starts again
        # with gpud; the warm-ups and a ran under the gpud before the restart)
        assert "gpud_admission_wait_seconds_count 1.0" in text
        # b's quote is measured against its wait, where it had one
        assert f"gpud_admission_quote_error_runs {1.0 if quoted else 0.0}" in text
        promtool = shutil.which("promtool")
        assert promtool, "promtool is required (Debian package prometheus)"
        lint = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True, check=False
        )
        assert lint.returncode == 0, lint.stdout + lint.stderr
    finally:
        go.touch()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        stop_daemon(daemon)


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie no one has reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_job_dies_with_its_gpuctl_run(tmp_path: Path) -> None:
    """gpud releases the reservation of a gpuctl run that is gone: the job goes with it,
    rather than go on using what nothing reserves any more."""
    daemon = start_daemon(tmp_path / "g", "--simulate", "H100-SXM5-80GB:1")
    gpuctl = (str(BIN / "gpuctl"), "--socket", str(daemon.socket))
    pid_file = tmp_path / "job.pid"
    holder = subprocess.Popen(
        [
            *gpuctl,
            "run",
            "--job",
            "a",
            *WHOLE,
            "--",
            "sh",
            "-c",
            f"echo $$ > {pid_file}; exec sleep 60",
        ]
    )
    job = 0
    try:
        wait_for(lambda: pid_file.exists() and pid_file.read_text().strip())
        job = int(pid_file.read_text())
        assert _running(job)
        holder.kill()  # SIGKILL: no chance to stop the job itself
        holder.wait(timeout=30)
        wait_for(lambda: not _running(job), timeout=10)
        wait_for(lambda: "GPU-" not in daemon.gpuctl("jobs", "ls", "a", check=False).stdout)
    finally:
        if job and _running(job):
            os.kill(job, signal.SIGKILL)
        if holder.poll() is None:
            holder.kill()
            holder.wait(timeout=30)
        stop_daemon(daemon)


def test_ctrl_c_leaves_the_queue(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "g", "--simulate", "H100-SXM5-80GB:1")
    gpuctl = (str(BIN / "gpuctl"), "--socket", str(daemon.socket))
    holder = subprocess.Popen([*gpuctl, "run", "--job", "a", *WHOLE, "--", "sleep", "60"])
    waiter = None
    try:
        wait_for(lambda: "GPU-" in daemon.gpuctl("jobs", "ls", "a", check=False).stdout)
        waiter = subprocess.Popen([*gpuctl, "run", "--job", "b", *WHOLE, "--", "true"])
        wait_for(lambda: len(queue(daemon)) == 1)
        waiter.send_signal(2)  # SIGINT, as Ctrl-C sends
        assert waiter.wait(timeout=30) == 130
        assert queue(daemon) == []
        unfeasible = daemon.gpuctl(
            "run", "--job", "m", "--mig", "3g.40gb", "--", "true", check=False
        )
        assert unfeasible.returncode != 0
        assert "3g.40gb" in unfeasible.stderr
    finally:
        for proc in (holder, waiter):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        stop_daemon(daemon)


def test_the_history_says_how_each_run_ended(tmp_path: Path) -> None:
    daemon = start_daemon(tmp_path / "g", "--simulate", "H100-SXM5-80GB:2")
    try:
        exited = daemon.gpuctl("run", "--job", "three", "--gpus", "1", "--", "sh", "-c", "exit 3",
                               check=False)  # fmt: skip
        assert exited.returncode == 3, exited.stderr
        killed = daemon.gpuctl("run", "--job", "term", "--gpus", "1", "--", "sh", "-c",
                               "kill -TERM $$", check=False)  # fmt: skip
        assert killed.returncode == 128 + signal.SIGTERM, killed.stderr
        records = json.loads(daemon.gpuctl("jobs", "history", "--json").stdout)["records"]
        ended = {r["job"]: (r["exit_code"], r["exit_signal"], r["end_cause"]) for r in records}
        assert ended == {"three": (3, None, "exited"), "term": (None, 15, "exited")}
        header, *rows = daemon.gpuctl("jobs", "history").stdout.splitlines()
        shown = {row.split()[0]: row[header.index("EXIT") :] for row in rows}
        assert shown == {"three": "3", "term": "SIGTERM"}
    finally:
        stop_daemon(daemon)
