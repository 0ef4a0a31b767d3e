"""The admission queue's hand-over and withdrawals, on a running ``gpud --simulate``.

::

    .venv/bin/python -m tools.bench_queue [--runs 10] [--leavers 80]

- hand-over: ``--runs`` queued ``gpuctl run --gpus 1 --memory 60GiB`` of 0.3 s each on one
  H100; the time from one command's end to the next one's start (what the devices sit idle
  between two queued runs), mean, min and max;
- withdrawals: ``--leavers`` runs queued behind one holding the GPU get SIGINT at once (a
  Ctrl-C each, one ``Leave`` each); how long each ``gpuctl run`` takes to exit after it,
  median and max, and how many said gpud did not answer the withdrawal within its 2 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.simdaemon import SimDaemon, simulated_gpud

GPUCTL = "import sys; from gpud.cli.main import main; sys.exit(main())"  # the console script
NO_ANSWER = "did not answer the withdrawal"
RUN = ("run", "--gpus", "1", "--memory", "60GiB", "--job")  # the job's name follows


def gpuctl(daemon: SimDaemon, *argv: str) -> list[str]:
    return [sys.executable, "-c", GPUCTL, "--socket", str(daemon.socket), *argv]


def wait_queued(daemon: SimDaemon, count: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(
            gpuctl(daemon, "queue"), check=False, capture_output=True, text=True
        ).stdout
        if sum(1 for line in out.splitlines()[1:] if line.strip()) >= count:
            return
        time.sleep(0.5)
    raise RuntimeError(f"fewer than {count} runs queued after {timeout_s:.0f} s")


def hand_over(daemon: SimDaemon, runs: int, work: Path) -> list[float]:
    starts, ends = work / "starts", work / "ends"
    script = f"date +%s.%N >> {starts}; sleep 0.3; date +%s.%N >> {ends}"
    procs = [
        subprocess.Popen(
            gpuctl(daemon, *RUN, f"h{i}", "--", "sh", "-c", script),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for i in range(runs)
    ]
    failed = sum(1 for p in procs if p.wait() != 0)
    if failed:
        raise RuntimeError(f"{failed} of {runs} runs failed")
    began = sorted(float(x) for x in starts.read_text().split())
    ended = sorted(float(x) for x in ends.read_text().split())
    return [began[i + 1] - ended[i] for i in range(len(began) - 1)]


def withdrawals(daemon: SimDaemon, leavers: int) -> tuple[list[float], int]:
    holder = subprocess.Popen(
        gpuctl(daemon, *RUN, "holder", "--", "sleep", "600"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    procs = []
    try:
        time.sleep(2)
        for i in range(leavers):
            procs.append(
                subprocess.Popen(
                    gpuctl(daemon, *RUN, f"q{i}", "--", "true"),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
            time.sleep(0.1)  # two CPUs: starting them all at once is a benchmark of Python
        wait_queued(daemon, leavers)
        signalled = time.monotonic()
        for p in procs:
            os.kill(p.pid, signal.SIGINT)
        exited: dict[int, float] = {}
        while len(exited) < len(procs):
            for i, p in enumerate(procs):
                if i not in exited and p.poll() is not None:
                    exited[i] = time.monotonic() - signalled
            time.sleep(0.01)
        unanswered = sum(NO_ANSWER in p.communicate()[1] for p in procs)
        return list(exited.values()), unanswered
    finally:
        for p in [holder, *procs]:
            if p.poll() is None:
                p.kill()
                p.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--leavers", type=int, default=80)
    args = parser.parse_args()
    with simulated_gpud("H100-SXM5-80GB:1") as daemon, tempfile.TemporaryDirectory() as tmp:
        gaps = hand_over(daemon, args.runs, Path(tmp))
        print(
            f"hand-over, {args.runs} queued 0.3 s runs: mean {statistics.mean(gaps):.3f} s,"
            f" min {min(gaps):.3f} s, max {max(gaps):.3f} s"
        )
        took, unanswered = withdrawals(daemon, args.leavers)
        print(
            f"withdrawals, {args.leavers} queued runs stopped at once: exit after"
            f" {statistics.median(took):.2f} s median, {max(took):.2f} s max;"
            f" {unanswered} said gpud did not answer within 2 s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
