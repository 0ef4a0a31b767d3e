"""A soak of a ``gpud --simulate`` node under steady churn, watching the daemon's memory.

::

    nice -n 10 .venv/bin/python -m tools.soak [--minutes 40] [--rate 1] [--report-every 5]
        [--names N] [--keep-jobs] [--seed 1] [--spec H100-SXM5-80GB:4] [--gpud-env KEY=VALUE ...]

Starts its own simulated gpud (MPS on with the fake control daemon, admission and co-location
on, traffic off) in a temporary directory, applies a MIG layout to its last two GPUs, then
sends about ``--rate`` commands a second through ``gpuctl``: runs of mixed shapes (whole GPUs,
MIG devices, with and without ``--threads`` / ``--memory``, some waiting in the queue, some
``--no-wait``, some interrupted with SIGINT, some whose command fails), ``jobs add`` / ``rm``,
``mps set``, ``sim fault`` inject and clear, and listings; SIGHUP every minute and a
``/metrics`` scrape every 5 s. Every job has a new name (``--names N`` draws from N) and a
run's job is removed once the run ends, as a batch system's epilog would (``--keep-jobs``
leaves them registered: the registry, and its series, then grow with every run).

Every ``--report-every`` minutes it prints a row: the daemon's RSS, its anonymous and private
dirty memory (``/proc/PID/smaps_rollup``), open fds, threads, metric series, commands sent;
at the end the slope of each over the first and second half (per minute; sampled every
30 s). Ctrl-C or SIGTERM stops it early: the commands still running, the daemon and the
directories are cleaned up on the way out, the slopes of what it sampled so far printed, then
"cut short by SIGNAL", and it dies by the signal (128 + its number).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tools.simdaemon import (
    SimDaemon,
    cut_short,
    exit_as,
    held,
    restores_signals,
    simulated_gpud,
    stopped_by_signal,
)

CONFIG = """\
[mps]
enabled = true

[admission]
enabled = true

[colocate]
enabled = true

[traffic]
enabled = false
"""

MIG_LAYOUT = """\
version: v1
mig-configs:
  soak:
    - devices: [0, 1]
      mig-enabled: false
    - devices: [2]
      mig-enabled: true
      mig-devices:
        "3g.40gb": 2
    - devices: [3]
      mig-enabled: true
      mig-devices:
        "1g.10gb": 7
"""

SAMPLE_EVERY_S = 30.0
SCRAPE_EVERY_S = 5.0
SIGHUP_EVERY_S = 60.0
GIVE_UP_S = 60.0  # a command still running after this long is interrupted
GPUCTL = str(Path(sys.executable).parent / "gpuctl")  # the one installed beside this interpreter


@dataclass(frozen=True)
class Sample:
    minute: float
    rss_mb: float
    anon_mb: float
    dirty_mb: float
    fds: int
    threads: int
    series: int
    sent: int


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    kind: str
    started: float
    interrupt_at: float
    job: str  # a run's job, removed once the run ends (unless --keep-jobs); else ""


@dataclass
class Driver:
    daemon: SimDaemon
    work: Path
    rng: random.Random
    names: int  # job names drawn from; 0: a new one each time
    keep_jobs: bool  # leave each run's job registered, as `jobs rm` after it would not
    running: list[Running] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    sent: int = 0
    series: int = 0
    faulted: set[int] = field(default_factory=set)
    registered: list[str] = field(default_factory=list)

    def job_name(self, prefix: str) -> str:
        n = self.rng.randrange(self.names) if self.names else self.sent
        return f"{prefix}-{n}"

    def gpuctl(self, *args: str) -> list[str]:
        return [GPUCTL, "--socket", str(self.daemon.socket), *args]

    def start(
        self, kind: str, args: list[str], interrupt_after: float | None = None, job: str = ""
    ) -> None:
        proc = subprocess.Popen(
            self.gpuctl(*args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        now = time.monotonic()
        stop = now + (interrupt_after if interrupt_after is not None else GIVE_UP_S)
        self.running.append(Running(proc, kind, now, stop, job))
        self.sent += 1

    def reap(self) -> None:
        now = time.monotonic()
        still: list[Running] = []
        ended: list[str] = []
        for r in self.running:
            rc = r.proc.poll()
            if rc is None:
                if now >= r.interrupt_at:
                    r.proc.send_signal(signal.SIGINT)
                    r.interrupt_at = now + GIVE_UP_S  # killed at stop() if it never exits
                still.append(r)
                continue
            key = f"{r.kind} rc={rc}"
            self.outcomes[key] = self.outcomes.get(key, 0) + 1
            if r.job and not self.keep_jobs:
                ended.append(r.job)
        self.running = still
        for job in ended:  # as a batch system's epilog would
            self.start("jobs rm after run", ["jobs", "rm", job])

    def run_shape(self) -> list[str]:
        rng = self.rng
        args = ["run", "--job", self.job_name("soak")]  # args[2]: the job
        shape = rng.random()
        if shape < 0.4:
            args += ["--gpus", str(rng.choice([1, 1, 2]))]
        elif shape < 0.8:
            args += ["--mig", rng.choice(["3g.40gb", "1g.10gb"])]
        elif shape < 0.9:
            args += ["--devices", rng.choice(["0", "1", "2:0", "3:0"])]
        if rng.random() < 0.3:
            args += ["--kind", "inference"]
        if rng.random() < 0.4:
            args += ["--threads", str(rng.choice([10, 25, 50, 100]))]
        if rng.random() < 0.3:
            args += ["--memory", rng.choice(["2GiB", "5GiB", "9GiB"])]
        if rng.random() < 0.3:
            args += ["--no-wait"]
        outcome = rng.random()
        if outcome < 0.1:
            cmd = ["false"]
        elif outcome < 0.15:
            cmd = [str(self.work / "no-such-command")]
        else:
            cmd = ["sleep", f"{rng.uniform(0.2, 4.0):.1f}"]
        return [*args, "--", *cmd]

    def act(self) -> None:
        rng = self.rng
        pick = rng.random()
        if pick < 0.6:
            interrupt = rng.uniform(0.3, 3.0) if rng.random() < 0.15 else None
            args = self.run_shape()
            self.start("run", args, interrupt, job=args[2])
        elif pick < 0.7:
            if self.registered and rng.random() < 0.5:
                name = self.registered.pop(rng.randrange(len(self.registered)))
                self.start("jobs rm", ["jobs", "rm", name, "--force"])
            else:
                name = self.job_name("soak-reg")
                self.registered.append(name)
                self.start("jobs add", ["jobs", "add", name, "--mig", "1g.10gb"])
        elif pick < 0.78:
            device = rng.choice(["0", "1", "2:0", "3:1"])
            limits = (
                ["--threads", str(rng.choice([20, 50, 80]))]
                if rng.random() < 0.7
                else ["--clear-threads"]
            )
            self.start("mps set", ["mps", "set", "--gpu", device, *limits])
        elif pick < 0.84:
            gpu = rng.randrange(4)
            if gpu in self.faulted:
                self.faulted.discard(gpu)
                self.start("sim fault", ["sim", "fault", "--gpu", str(gpu), "clear"])
            else:
                self.faulted.add(gpu)
                self.start("sim fault", ["sim", "fault", "--gpu", str(gpu), "xid", "31"])
        else:
            listing = rng.choice(
                [["status"], ["jobs", "ls"], ["queue"], ["mps"], ["colo"], ["events"], ["gpus"]]
            )
            self.start("list", listing)

    def scrape(self) -> None:
        try:
            with urllib.request.urlopen(self.daemon.metrics_url, timeout=10) as resp:
                text = resp.read().decode()
        except OSError:
            self.outcomes["scrape failed"] = self.outcomes.get("scrape failed", 0) + 1
            return
        self.series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))

    def stop(self) -> None:
        for r in self.running:
            if r.proc.poll() is None:
                r.proc.kill()
            r.proc.wait()
        self.running = []


def _kib_fields(path: Path, names: tuple[str, ...]) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in path.read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in names:
            found[key] = float(rest.split()[0]) / 1024  # kB -> MB
    return found


def sample(pid: int, start: float, driver: Driver) -> Sample:
    proc = Path(f"/proc/{pid}")
    status = _kib_fields(proc / "status", ("VmRSS",))
    rollup = _kib_fields(proc / "smaps_rollup", ("Anonymous", "Private_Dirty"))
    threads = next(
        int(line.split()[1])
        for line in (proc / "status").read_text().splitlines()
        if line.startswith("Threads:")
    )
    return Sample(
        minute=(time.monotonic() - start) / 60,
        rss_mb=status["VmRSS"],
        anon_mb=rollup["Anonymous"],
        dirty_mb=rollup["Private_Dirty"],
        fds=len(os.listdir(proc / "fd")),
        threads=threads,
        series=driver.series,
        sent=driver.sent,
    )


HEADER = f"{'min':>6} {'RSS MB':>8} {'anon MB':>8} {'dirty MB':>8} {'fds':>5} {'thr':>4} {'series':>7} {'sent':>6}"


def row(s: Sample) -> str:
    return (
        f"{s.minute:6.1f} {s.rss_mb:8.1f} {s.anon_mb:8.1f} {s.dirty_mb:8.1f} "
        f"{s.fds:5d} {s.threads:4d} {s.series:7d} {s.sent:6d}"
    )


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (x, y) points; 0 with fewer than two distinct x."""
    n = len(points)
    if n < 2:
        return 0.0
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else 0.0


def summary(samples: list[Sample]) -> str:
    if len(samples) < 4:
        return "too few samples for slopes"
    mid = samples[-1].minute / 2
    halves = {
        "first half": [s for s in samples if s.minute <= mid],
        "second half": [s for s in samples if s.minute >= mid],
    }
    lines = [
        f"{'slope per minute':<16} {'RSS MB':>8} {'anon MB':>8} {'dirty MB':>8} {'fds':>6} {'thr':>6} {'series':>7}"
    ]
    for name, part in halves.items():
        cols = [
            slope([(s.minute, getattr(s, attr)) for s in part])
            for attr in ("rss_mb", "anon_mb", "dirty_mb", "fds", "threads", "series")
        ]
        lines.append(
            f"{name:<16} {cols[0]:8.3f} {cols[1]:8.3f} {cols[2]:8.3f} "
            f"{cols[3]:6.2f} {cols[4]:6.2f} {cols[5]:7.1f}"
        )
    return "\n".join(lines)


def stray_mps_daemons(run_dir: Path, proc_root: Path = Path("/proc")) -> list[int]:
    """PIDs of MPS control daemons whose pipe directory is under ``run_dir`` (gpud quits
    them when it stops; one it could not stop would outlive the temporary directory)."""
    found = []
    for proc in proc_root.iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            key, _, value = item.partition(b"=")
            if key == b"CUDA_MPS_PIPE_DIRECTORY" and Path(value.decode()).is_relative_to(run_dir):
                found.append(int(proc.name))
    return found


@dataclass
class Soaked:
    """What a soak measured so far: all of it at its end, a part when cut short."""

    samples: list[Sample] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)  # the commands', by outcome
    minutes: float = 0.0  # driven so far


def drive(driver: Driver, minutes: float, rate: float, report_every: float, soaked: Soaked) -> None:
    """Send the commands for ``minutes``, printing a row every ``report_every`` minutes and
    recording into ``soaked`` as it goes (a sample every 30 s)."""
    pid = driver.daemon.pid
    samples = soaked.samples
    start = time.monotonic()
    next_act = next_scrape = next_sample = next_report = start
    next_hup = start + SIGHUP_EVERY_S
    try:
        while (now := time.monotonic()) < start + minutes * 60:
            soaked.minutes = (now - start) / 60
            driver.reap()
            if now >= next_act:
                driver.act()
                next_act += 1 / rate
            if now >= next_scrape:
                driver.scrape()
                next_scrape += SCRAPE_EVERY_S
            if now >= next_hup:
                os.kill(pid, signal.SIGHUP)
                next_hup += SIGHUP_EVERY_S
            if now >= next_sample:
                samples.append(sample(pid, start, driver))
                next_sample += SAMPLE_EVERY_S
                if now >= next_report:
                    print(row(samples[-1]), flush=True)
                    next_report += report_every * 60
            time.sleep(0.05)
        samples.append(sample(pid, start, driver))
        soaked.minutes = samples[-1].minute
        print(row(samples[-1]), flush=True)
    finally:
        driver.stop()


def soak(ns: argparse.Namespace) -> int:
    """Run the soak ``ns`` asks for and print its slopes; the exit status: 0, or 128 + the
    signal's number if SIGINT or SIGTERM cut it short (what it measured still printed)."""
    soaked = Soaked()
    # SIGTERM cleans up as Ctrl-C does: the commands still running, the daemon, the directories
    with stopped_by_signal() as stopped:
        _soak(ns, soaked)
    print(summary(soaked.samples))
    print("commands:", ", ".join(f"{k} x{v}" for k, v in sorted(soaked.outcomes.items())))
    if stopped.by:
        return cut_short(stopped.by, f"{soaked.minutes:.1f} of {ns.minutes:g} minutes")
    return 0


def _soak(ns: argparse.Namespace, soaked: Soaked) -> None:
    env = dict(os.environ)
    for item in ns.gpud_env:
        key, _, value = item.partition("=")
        env[key] = value
    work: Path | None = None
    run_dir: Path | None = None
    try:
        work = Path(tempfile.mkdtemp(prefix="gpud-soak-"))
        (work / "mig.yaml").write_text(MIG_LAYOUT)
        with simulated_gpud(ns.spec, config_text=CONFIG, env=env) as daemon:
            run_dir = daemon.socket.parent
            driver = Driver(
                daemon,
                work,
                random.Random(ns.seed),
                ns.names,
                ns.keep_jobs,
                outcomes=soaked.outcomes,
            )
            apply = ["--timeout", "120", "mig", "apply", "-f", str(work / "mig.yaml")]
            subprocess.run(
                driver.gpuctl(*apply, "-c", "soak"), check=True, stdout=subprocess.DEVNULL
            )
            print(f"gpud pid {daemon.pid}, run dir {run_dir}, log {daemon.log}", flush=True)
            print(HEADER, flush=True)
            drive(driver, ns.minutes, ns.rate, ns.report_every, soaked)
    finally:
        clean_up(work, run_dir)


def clean_up(
    work: Path | None,
    run_dir: Path | None,
    *,
    proc_root: Path = Path("/proc"),
    kill: Callable[[int, int], None] = os.kill,
) -> None:
    """SIGKILL the MPS control daemons left with a pipe directory under gpud's ``run_dir``
    and remove the soak's ``work`` directory; a SIGTERM or SIGINT arriving meanwhile is
    raised once both are done."""
    with held():
        for pid in stray_mps_daemons(run_dir, proc_root) if run_dir is not None else ():
            with contextlib.suppress(ProcessLookupError):  # it exited since it was found
                kill(pid, signal.SIGKILL)
        if work is not None:
            shutil.rmtree(work, ignore_errors=True)


@restores_signals
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--minutes", type=float, default=40.0, help="how long (default 40)")
    ap.add_argument("--rate", type=float, default=1.0, help="commands a second (default 1)")
    ap.add_argument(
        "--report-every", type=float, default=5.0, help="minutes between rows (default 5)"
    )
    ap.add_argument(
        "--spec", default="H100-SXM5-80GB:4", help="the simulated node (default H100-SXM5-80GB:4)"
    )
    ap.add_argument(
        "--names",
        type=int,
        default=0,
        help="job names to draw from (default 0: a new name for every run and job added)",
    )
    ap.add_argument(
        "--keep-jobs",
        action="store_true",
        help="leave each run's job registered (default: jobs rm once its run ends)",
    )
    ap.add_argument("--seed", type=int, default=1, help="seed of the command mix (default 1)")
    ap.add_argument(
        "--gpud-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an environment variable for the daemon, e.g. MALLOC_ARENA_MAX=2 (repeatable)",
    )
    return soak(ap.parse_args(argv))


if __name__ == "__main__":
    exit_as(main())
