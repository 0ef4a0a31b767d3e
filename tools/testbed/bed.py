"""The testbed's network and processes: two namespaces, one veth bottleneck, cleanup.

::

    snd (jobs' senders, gpud)                rcv (jobs' receivers)
      a0 10.68.0.1/24  ==== veth ====  b0 10.68.0.2/24

The bottleneck is ``a0``'s egress, shaped by HTB to ``rate``: under the *baseline* an HTB
root with one class and the kernel's default qdisc (``net.core.default_qdisc``) as its
leaf; under *gpud*, gpud's own HTB tree at the same rate (``traffic.link_rates``). Only
these namespaces are touched; the host's interfaces and qdiscs never are.

Everything is created inside :class:`Bed`'s ``with`` block and removed when it ends, on
success, failure or Ctrl-C: processes (whole process groups), the namespaces (which takes
the veth pair with them), gpud's cgroups, temporary files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

SND_IP, RCV_IP = "10.68.0.1", "10.68.0.2"
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def sh(*args: str, check: bool = True, timeout: float = 60) -> str:
    r = subprocess.run(args, capture_output=True, text=True, check=False, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {r.returncode}: {r.stderr.strip()}")
    return r.stdout


def kernel_default_qdisc() -> str:
    try:
        return Path("/proc/sys/net/core/default_qdisc").read_text().strip() or "pfifo_fast"
    except OSError:
        return "pfifo_fast"


def kernel_default_cc() -> str:
    try:
        return Path("/proc/sys/net/ipv4/tcp_congestion_control").read_text().strip()
    except OSError:
        return "cubic"


class Bed:
    def __init__(self, rate_bps: int) -> None:
        suffix = f"{os.getpid()}{uuid.uuid4().hex[:4]}"
        self.snd, self.rcv = f"tbs{suffix}", f"tbr{suffix}"
        self.rate_bps = rate_bps
        self.tmp = Path(tempfile.mkdtemp(prefix="tb", dir="/tmp"))
        self.cgroup_parent = f"gpud-testbed-{suffix}"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.gpud: subprocess.Popen[bytes] | None = None
        self.socket = self.tmp / "gpud.sock"

    # -- life ------------------------------------------------------------------------------
    def __enter__(self) -> Bed:
        try:
            sh("ip", "netns", "add", self.snd)
            sh("ip", "netns", "add", self.rcv)
            sh("ip", "-n", self.snd, "link", "add", "a0", "type", "veth", "peer", "name", "b0",
               "netns", self.rcv)  # fmt: skip
            sh("ip", "-n", self.snd, "addr", "add", f"{SND_IP}/24", "dev", "a0")
            sh("ip", "-n", self.rcv, "addr", "add", f"{RCV_IP}/24", "dev", "b0")
            for ns, dev in ((self.snd, "a0"), (self.rcv, "b0"), (self.snd, "lo"), (self.rcv, "lo")):
                sh("ip", "-n", ns, "link", "set", dev, "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self.stop_all()
        self.stop_gpud()
        for ns in (self.snd, self.rcv):
            for pid in sh("ip", "netns", "pids", ns, check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            sh("ip", "netns", "del", ns, check=False)
        from gpud.net.cgroups import find_cgroup2

        mount = find_cgroup2()
        if mount is not None:
            parent = mount / self.cgroup_parent
            for child in parent.glob("gpud-job-*"):
                with contextlib.suppress(OSError):
                    child.rmdir()
            with contextlib.suppress(OSError):
                parent.rmdir()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # -- processes -------------------------------------------------------------------------
    @property
    def in_snd(self) -> list[str]:
        # nsenter, not `ip netns exec`: the latter remounts /sys and hides the cgroup2 mount
        return ["nsenter", f"--net=/run/netns/{self.snd}"]

    @property
    def in_rcv(self) -> list[str]:
        return ["nsenter", f"--net=/run/netns/{self.rcv}"]

    def spawn(self, argv: list[str], *, log: Path | None = None) -> subprocess.Popen[bytes]:
        out = log.open("ab") if log else subprocess.DEVNULL
        try:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT if log else subprocess.DEVNULL,
                cwd=REPO,
                start_new_session=True,  # its own process group: killed as a whole
            )
        finally:
            if log:
                out.close()  # type: ignore[union-attr]
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self.procs.clear()

    # -- the bottleneck --------------------------------------------------------------------
    def tc(self, *args: str, check: bool = True) -> str:
        return sh("tc", "-n", self.snd, *args, check=check)

    def baseline_shaping(self) -> str:
        """HTB at ``rate`` with the kernel's default qdisc as its one leaf; returns its name."""
        self.clear_shaping()
        qdisc = kernel_default_qdisc()
        burst = max(128 * 1024, self.rate_bps // 8 // 1000)
        self.tc("qdisc", "replace", "dev", "a0", "root", "handle", "1:", "htb", "default", "1")
        self.tc("class", "add", "dev", "a0", "parent", "1:", "classid", "1:1", "htb",
                "rate", f"{self.rate_bps}bit", "ceil", f"{self.rate_bps}bit",
                "burst", f"{burst}b", "cburst", f"{burst}b", "quantum", "60000")  # fmt: skip
        self.tc("qdisc", "add", "dev", "a0", "parent", "1:1", "handle", "10:", qdisc)
        return qdisc

    def clear_shaping(self) -> None:
        self.tc("qdisc", "del", "dev", "a0", "root", check=False)

    # -- gpud ------------------------------------------------------------------------------
    def start_gpud(self, traffic: Mapping[str, object], *, tick_s: float = 0.2) -> None:
        lines = ["[daemon]", f"tick_s = {tick_s}", "[metrics]", "enabled = false", "[traffic]"]
        settings: dict[str, object] = {
            "enabled": True,
            "interfaces": ["a0"],
            "link_rates": [f"a0={self.rate_bps}bit"],
            "cgroup_parent": self.cgroup_parent,
            **traffic,
        }
        for key, value in settings.items():
            if isinstance(value, bool):
                lines.append(f"{key} = {str(value).lower()}")
            elif isinstance(value, list):
                lines.append(
                    f"{key} = [{', '.join(repr(v).replace(chr(39), chr(34)) for v in value)}]"
                )
            else:
                lines.append(f"{key} = {value!r}".replace("'", '"'))
        config = self.tmp / "gpud.toml"
        config.write_text("\n".join(lines) + "\n")
        log = self.tmp / "gpud.log"
        self.clear_shaping()
        with log.open("wb") as out:
            self.gpud = subprocess.Popen(
                [*self.in_snd, str(BIN / "gpud"), "--config", str(config),
                 "--run-dir", str(self.tmp / "run"), "--state-dir", str(self.tmp / "state"),
                 "--socket", str(self.socket), "--simulate", "H100-SXM5-80GB:16"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.gpud.poll() is not None:
                raise RuntimeError(f"gpud exited:\n{log.read_text()[-2000:]}")
            if self.gpuctl("net", "show", check=False).returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError(f"gpud did not start:\n{log.read_text()[-2000:]}")

    def gpuctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        r = subprocess.run(
            [str(BIN / "gpuctl"), "--socket", str(self.socket), *args],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        if check and r.returncode != 0:
            raise RuntimeError(f"gpuctl {' '.join(args)}: {r.stderr.strip()}")
        return r

    def gpud_cpu_s(self) -> float:
        """CPU seconds gpud has used so far (user + system), 0 when it is not running."""
        if self.gpud is None:
            return 0.0
        try:
            fields = Path(f"/proc/{self.gpud.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop_gpud(self) -> None:
        if self.gpud is None:
            return
        if self.gpud.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.gpud.pid, signal.SIGTERM)
            try:
                self.gpud.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.gpud.pid, signal.SIGKILL)
                self.gpud.wait()
        self.gpud = None
        self.clear_shaping()
        sh(*self.in_snd, "nft", "delete", "table", "inet", "gpud", check=False)
