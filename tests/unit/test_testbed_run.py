"""The testbed's run loop stops when asked: SIGTERM is never swallowed on the way."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tools.testbed import run
from tools.testbed.metrics import JobSpec


class _Proc:
    returncode = None

    def __init__(self, on_wait: BaseException) -> None:
        self._on_wait = on_wait

    def wait(self, timeout: float | None = None) -> int:
        raise self._on_wait


class _Bed:
    """What run_jobs uses of a Bed, without namespaces: its senders' waits raise ``error``."""

    in_rcv: list[str] = []
    in_snd: list[str] = []

    def __init__(self, tmp: Path, error: BaseException) -> None:
        self.tmp = tmp
        self.socket = tmp / "gpud.sock"
        self.error = error
        self.stopped = False

    def spawn(self, argv: list[str], *, log: Path | None = None) -> _Proc:
        if log is not None:
            log.write_text("")
        return _Proc(self.error)

    def stop_all(self) -> None:
        self.stopped = True


JOB = JobSpec("a", 1, 1000, 0.01)


def test_a_sigterm_while_the_jobs_run_ends_the_run(tmp_path: Path) -> None:
    bed = _Bed(tmp_path, run.Interrupted("signal 15"))
    with pytest.raises(run.Interrupted):
        run.run_jobs(bed, [JOB], 1.0, "", "t")  # type: ignore[arg-type]
    assert not isinstance(run.Interrupted("x"), Exception)


def test_senders_past_their_time_are_stopped_and_read(tmp_path: Path) -> None:
    bed = _Bed(tmp_path, subprocess.TimeoutExpired("send", 61.0))
    times, _ = run.run_jobs(bed, [JOB], 1.0, "", "t")  # type: ignore[arg-type]
    assert bed.stopped and times == {"a": []}
