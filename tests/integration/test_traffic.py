"""gpud enforcing priorities on a real kernel: netns, veth, HTB, nftables, iperf3.

Two namespaces joined by a veth pair (``a0`` in ``snd``, ``b0`` in ``rcv``); gpud runs in
``snd`` (``nsenter --net=``, so the cgroup2 mount stays visible) and enforces on ``a0``,
shaped to 100 Mbit/s. What the kernel holds is read back with ``tc -s class show`` and
``nft``, not through gpud. Everything created here is removed at the end, pass or fail.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpud.net.cgroups import find_cgroup2
from netshaper import tcplan
from tests.integration.conftest import BIN, RunningDaemon, start_daemon, stop_daemon

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (netns, tc, nft)"),
    pytest.mark.skipif(
        not all(shutil.which(p) for p in ("iperf3", "nft", "tc", "nsenter")),
        reason="needs iperf3, nft, tc and nsenter",
    ),
]

RCV_IP = "10.67.65.2"


def run(*args: str, check: bool = True, timeout: float = 60) -> str:
    r = subprocess.run(args, capture_output=True, text=True, check=False, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited {r.returncode}: {r.stderr}{r.stdout}")
    return r.stdout


@dataclass
class Bed:
    snd: str
    rcv: str
    root: Path
    run_dir: Path
    cgroup_parent: str
    daemon: RunningDaemon | None = None
    interfaces: tuple[str, ...] = ("a0",)
    extra: str = ""  # more [traffic] keys
    rated: bool = True  # traffic.link_rates names each interface (else gpud reads the link)
    levels: int = 4

    @property
    def enter(self) -> tuple[str, ...]:
        return ("nsenter", f"--net=/run/netns/{self.snd}")

    def config(self) -> str:
        names = ", ".join(f'"{i}"' for i in self.interfaces)
        rates = ", ".join(f'"{i}=100mbit"' for i in self.interfaces if self.rated)
        return (
            "[daemon]\ntick_s = 0.5\n"
            f"[traffic]\nenabled = true\ninterfaces = [{names}]\n"
            f"link_rates = [{rates}]\nlevels = {self.levels}\n"
            f'cgroup_parent = "{self.cgroup_parent}"\n{self.extra}'
        )

    def start(self) -> RunningDaemon:
        self.daemon = start_daemon(
            self.root,
            "--simulate",
            config_text=self.config(),
            run_dir=self.run_dir,
            prefix=self.enter,
        )
        return self.daemon

    def veth(self, name: str, peer: str) -> None:
        """A veth pair: ``name`` in ``snd``, ``peer`` in ``rcv``."""
        run(
            "ip",
            "-n",
            self.snd,
            "link",
            "add",
            name,
            "type",
            "veth",
            "peer",
            "name",
            peer,
            "netns",
            self.rcv,
        )

    def gpuctl(self, *args: str) -> str:
        assert self.daemon is not None
        return self.daemon.gpuctl(*args).stdout

    def show(self) -> dict[str, object]:
        return json.loads(self.gpuctl("net", "show", "--json"))  # type: ignore[no-any-return]

    def job(self, name: str) -> dict[str, object]:
        jobs = self.show().get("jobs", [])
        assert isinstance(jobs, list)
        return next(j for j in jobs if j["job"] == name)

    def classes(self) -> dict[str, dict[str, int | str]]:
        """``tc -s class show dev a0``: classid -> parent, prio, bytes, packets."""
        out: dict[str, dict[str, int | str]] = {}
        current: dict[str, int | str] = {}
        text = run("tc", "-n", self.snd, "-s", "class", "show", "dev", "a0")
        for line in text.splitlines():
            if m := re.match(r"class htb (\S+) (root|parent (\S+))", line):
                current = {"parent": m.group(3) or "root"}
                if p := re.search(r" prio (\d+)", line):
                    current["prio"] = int(p.group(1))
                out[m.group(1)] = current
            elif m := re.match(r"\s*Sent (\d+) bytes (\d+) pkt", line):
                current["bytes"], current["packets"] = int(m.group(1)), int(m.group(2))
        return out

    def leaf(self, name: str) -> str:
        """The job's leaf class as tc prints it: the class for its tag, under whichever
        level class it was first placed (a level change only changes its prio)."""
        dscp = int(self.job(name)["dscp"])  # type: ignore[call-overload]
        for cid in self.classes():
            major, _, minor = cid.partition(":")
            found = tcplan.parse_leaf(tcplan.handle(int(major, 16), int(minor or "0", 16)))
            if found is not None and found[1] == dscp:
                return cid
        return ""

    def leaf_bytes(self, name: str) -> int:
        return int(self.classes().get(self.leaf(name), {}).get("bytes", 0))

    def wait(self, what: str, predicate: object, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():  # type: ignore[operator]
                return
            time.sleep(0.2)
        log = self.daemon.log.read_text()[-3000:] if self.daemon else ""
        raise AssertionError(f"timed out waiting for {what}\n{log}")

    def iperf_server(self, port: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            ["ip", "netns", "exec", self.rcv, "iperf3", "-s", "-1", "-p", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def iperf_client(self, port: int, seconds: float, tos: int | None = None) -> list[str]:
        cmd = ["iperf3", "-c", RCV_IP, "-p", str(port), "-t", str(seconds), "-J"]
        if tos is not None:
            cmd += ["--tos", str(tos)]
        return cmd


@pytest.fixture
def bed() -> Iterator[Bed]:
    suffix = f"{os.getpid()}{uuid.uuid4().hex[:4]}"
    snd, rcv = f"gts{suffix}", f"gtr{suffix}"
    run_dir = Path(tempfile.mkdtemp(prefix="gt", dir="/tmp"))
    root = Path(tempfile.mkdtemp(prefix="gpud-traffic-"))
    b = Bed(snd, rcv, root, run_dir, f"gpudtest-{suffix}")
    try:
        run("ip", "netns", "add", snd)
        run("ip", "netns", "add", rcv)
        run(
            "ip", "-n", snd, "link", "add", "a0", "type", "veth", "peer", "name", "b0", "netns", rcv
        )
        run("ip", "-n", snd, "addr", "add", "10.67.65.1/24", "dev", "a0")
        run("ip", "-n", rcv, "addr", "add", f"{RCV_IP}/24", "dev", "b0")
        for ns, dev in ((snd, "a0"), (rcv, "b0"), (snd, "lo"), (rcv, "lo")):
            run("ip", "-n", ns, "link", "set", dev, "up")
        yield b
    finally:
        if b.daemon is not None:
            stop_daemon(b.daemon)
        for ns in (snd, rcv):
            for pid in run("ip", "netns", "pids", ns, check=False).split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
            run("ip", "netns", "del", ns, check=False)
        mount = find_cgroup2()
        if mount is not None:
            parent = mount / b.cgroup_parent
            for child in sorted(parent.glob("gpud-job-*")):
                with contextlib.suppress(OSError):
                    child.rmdir()
            with contextlib.suppress(OSError):
                parent.rmdir()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(run_dir, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _iface(b: Bed, name: str) -> dict[str, object]:
    interfaces = b.show().get("interfaces", [])
    assert isinstance(interfaces, list)
    found = [i for i in interfaces if i.get("name") == name]
    return found[0] if found else {}


def _enforced(b: Bed) -> bool:
    interfaces = b.show().get("interfaces", [])
    assert isinstance(interfaces, list)
    return bool(interfaces) and bool(interfaces[0].get("enforced"))


def test_tagged_and_cgroup_flows_land_in_their_classes(bed: Bed) -> None:
    bed.start()
    for name in ("tagged", "runjob"):
        bed.gpuctl("jobs", "add", name)
    bed.gpuctl("net", "pin", "--job", "tagged", "--level", "1")
    bed.gpuctl("net", "pin", "--job", "runjob", "--level", "2")
    bed.wait("levels in force", lambda: bed.job("tagged").get("level") == 1 and _enforced(bed))
    bed.wait("runjob's level", lambda: bed.job("runjob").get("level") == 2)
    tagged, runjob = bed.leaf("tagged"), bed.leaf("runjob")
    classes = bed.classes()
    levels = {tcplan.format_handle(tcplan.level_classid(lv)) for lv in range(4)}
    assert classes[tagged]["parent"] in levels and classes[runjob]["parent"] in levels
    assert classes[tagged]["prio"] == 1 and classes[runjob]["prio"] == 2

    # a flow that sets its own TOS (iperf3 --tos), and one of a `gpuctl run` job that sets none
    port = _free_port()
    server = bed.iperf_server(port)
    time.sleep(0.3)
    dscp = int(bed.job("tagged")["dscp"])  # type: ignore[call-overload]
    run("ip", "netns", "exec", bed.snd, *bed.iperf_client(port, 1, tos=dscp << 2))
    server.wait(timeout=30)
    port = _free_port()
    server = bed.iperf_server(port)
    time.sleep(0.3)
    assert bed.daemon is not None
    env_out = run(
        *bed.enter,
        str(BIN / "gpuctl"),
        "--socket",
        str(bed.daemon.socket),
        "run",
        "--job",
        "runjob",
        "--gpus",
        "1",
        "--",
        "sh",
        "-c",
        f"echo GPUD_DSCP=$GPUD_DSCP NCCL_IB_TC=$NCCL_IB_TC; cat /proc/self/cgroup;"
        f" {' '.join(bed.iperf_client(port, 1))} > /dev/null",
    )
    server.wait(timeout=30)
    run_dscp = int(bed.job("runjob")["dscp"])  # type: ignore[call-overload]
    assert f"GPUD_DSCP={run_dscp} NCCL_IB_TC={run_dscp * 4}" in env_out
    assert f"{bed.cgroup_parent}/gpud-job-runjob" in env_out

    classes = bed.classes()
    assert int(classes[tagged]["bytes"]) > 1_000_000, classes
    table = run(*bed.enter, "nft", "list", "table", "inet", "gpud", check=False)
    assert int(classes[runjob]["bytes"]) > 1_000_000, (classes, table, bed.show())
    # the nftables rule of the job's cgroup counted its packets
    table = run(*bed.enter, "nft", "list", "table", "inet", "gpud")
    m = re.search(r'gpud-job-runjob" ip dscp set \S+ counter packets (\d+)', table)
    assert m is not None and int(m.group(1)) > 0, table


def test_a_run_in_its_own_pid_namespace_puts_its_command_in_the_jobs_cgroup(bed: Bed) -> None:
    """``gpuctl run`` as PID 1 of a PID namespace (a container): its command, numbered
    there, is the process gpud moves into the job's cgroup, found by its host PID."""
    bed.start()
    bed.gpuctl("jobs", "add", "boxed")
    assert bed.daemon is not None
    out = run(
        *bed.enter,
        "unshare",
        "--pid",
        "--fork",
        "--mount-proc",
        str(BIN / "gpuctl"),
        "--socket",
        str(bed.daemon.socket),
        "run",
        "--job",
        "boxed",
        "--gpus",
        "1",
        "--",
        "sh",
        "-c",
        "cat /proc/self/cgroup",
    )
    assert f"{bed.cgroup_parent}/gpud-job-boxed" in out, out


class _Flows:
    """A bulk TCP flow per job (iperf3 marked with the job's TOS), as long as a test needs."""

    def __init__(self, bed: Bed, jobs: tuple[str, ...]) -> None:
        self.bed = bed
        self.jobs = jobs
        self.tos = {n: int(bed.job(n)["dscp"]) << 2 for n in jobs}  # type: ignore[call-overload]
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        ports = [_free_port() for _ in self.jobs]
        self.procs.extend(self.bed.iperf_server(p) for p in ports)
        time.sleep(0.3)
        self.procs.extend(
            subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.bed.snd,
                    *self.bed.iperf_client(p, 20, tos=self.tos[n]),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for p, n in zip(ports, self.jobs, strict=True)
        )

    def stop(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs.clear()

    def window(self, seconds: float = 1.5) -> tuple[int, ...]:
        """Bytes each job's leaf sent over ``seconds`` (``tc -s class show``)."""
        before = [self.bed.leaf_bytes(n) for n in self.jobs]
        time.sleep(seconds)
        return tuple(self.bed.leaf_bytes(n) - b for n, b in zip(self.jobs, before, strict=True))


def _pin_two(bed: Bed, top: str, bottom: str) -> None:
    bed.gpuctl("net", "pin", "--job", top, "--level", "0")
    bed.gpuctl("net", "pin", "--job", bottom, "--level", "3")
    bed.wait(f"{top} on level 0", lambda: bed.job(top).get("level") == 0 and _enforced(bed))


def test_a_changed_level_takes_effect_on_live_traffic(bed: Bed) -> None:
    bed.start()
    for name in ("one", "two"):
        bed.gpuctl("jobs", "add", name)
    _pin_two(bed, "one", "two")
    flows = _Flows(bed, ("one", "two"))
    try:
        flows.start()
        bed.wait("traffic flowing", lambda: bed.leaf_bytes("one") > 1_000_000)
        one, two = flows.window()
        assert one > 3 * two, (one, two)  # level 0 before level 3
        _pin_two(bed, "two", "one")
        # A level change is a change of the leaf's prio in place, which HTB applies when the
        # leaf's queue next empties -- every iteration for a training job; these bulk flows
        # never pause, so they pause here once (queues drain), as a job between iterations.
        flows.stop()
        time.sleep(0.5)
        flows.start()
        bed.wait("the promoted flow sending", lambda: bed.leaf_bytes("two") > 1_000_000)
        one, two = flows.window()
        assert two > 3 * one, (one, two)
        assert int(bed.show()["level_changes_total"]) >= 2  # type: ignore[call-overload]
    finally:
        flows.stop()


def test_with_top_share_a_promotion_takes_effect_on_flows_that_never_pause(bed: Bed) -> None:
    """traffic.top_share: level 0's leaves are guaranteed most of the link, a rate HTB takes
    up once the leaf's tokens allow (a changed prio waits until the leaf's queue drains,
    which these bulk flows never let happen): the levels swap on live traffic that does not
    pause. The promoted leaf may first owe the time of a packet it sent at the small rate
    every leaf has (64 KiB at 0.1 Mbit/s here: about 5 s), so the swap is waited for."""
    bed.extra = "top_share = 0.85\n"
    bed.start()
    for name in ("one", "two"):
        bed.gpuctl("jobs", "add", name)
    _pin_two(bed, "one", "two")
    shown = run("tc", "-n", bed.snd, "class", "show", "dev", "a0")
    assert re.search(rf"class htb {bed.leaf('one')} .* rate 85Mbit ceil 100Mbit", shown), shown
    flows = _Flows(bed, ("one", "two"))
    try:
        flows.start()
        bed.wait("traffic flowing", lambda: bed.leaf_bytes("one") > 1_000_000)
        one, two = flows.window()
        assert one > 3 * two, (one, two)
        _pin_two(bed, "two", "one")
        shown = run("tc", "-n", bed.snd, "class", "show", "dev", "a0")
        assert re.search(rf"class htb {bed.leaf('two')} .* rate 85Mbit", shown), shown
        seen: list[tuple[int, ...]] = []
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline:
            seen.append(flows.window(1.0))  # the same flows, never paused
            one, two = seen[-1]
            if two > 3 * one:
                break
        assert two > 3 * one, seen
    finally:
        flows.stop()


def test_a_deleted_qdisc_is_restored_within_one_tick(bed: Bed) -> None:
    bed.interfaces = ("a0", "nope0")  # a bad name is that interface's error only
    bed.start()
    bed.gpuctl("jobs", "add", "keep")
    bed.gpuctl("net", "pin", "--job", "keep", "--level", "1")
    bed.wait("enforced", lambda: _enforced(bed) and bed.job("keep").get("level") == 1)
    leaf = bed.leaf("keep")
    run("tc", "-n", bed.snd, "qdisc", "del", "dev", "a0", "root")  # checked: it was deleted
    # (not read back here: the next tick may have restored it already)
    bed.wait("the tree back", lambda: _iface(bed, "a0").get("repairs") == 1, timeout=10)
    assert leaf in bed.classes()
    interfaces = bed.show()["interfaces"]
    assert isinstance(interfaces, list)
    assert int(interfaces[0]["repairs"]) == 1
    assert interfaces[1]["name"] == "nope0" and not interfaces[1].get("enforced")
    assert "nope0" in interfaces[1]["error"]
    assert bed.daemon is not None
    assert "net.drift" in bed.gpuctl("events", "--json")


def test_priorities_stay_in_force_across_kill_9_and_are_adopted(bed: Bed) -> None:
    daemon = bed.start()
    bed.gpuctl("jobs", "add", "steady")
    bed.gpuctl("net", "pin", "--job", "steady", "--level", "2")
    bed.wait("enforced", lambda: _enforced(bed) and bed.job("steady").get("level") == 2)
    leaf = bed.leaf("steady")
    tos = int(bed.job("steady")["dscp"]) << 2  # type: ignore[call-overload]
    daemon.proc.send_signal(signal.SIGKILL)
    stop_daemon(daemon)  # reaps it and closes its notify socket
    bed.daemon = None
    # no gpud: the tree, its filters and the nftables table are all still there
    port = _free_port()
    server = bed.iperf_server(port)
    time.sleep(0.3)
    run("ip", "netns", "exec", bed.snd, *bed.iperf_client(port, 1, tos=tos))
    server.wait(timeout=30)
    sent = int(bed.classes()[leaf]["bytes"])
    assert sent > 1_000_000
    assert "table inet gpud" in run(*bed.enter, "nft", "list", "tables")
    # a new gpud adopts the tree instead of rebuilding it: the leaf's counters keep counting
    bed.start()
    bed.wait("enforced again", lambda: _enforced(bed))
    time.sleep(1.5)
    assert bed.job("steady").get("level") == 2
    assert int(bed.classes()[leaf]["bytes"]) >= sent
    interfaces = bed.show()["interfaces"]
    assert isinstance(interfaces, list) and int(interfaces[0].get("repairs", 0)) == 0


def test_a_pin_beyond_lowered_levels_is_clamped_and_says_so(bed: Bed) -> None:
    daemon = bed.start()
    bed.gpuctl("jobs", "add", "steady")
    bed.gpuctl("net", "pin", "--job", "steady", "--level", "3")
    bed.wait("enforced", lambda: _enforced(bed) and bed.job("steady").get("level") == 3)
    stop_daemon(daemon)  # a clean stop: fail-static leaves the tree
    bed.levels = 2
    daemon = bed.start()
    bed.wait("enforced again", lambda: _enforced(bed) and bed.job("steady").get("level") == 1)
    job = bed.job("steady")
    assert job["pinned_level"] == 1 and job["pinned_level_clamped_from"] == 3
    assert "1 (pinned 3, clamped)" in bed.gpuctl("net", "show")
    (moved,) = [e for e in _events(bed, "net.pin") if "beyond" in str(e["message"])]
    assert moved["fields"] == {"job": "steady", "level": 1, "pinned": 3}
    assert "job steady was pinned to level 3, beyond traffic.levels = 2" in daemon.log.read_text()
    assert int(bed.classes()[bed.leaf("steady")]["prio"]) == 1
    stop_daemon(daemon)
    bed.levels = 4  # raised again: the operator's pin holds again
    bed.start()
    bed.wait("pin back", lambda: _enforced(bed) and bed.job("steady").get("level") == 3)
    job = bed.job("steady")
    assert job["pinned_level"] == 3 and job.get("pinned_level_clamped_from") is None


def test_an_interface_taken_out_of_the_config_loses_gpuds_tree(bed: Bed) -> None:
    run("ip", "-n", bed.snd, "link", "add", "a1", "type", "veth", "peer", "name", "b1")
    run("ip", "-n", bed.snd, "link", "set", "a1", "up")
    bed.interfaces = ("a0", "a1")
    daemon = bed.start()
    bed.gpuctl("jobs", "add", "steady")
    bed.gpuctl("net", "pin", "--job", "steady", "--level", "2")
    bed.wait(
        "both enforced",
        lambda: _iface(bed, "a0").get("enforced") and _iface(bed, "a1").get("enforced"),
    )
    daemon.proc.send_signal(signal.SIGKILL)
    stop_daemon(daemon)
    bed.daemon = None
    assert "htb 6764:" in run("tc", "-n", bed.snd, "qdisc", "show", "dev", "a1")
    bed.interfaces = ("a0",)
    bed.start()
    bed.wait("enforced again", lambda: _enforced(bed))
    assert "htb" not in run("tc", "-n", bed.snd, "qdisc", "show", "dev", "a1")
    assert "htb 6764:" in run("tc", "-n", bed.snd, "qdisc", "show", "dev", "a0")
    assert "a1: not in traffic.interfaces any more" in bed.gpuctl("events", "--kind", "net.")


def _events(b: Bed, kind: str) -> list[dict[str, object]]:
    found = json.loads(b.gpuctl("events", "--json", "--kind", kind))["events"]
    return [e for e in found if e["kind"] == kind]


def test_a_broken_interface_and_a_changed_leaf_qdisc_are_one_event_each(bed: Bed) -> None:
    bed.start()
    bed.gpuctl("jobs", "add", "keep")
    bed.gpuctl("net", "pin", "--job", "keep", "--level", "1")
    bed.wait("enforced", lambda: _enforced(bed) and bed.job("keep").get("level") == 1)
    leaf = bed.leaf("keep")
    run(
        "tc",
        "-n",
        bed.snd,
        "qdisc",
        "replace",
        "dev",
        "a0",
        "parent",
        leaf,
        "handle",
        "20:",
        "bfifo",
    )
    bed.wait("the leaf's queue back", lambda: _iface(bed, "a0").get("repairs") == 1, timeout=10)
    time.sleep(1.5)  # a few more ticks: nothing more to repair
    assert "bfifo" not in run("tc", "-n", bed.snd, "qdisc", "show", "dev", "a0")
    (drift,) = _events(bed, "net.drift")
    assert f"removed bfifo qdisc 20: under class {leaf}" in str(drift["message"])
    run("ip", "-n", bed.snd, "link", "del", "a0")
    bed.wait("a0 broken", lambda: not _enforced(bed), timeout=10)
    time.sleep(1.5)
    bed.veth("a0", "b0")
    run("ip", "-n", bed.snd, "link", "set", "a0", "up")
    bed.wait("a0 enforced again", lambda: _enforced(bed), timeout=10)
    (broke,) = _events(bed, "net.interface_error")
    assert broke["fields"] == {"interface": "a0", "reason": broke["message"]}
    (back,) = _events(bed, "net.interface")
    assert str(back["message"]).startswith("a0: enforced again (was: ")


def test_a_netdev_made_again_between_two_passes_is_named_as_a_new_netdev(bed: Bed) -> None:
    """a0 deleted and created again while no pass runs (gpud held with SIGSTOP, as a pass
    would be by a driver reset that is quicker than a tick): the tree is built on the new
    netdev, and the event says that it is another netdev, not that a tool changed tc."""
    daemon = bed.start()
    bed.gpuctl("jobs", "add", "keep")
    bed.gpuctl("net", "pin", "--job", "keep", "--level", "1")
    bed.wait("enforced", lambda: _enforced(bed) and bed.job("keep").get("level") == 1)
    leaf = bed.leaf("keep")
    old = run("ip", "-n", bed.snd, "-o", "link", "show", "a0").split(":")[0]
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        run("ip", "-n", bed.snd, "link", "del", "a0")
        bed.veth("a0", "b0")
        run("ip", "-n", bed.snd, "link", "set", "a0", "up")
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    new = run("ip", "-n", bed.snd, "-o", "link", "show", "a0").split(":")[0]
    bed.wait("the tree on the new a0", lambda: leaf in bed.classes(), timeout=10)
    bed.wait("the event", lambda: bool(_events(bed, "net.drift")), timeout=10)
    (drift,) = _events(bed, "net.drift")
    assert str(drift["message"]).startswith(
        f"a0: another netdev by that name (ifindex {new}, was {old}): gpud's tree built on it"
    ), drift
    assert _events(bed, "net.interface_error") == []


def test_restore_brings_back_the_root_from_before_gpud_across_a_restart(bed: Bed) -> None:
    run("tc", "-n", bed.snd, "qdisc", "replace", "dev", "a0", "root", "pfifo_fast")
    bed.extra = 'shutdown = "restore"\n'
    daemon = bed.start()
    bed.wait("enforced", lambda: _enforced(bed))
    daemon.proc.send_signal(signal.SIGKILL)
    stop_daemon(daemon)
    bed.daemon = None
    bed.start()  # finds gpud's own tree: what was there before is only in state.db
    bed.wait("enforced again", lambda: _enforced(bed))
    assert bed.daemon is not None
    stop_daemon(bed.daemon)
    bed.daemon = None
    assert run("tc", "-n", bed.snd, "qdisc", "show", "dev", "a0").startswith("qdisc pfifo_fast ")


def test_a_netdev_missing_at_start_and_made_again_does_not_get_the_old_root_back(
    bed: Bed,
) -> None:
    """Run 1 takes a0 over pfifo_fast (recorded in state.db) and is killed; a0 is deleted,
    run 2 starts without it, a0 is made again (the kernel's noqueue) and run 2 builds its
    tree there, then is killed too; run 3's restore leaves noqueue: the pfifo_fast was the
    old a0's, on another ifindex."""
    run("tc", "-n", bed.snd, "qdisc", "replace", "dev", "a0", "root", "pfifo_fast")
    bed.extra = 'shutdown = "restore"\n'
    for made_again in (False, True):
        daemon = bed.start()
        if made_again:
            bed.wait("a0 missing", lambda: bool(_events(bed, "net.interface_error")))
            bed.veth("a0", "b0")
            run("ip", "-n", bed.snd, "link", "set", "a0", "up")
        bed.wait("enforced", lambda: _enforced(bed))
        daemon.proc.send_signal(signal.SIGKILL)
        stop_daemon(daemon)
        bed.daemon = None
        if not made_again:
            run("ip", "-n", bed.snd, "link", "del", "a0")
    daemon = bed.start()
    bed.wait("enforced", lambda: _enforced(bed))
    stop_daemon(daemon)
    bed.daemon = None
    assert run("tc", "-n", bed.snd, "qdisc", "show", "dev", "a0").startswith("qdisc noqueue ")


def _make_a0_again(b: Bed) -> None:
    run("ip", "-n", b.snd, "link", "del", "a0")
    b.veth("a0", "b0")
    run("ip", "-n", b.snd, "link", "set", "a0", "up")


@pytest.mark.parametrize("when", ["between_two_passes", "before_the_stop"])
def test_restore_leaves_a_netdev_made_again_the_root_the_kernel_gave_it(
    bed: Bed, when: str
) -> None:
    """a0 had pfifo_fast when gpud took it; a0 is deleted and created again (the new veth
    gets the kernel's noqueue): the restore at the stop removes gpud's tree (if a pass
    built it on the new a0) and leaves noqueue, not the old netdev's pfifo_fast, and says
    why."""
    run("tc", "-n", bed.snd, "qdisc", "replace", "dev", "a0", "root", "pfifo_fast")
    bed.extra = 'shutdown = "restore"\n'
    daemon = bed.start()
    bed.wait("enforced", lambda: _enforced(bed))
    old = run("ip", "-n", bed.snd, "-o", "link", "show", "a0").split(":")[0]
    daemon.proc.send_signal(signal.SIGSTOP)
    try:
        _make_a0_again(bed)
        if when == "before_the_stop":
            daemon.proc.send_signal(signal.SIGTERM)
    finally:
        daemon.proc.send_signal(signal.SIGCONT)
    new = run("ip", "-n", bed.snd, "-o", "link", "show", "a0").split(":")[0]
    if when == "between_two_passes":
        bed.wait("the tree on the new a0", lambda: bool(_events(bed, "net.drift")), timeout=10)
        assert "htb 6764:" in run("tc", "-n", bed.snd, "qdisc", "show", "dev", "a0")
    else:
        daemon.proc.wait(timeout=30)  # the stop under way: a second SIGTERM cuts it short
    stop_daemon(daemon)
    bed.daemon = None
    assert run("tc", "-n", bed.snd, "qdisc", "show", "dev", "a0").startswith("qdisc noqueue ")
    tree = (
        "gpud's HTB root removed from it"
        if when == "between_two_passes"
        else "gpud's tree went with the old one"
    )
    said = (
        f"a0: traffic.shutdown = restore: another netdev by that name since gpud took it"
        f" (ifindex {new}, was {old}): {tree}, the root qdisc the kernel gave it is left;"
        " the old netdev's pfifo_fast "  # its handle, the kernel's
    )
    assert said in daemon.log.read_text()


def test_the_link_rate_is_read_in_gpuds_own_network_namespace(bed: Bed) -> None:
    """Without traffic.link_rates, the rate is the link's as gpud's namespace sees it. Under
    ``nsenter --net=`` /sys is still the host's: its ``class/net/eth0`` is the host's eth0
    (or none), not the eth0 gpud shapes, a veth (10 Gbit/s)."""
    bed.veth("eth0", "e0")
    run("ip", "-n", bed.snd, "link", "set", "eth0", "up")
    run("ip", "-n", bed.rcv, "link", "set", "e0", "up")
    bed.interfaces, bed.rated = ("eth0",), False
    bed.start()
    bed.wait("eth0 enforced", lambda: bool(_iface(bed, "eth0").get("enforced")), timeout=10)
    assert _iface(bed, "eth0")["rate_bits_per_second"] == 10_000_000_000
    assert "rate 10Gbit ceil 10Gbit" in run("tc", "-n", bed.snd, "class", "show", "dev", "eth0")


def test_levels_without_a_minimum_share_are_not_repaired_every_tick(bed: Bed) -> None:
    """min_share = 0: the level classes' rate is a byte a second, too slow for 128 KiB of
    burst in the kernel's ticks. What gpud asks for is what the kernel keeps: no drift."""
    bed.extra = "min_share = 0.0\n"
    bed.start()
    bed.gpuctl("jobs", "add", "keep")
    bed.gpuctl("net", "pin", "--job", "keep", "--level", "1")
    bed.wait("enforced", lambda: _enforced(bed) and bed.job("keep").get("level") == 1)
    time.sleep(2.0)  # four ticks
    assert _iface(bed, "a0")["repairs"] == 0
    assert _events(bed, "net.drift") == []


def test_an_interface_renamed_away_and_back_is_named_then_enforced_again(bed: Bed) -> None:
    """``ip link set a0 name x0``: gpud's tree goes with the netdev, to a name gpud never
    shapes; the error says so. Renamed back, the tree is gpud's again, as it was."""
    bed.start()
    bed.gpuctl("jobs", "add", "keep")
    bed.gpuctl("net", "pin", "--job", "keep", "--level", "1")
    bed.wait("enforced", lambda: _enforced(bed) and bed.job("keep").get("level") == 1)
    leaf = bed.leaf("keep")
    index = run("ip", "-n", bed.snd, "-o", "link", "show", "a0").split(":")[0]
    run("ip", "-n", bed.snd, "link", "set", "a0", "name", "x0")
    bed.wait("a0 broken", lambda: not _enforced(bed), timeout=10)
    assert _iface(bed, "a0")["error"] == (
        f"a0: no such network interface (renamed to x0, ifindex {index}, gpud's tree still on it:"
        " gpud leaves x0 alone)"
    )
    assert "htb 6764:" in run("tc", "-n", bed.snd, "qdisc", "show", "dev", "x0")
    time.sleep(1.5)  # a few ticks: the same error, one event
    run("ip", "-n", bed.snd, "link", "set", "x0", "name", "a0")
    bed.wait("a0 enforced again", lambda: _enforced(bed), timeout=10)
    assert leaf in bed.classes() and _iface(bed, "a0")["repairs"] == 0
    (broke,) = _events(bed, "net.interface_error")
    assert "renamed to x0" in str(broke["message"])
    (back,) = _events(bed, "net.interface")
    assert str(back["message"]).startswith("a0: enforced again (was: ")
    assert _events(bed, "net.takeover") == []  # its own tree, not one from before the start


def test_restore_at_the_stop_finds_an_interface_renamed_away_by_its_ifindex(bed: Bed) -> None:
    """``ip link set a0 name x0`` while gpud shapes a0: the netdev keeps its ifindex and
    gpud's tree. The stop's restore gives x0 its root from before gpud and says so, rather
    than leaving gpud's tree there unsaid."""
    run("tc", "-n", bed.snd, "qdisc", "replace", "dev", "a0", "root", "pfifo_fast")
    bed.extra = 'shutdown = "restore"\n'
    daemon = bed.start()
    bed.wait("enforced", lambda: _enforced(bed))
    run("ip", "-n", bed.snd, "link", "set", "a0", "name", "x0")
    bed.wait("a0 broken", lambda: not _enforced(bed), timeout=10)
    assert "htb 6764:" in run("tc", "-n", bed.snd, "qdisc", "show", "dev", "x0")
    stop_daemon(daemon)
    bed.daemon = None
    assert run("tc", "-n", bed.snd, "qdisc", "show", "dev", "x0").startswith("qdisc pfifo_fast ")
    said = (
        "a0: traffic.shutdown = restore: renamed to x0 since gpud shaped it, restored there:"
        " gpud's HTB root removed, its root qdisc from before gpud is back: pfifo_fast"
    )
    assert said in daemon.log.read_text()


def test_the_loopback_under_another_name_is_not_shaped(bed: Bed) -> None:
    """``ip link set lo name lb0``: the config's check knows ``lo`` by name only; the
    first pass knows the kernel's ARPHRD_LOOPBACK and leaves lb0 alone, saying why."""
    run("ip", "-n", bed.snd, "link", "set", "lo", "name", "lb0")
    bed.interfaces = ("a0", "lb0")
    bed.start()
    bed.wait("lb0 refused", lambda: bool(_iface(bed, "lb0").get("error")), timeout=10)
    assert str(_iface(bed, "lb0")["error"]).startswith(
        "lb0: the loopback (ARPHRD_LOOPBACK, type 772), named lb0:"
    )
    bed.wait("a0 enforced", lambda: bool(_iface(bed, "a0").get("enforced")), timeout=10)
    assert "6764:" not in run("tc", "-n", bed.snd, "qdisc", "show", "dev", "lb0")


def test_without_link_rates_a_missing_interface_is_named_as_missing(bed: Bed) -> None:
    """The rate read from the link: a name with no interface, or one renamed away, is
    that, not a link without a speed to set in traffic.link_rates."""
    bed.interfaces, bed.rated = ("a0", "nope0"), False
    bed.start()
    bed.wait("a0 enforced", lambda: bool(_iface(bed, "a0").get("enforced")), timeout=10)
    assert _iface(bed, "nope0")["error"] == "nope0: no such network interface"
    index = run("ip", "-n", bed.snd, "-o", "link", "show", "a0").split(":")[0]
    run("ip", "-n", bed.snd, "link", "set", "a0", "name", "x0")
    bed.wait("a0 broken", lambda: not _iface(bed, "a0").get("enforced"), timeout=10)
    assert _iface(bed, "a0")["error"] == (
        f"a0: no such network interface (renamed to x0, ifindex {index}, gpud's tree still on it:"
        " gpud leaves x0 alone)"
    )
    assert _iface(bed, "a0")["rate_bits_per_second"] == 10_000_000_000
