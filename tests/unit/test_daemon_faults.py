"""The daemon on a simulated node, driven with gpuctl: faults stay with the GPU that has them,
MIG mode changes finish on their own, critical XIDs."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from gpud.backend.sim import SimNode, parse_simulate_spec
from gpud.cli.main import main
from gpud.config import Config
from gpud.daemon import Daemon
from gpud.main import mps_control_command, open_backend
from gpud.mps.procs import alive
from gpud.notify import Notifier
from gpud.store import StateStore
from gpud.telemetry.seen import Seen, SeenGpus
from tests.unit.api_support import short_dir
from tests.unit.nvml_doubles import HeldSleep
from tests.unit.process_support import until
from tests.unit.sim_support import NO_HOST

T = TypeVar("T")

# A balanced A100-40GB layout that no other test uses.
HELD_OUT = """\
version: v1
mig-configs:
  custom-balanced:
    - devices: all
      mig-enabled: true
      mig-devices:
        "3g.20gb": 1
        "2g.10gb": 1
        "1g.5gb": 2
"""
SPEC = "A100-SXM4-40GB:2"


@pytest.fixture
def root() -> Iterator[Path]:
    with short_dir() as d:  # the socket path must be short
        yield d


def make_config(root: Path) -> Config:
    return Config().with_overrides(
        {
            "daemon.state_dir": root / "state",
            "daemon.run_dir": root / "run",
            "backend.kind": "sim",
            "backend.simulate": SPEC,
            "metrics.enabled": False,
            "telemetry.interval_s": 0.1,
            "telemetry.call_timeout_s": 2.0,
            "daemon.tick_s": 0.1,
        },
        source="test",
    )


def run_daemon(
    config: Config, body: Callable[[], T], *, sim_sleep: Callable[[float], None] = time.sleep
) -> T:
    """Serve ``config`` while ``body()`` runs on a thread (it calls gpuctl); then stop.
    ``sim_sleep``: how the simulated node's slow driver calls hang."""
    backend, sim = open_backend(config, sim_sleep=sim_sleep)
    d = Daemon(
        config,
        backend=backend,
        sim=sim,
        mps_control_command=mps_control_command(config),
        notifier=Notifier(None),
    )

    async def serve() -> T:
        task = asyncio.create_task(d.run())
        deadline = time.monotonic() + 30
        while not config.socket_path.exists():
            assert not task.done(), task.result()
            assert time.monotonic() < deadline, "the daemon did not serve"
            await asyncio.sleep(0.05)
        try:
            return await asyncio.to_thread(body)
        finally:
            d.request_stop()
            assert await asyncio.wait_for(task, 30) == 0

    return asyncio.run(serve())


class Gpuctl:
    def __init__(self, config: Config, capsys: pytest.CaptureFixture[str]) -> None:
        self._socket = str(config.socket_path)
        self._capsys = capsys

    def __call__(self, *argv: str) -> tuple[int, str, str]:
        # A generous deadline: MPS daemons start under load on a shared test machine.
        code = main(["--socket", self._socket, "--timeout", "60", *argv], env={})
        out, err = self._capsys.readouterr()
        return code, out, err

    def gpus(self) -> list[dict[str, object]]:
        code, out, err = self("--json", "gpus")
        assert code == 0, err
        gpus: list[dict[str, object]] = json.loads(out)["gpus"]
        return gpus

    def wait(self, predicate: Callable[[list[dict[str, object]]], bool]) -> None:
        deadline = time.monotonic() + 20
        while not predicate(self.gpus()):
            assert time.monotonic() < deadline, self.gpus()
            time.sleep(0.05)


def test_a_declared_process_of_a_host_process_ends_with_it_and_says_so(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gpuctl sim workload start --pid`` of a running host process: the start event says
    that it ends with it; when it exits, its simulated process ends with a sim.workload
    event. One of a PID no host process has says that it runs until stopped."""
    gpuctl = Gpuctl(make_config(root), capsys)
    host = subprocess.Popen(["sleep", "60"])

    def body() -> None:
        try:
            for pid in (str(host.pid), str(NO_HOST)):
                assert gpuctl("sim", "workload", "start", "--gpu", "0", "--pid", pid)[0] == 0
            host.kill()
            host.wait()
            gpuctl.wait(
                lambda gpus: [p["pid"] for p in gpus[0]["processes"]] == [NO_HOST]  # type: ignore[union-attr]
            )
        finally:
            host.kill()
            host.wait()
        code, out, err = gpuctl("--json", "events", "--kind", "sim.workload")
        assert code == 0, err
        said = [(e["fields"]["pid"], e["message"]) for e in json.loads(out)["events"]]
        assert said == [
            (
                host.pid,
                f"simulated process {host.pid} started on GPU 0: it ends when host"
                f" process {host.pid} exits",
            ),
            (
                NO_HOST,
                f"simulated process {NO_HOST} started on GPU 0: no host process"
                f" {NO_HOST} runs, so it runs until stopped",
            ),
            (host.pid, f"simulated process {host.pid} ended on GPU 0: its host process exited"),
        ]

    run_daemon(make_config(root), body)


def test_a_declared_process_whose_host_process_exited_while_gpud_was_down_says_so(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A declared process whose host process exits while gpud is down is gone when gpud
    starts again, with the same sim.workload event a tick gives (before, it went without
    a word)."""
    config = make_config(root)
    gpuctl = Gpuctl(config, capsys)
    host = subprocess.Popen(["sleep", "60"])
    try:
        start = ("sim", "workload", "start", "--gpu", "1", "--pid", str(host.pid))
        assert run_daemon(config, lambda: gpuctl(*start))[0] == 0
    finally:
        host.kill()
        host.wait()

    def body() -> tuple[object, list[dict[str, object]]]:
        code, out, err = gpuctl("--json", "events", "--kind", "sim.workload")
        assert code == 0, err
        return gpuctl.gpus()[1]["processes"], json.loads(out)["events"]

    processes, said = run_daemon(make_config(root), body)
    assert processes == []
    ended = said[-1]
    assert ended["message"] == (
        f"simulated process {host.pid} ended on GPU 1: its host process exited"
    )
    fields = ended["fields"]
    assert isinstance(fields, dict)
    assert fields["pid"] == host.pid and fields["gpu"] == 1 and fields["uuid"]


def test_held_out_balanced_layout_on_an_a100_applies_without_a_reboot(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(root)
    layout = root / "held-out.yaml"
    layout.write_text(HELD_OUT)
    gpuctl = Gpuctl(config, capsys)

    def body() -> None:
        code, out, err = gpuctl("mig", "assert", "-f", str(layout), "-c", "custom-balanced")
        assert code == 1, out
        code, out, err = gpuctl("mig", "apply", "-f", str(layout), "-c", "custom-balanced")
        assert code == 0, err
        assert "custom-balanced: success" in out
        assert "reset the GPU (nvidia-smi --gpu-reset -i 0)" in out
        code, out, err = gpuctl("mig", "assert", "-f", str(layout), "-c", "custom-balanced")
        assert code == 0, out + err
        code, out, _ = gpuctl("--json", "mig", "show")
        gpus = json.loads(out)["gpus"]
        assert [len(g["instances"]) for g in gpus] == [4, 4]
        assert all(g["mig_current"] and g["mig_pending"] for g in gpus)

    run_daemon(config, body)


def test_skip_reset_leaves_the_change_pending(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(root)
    layout = root / "held-out.yaml"
    layout.write_text(HELD_OUT)
    gpuctl = Gpuctl(config, capsys)

    def body() -> None:
        code, out, err = gpuctl(
            "mig", "apply", "-f", str(layout), "-c", "custom-balanced", "--skip-reset"
        )
        assert code == 0 and "custom-balanced: reset_pending" in out and "pending" in err
        code, out, _ = gpuctl("mig", "assert", "-f", str(layout), "-c", "custom-balanced")
        assert code == 1

    run_daemon(config, body)


def test_a_gpu_lost_before_start_does_not_stop_the_daemon(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(root)
    layout = root / "held-out.yaml"
    layout.write_text(HELD_OUT)
    # GPU 1 fell off the bus while gpud was down: nvmlDeviceGetUUID answers GPU_IS_LOST
    state = config.daemon.run_dir / "sim" / "node.json"
    state.parent.mkdir(parents=True)
    SimNode(parse_simulate_spec(SPEC), state_file=state).faults.lose(1)
    gpuctl = Gpuctl(config, capsys)

    def body() -> None:
        # from the first request on, no job is placed on the lost GPU
        code, _, err = gpuctl("run", "--job", "early", "--devices", "1", "--", "true")
        assert code == 6 and "on GPU 1, which is unhealthy: GPU lost" in err, err
        gpus = gpuctl.gpus()
        assert gpus[0]["healthy"] is True
        assert gpus[1]["healthy"] is False
        assert "nvmlDeviceGetUUID failed on GPU 1: GPU is lost" in str(gpus[1]["reason"])
        code, out, _ = gpuctl("mig", "show")
        assert code == 11, out
        assert "GPU 0 A100-SXM4-40GB" in out and "GPU 1: faulty: GPU lost" in out
        code, out, err = gpuctl("mig", "apply", "-f", str(layout), "-c", "custom-balanced")
        assert code == 11, out + err
        assert "GPU 0: changed" in out and "GPU 1: faulty" in out, out + err
        assert "custom-balanced: partial" in out and "gpuctl: faulty, left alone: GPU 1" in err
        assert "GPU lost" in err.split("left alone: GPU 1", 1)[1], err
        code, out, _ = gpuctl("mig", "assert", "-f", str(layout), "-c", "custom-balanced")
        assert code == 11 and "the GPUs that answer match" in out and "GPU 1:" in out
        # the fault is cleared: GPU 1 answers again and is managed like the others
        code, _, err = gpuctl("sim", "fault", "--gpu", "1", "clear")
        assert code == 0, err
        gpuctl.wait(lambda gpus: all(g["healthy"] for g in gpus))
        code, out, err = gpuctl("mig", "apply", "-f", str(layout), "-c", "custom-balanced")
        assert code == 0, out + err
        code, out, _ = gpuctl("mig", "assert", "-f", str(layout), "-c", "custom-balanced")
        assert code == 0, out

    run_daemon(config, body)


def test_a_gpu_lost_while_gpud_was_down_is_shown_as_last_seen(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A first run reads both GPUs and keeps them; GPU 1 falls off the bus while gpud is
    down; the next run shows it by the UUID and model the first one read, not blank."""
    config = make_config(root)
    gpuctl = Gpuctl(config, capsys)

    def first() -> list[dict[str, object]]:
        return _read_and_kept(config, gpuctl)

    before = run_daemon(config, first)
    SimNode(
        parse_simulate_spec(SPEC), state_file=config.daemon.run_dir / "sim" / "node.json"
    ).faults.lose(1)

    def again() -> None:
        gpu0, gpu1 = gpuctl.gpus()
        assert (
            gpu0["uuid"] == before[0]["uuid"]
            and gpu1["healthy"] is False
            and "last seen as" in str(gpu1["reason"])
        )
        assert (gpu1["uuid"], gpu1["name"]) == (before[1]["uuid"], before[1]["name"])
        # by its product key, as GPU 0 that answers, and its metrics before the restart
        assert gpu1["product"] == before[1]["product"] == gpu0["product"]
        code, out, _ = gpuctl("gpus")
        assert code == 0
        row = next(line for line in out.splitlines() if line.startswith("1 "))
        assert f"{before[1]['product']} (last seen)" in row, out
        assert str(before[1]["uuid"])[:12] in row, out
        # mig show and mps show name it the same way, table and --json
        uuid, product = before[1]["uuid"], before[1]["product"]
        code, out, _ = gpuctl("mig", "show")
        assert code == 11  # a faulty GPU: partial
        assert f"GPU 1 {product} (last seen) {uuid}: faulty: " in out, out
        code, out, _ = gpuctl("--json", "mig", "show")
        mig1 = json.loads(out)["gpus"][1]
        assert (mig1["uuid"], mig1["product"], mig1["mig_capable"]) == (uuid, product, None)
        code, out, _ = gpuctl("mps", "show")
        assert code == 0
        row = next(line for line in out.splitlines() if line.startswith("1 "))
        assert f"{product} (last seen)" in row and str(uuid) in row, out
        code, out, _ = gpuctl("--json", "mps", "show")
        (mps1,) = [d for d in json.loads(out)["devices"] if d["gpu"] == 1]
        assert (mps1["uuid"], mps1["profile"]) == (uuid, product)
        assert mps1["memory_total_bytes"] is None and mps1["pipe_directory"] is None
        # a layout its product (as last seen) cannot take is refused, not kept for it
        layout = root / "gpu1-3g40.yaml"
        layout.write_text(
            "version: v1\nmig-configs:\n  big:\n    - devices: [1]\n      mig-enabled: true\n"
            '      mig-devices:\n        "3g.40gb": 1\n'
        )
        code, out, err = gpuctl("mig", "apply", "-f", str(layout), "-c", "big")
        assert code == 2 and "GPU 1 (A100-SXM4-40GB)" in err and "'3g.40gb'" in err, out + err

    run_daemon(config, again)


def test_a_gpu_back_on_the_bus_with_its_xid_79_uncleared_keeps_its_name_in_mig_show(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPU 1 falls off the bus (XID 79) and gpud stops; the next run starts with it lost,
    then it answers again while XID 79 stays uncleared: mig show names it by the product
    and UUID read from it, beside its fault, as it named it by those last seen while lost."""
    config = make_config(root)
    gpuctl = Gpuctl(config, capsys)

    def first() -> list[dict[str, object]]:
        before = _read_and_kept(config, gpuctl)
        assert gpuctl("sim", "fault", "--gpu", "1", "lost")[0] == 0
        gpuctl.wait(lambda gpus: "Xid 79" in str(gpus[1]["reason"]))
        return before

    before = run_daemon(config, first)
    uuid, product = before[1]["uuid"], before[1]["product"]

    def again() -> None:
        code, out, _ = gpuctl("mig", "show")
        assert code == 11 and f"GPU 1 {product} (last seen) {uuid}: faulty: " in out, out
        assert gpuctl("sim", "fault", "--gpu", "1", "clear")[0] == 0
        gpuctl.wait(lambda gpus: "lost" not in str(gpus[1]["reason"]).lower())
        gpu1 = gpuctl.gpus()[1]
        assert gpu1["healthy"] is False and "Xid 79" in str(gpu1["reason"]), gpu1
        code, out, _ = gpuctl("mig", "show")
        assert code == 11 and f"GPU 1 {product} {uuid}: faulty: " in out, out
        assert "Xid 79" in out.split(f"GPU 1 {product} {uuid}: faulty: ", 1)[1], out
        code, out, _ = gpuctl("--json", "mig", "show")
        mig1 = json.loads(out)["gpus"][1]
        assert (mig1["uuid"], mig1["product"]) == (uuid, product), mig1

    run_daemon(config, again)


def _read_and_kept(config: Config, gpuctl: Gpuctl) -> list[dict[str, object]]:
    """Once both GPUs are read and the "seen" step kept them (after a sample): the GPUs."""
    gpuctl.wait(lambda gpus: all(g["uuid"] for g in gpus))
    deadline = time.monotonic() + 20
    while len(_seen(config)) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return gpuctl.gpus()


def _seen(config: Config) -> dict[int, Seen]:
    store = StateStore(config.daemon.state_dir)
    try:
        return SeenGpus(store).known
    finally:
        store.close()


def test_critical_xid_until_cleared_and_a_hung_gpu_in_mig_show(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(root)
    gpuctl = Gpuctl(config, capsys)

    def body() -> None:
        assert gpuctl("sim", "fault", "--gpu", "0", "xid", "43")[0] == 0  # application's
        assert gpuctl("sim", "fault", "--gpu", "1", "xid", "79")[0] == 0  # off the bus
        assert gpuctl("sim", "fault", "--gpu", "1", "xid", "48")[0] == 0  # double-bit ECC
        assert gpuctl("sim", "fault", "--gpu", "1", "xid", "31")[0] == 0  # application's
        gpuctl.wait(lambda gpus: "critical Xids 79, 48" in str(gpus[1]["reason"]))
        gpus = gpuctl.gpus()
        assert gpus[0]["healthy"] is True and gpus[1]["healthy"] is False
        code, out, _ = gpuctl("--json", "xid")
        assert code == 0
        assert [(x["gpu"], x["xid"]) for x in json.loads(out)["critical_xids"]] == [
            (1, 79),
            (1, 48),
        ]
        code, out, _ = gpuctl("xid", "clear", "1", "--xid", "79")
        assert code == 0 and "GPU 1: critical Xid 79 cleared" in out
        assert "GPU 1: critical Xid 48 not cleared" in out
        # what is left shows at once, not from the next tick on
        assert str(gpuctl.gpus()[1]["reason"]).startswith("critical Xid 48:")
        code, out, _ = gpuctl("xid", "list")
        assert code == 0 and [line.split()[2] for line in out.splitlines()[1:]] == ["48"]
        code, out, _ = gpuctl("xid", "clear", "1")
        assert code == 0 and "GPU 1: critical Xid 48 cleared" in out
        assert gpuctl("xid")[1] == "no uncleared critical Xid\n"
        assert all(g["healthy"] for g in gpuctl.gpus())
        assert "no critical Xid" in gpuctl("xid", "clear", "1")[1]
        assert "no critical Xid" in gpuctl("xid", "clear", "--gpu", "1")[1]  # as sim fault
        assert gpuctl("xid", "clear")[0] == 2
        assert gpuctl("xid", "clear", "1", "--gpu", "0")[0] == 2
        # a GPU whose driver calls hang (until released): not answering, and mig show
        # answers for the other
        assert gpuctl("sim", "fault", "--gpu", "1", "slow", "5")[0] == 0
        gpuctl.wait(lambda gpus: str(gpus[1]["reason"]).startswith("not answering"))
        code, out, _ = gpuctl("mig", "show")
        assert code == 11 and "GPU 1" in out and "faulty: not answering" in out
        assert "GPU 0 A100-SXM4-40GB" in out
        # limits for its device are taken at once, kept for when it answers, and why it
        # does not is said (once the MPS step of a tick has seen the sample)
        deadline = time.monotonic() + 20
        while "GPU 1 unhealthy: not answering" not in gpuctl("mps", "show")[1]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        code, out, err = gpuctl("mps", "set", "--gpu", "1", "--threads", "50")
        # answered with every call on GPU 1 still in the driver: none was waited for
        assert code == 0 and held.returned == 0, err
        assert "(GPU 1 unhealthy)" in out and "\nGPU 1 unhealthy: not answering" in out, out
        assert gpuctl("sim", "fault", "--gpu", "1", "clear")[0] == 0
        held.release()  # the calls left in the driver return before the daemon stops

    held = HeldSleep()
    try:
        run_daemon(config, body, sim_sleep=held)
    finally:
        held.release()


def test_a_change_to_the_simulated_node_shows_in_the_next_read(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a tick far away: only the sample out of turn can show each change
    config = make_config(root).with_overrides({"telemetry.interval_s": 600.0}, source="test")
    gpuctl = Gpuctl(config, capsys)

    def body() -> None:
        assert gpuctl("sim", "fault", "--gpu", "1", "xid", "79")[0] == 0
        code, out, _ = gpuctl("--json", "xid")
        assert code == 0 and [x["xid"] for x in json.loads(out)["critical_xids"]] == [79]
        assert gpuctl.gpus()[1]["healthy"] is False
        assert gpuctl("sim", "fault", "--gpu", "0", "lost")[0] == 0
        assert "GPU lost" in str(gpuctl.gpus()[0]["reason"])
        assert gpuctl("sim", "fault", "--gpu", "0", "clear")[0] == 0
        # back on the bus, with the XID 79 its fall left until a reset or a clear
        assert str(gpuctl.gpus()[0]["reason"]).startswith("critical Xid 79")
        started = (
            "sim",
            "workload",
            "start",
            "--gpu",
            "0",
            "--pid",
            str(NO_HOST),
            "--memory",
            "8GiB",
        )
        assert gpuctl(*started)[0] == 0
        assert [p["pid"] for p in gpuctl.gpus()[0]["processes"]] == [NO_HOST]  # type: ignore[union-attr]
        assert gpuctl("sim", "workload", "stop", "--pid", str(NO_HOST))[0] == 0
        assert gpuctl.gpus()[0]["processes"] == []
        # admission sees a cleared XID at once: a run right after the clear is not refused
        assert gpuctl("jobs", "add", "both", "--gpus", "2")[0] == 0
        code, _, err = gpuctl("run", "--job", "both", "--no-wait", "--", "true")
        assert code == 7 and "GPU 0 unhealthy" in err, err
        assert gpuctl("xid", "clear", "0")[0] == 0 and gpuctl("xid", "clear", "1")[0] == 0
        code, _, err = gpuctl("run", "--job", "both", "--no-wait", "--", "true")
        assert code == 0, err

    run_daemon(config, body)


def test_mps_limits_on_a_mig_device_survive_its_re_creation(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = make_config(root).with_overrides({"mps.enabled": True}, source="test")
    layout = root / "held-out.yaml"
    layout.write_text(HELD_OUT)
    gpuctl = Gpuctl(config, capsys)

    def mps_devices() -> list[dict[str, object]]:
        code, out, err = gpuctl("--json", "mps", "show")
        assert code == 0, err
        devices: list[dict[str, object]] = json.loads(out)["devices"]
        return devices

    def body() -> None:
        # the GPUs' MPS control daemons are up: one gpud is still starting holds its daemon
        # past the apply's wait for it, and the apply fails that GPU as busy
        until(
            lambda: [bool(d.get("up")) for d in mps_devices()] == [True, True],
            "the two MPS control daemons did not come up",
            30,
        )
        code, out, err = gpuctl("mig", "apply", "-f", str(layout), "-c", "custom-balanced")
        assert code == 0, out + err
        deadline = time.monotonic() + 20
        while len(mps_devices()) != 8:  # the sampler lists the new MIG devices
            assert time.monotonic() < deadline, mps_devices()
            time.sleep(0.05)
        code, out, err = gpuctl("mps", "set", "--gpu", "0:1", "--threads", "40")
        assert code == 0, out + err
        before = next(d for d in mps_devices() if d["gpu"] == 0 and d.get("mig") == 1)
        assert before["threads_percent"] == 40
        # A reboot (or a reset) re-creates the instances with new MIG UUIDs.
        assert gpuctl("sim", "reboot")[0] == 0
        deadline = time.monotonic() + 20
        while True:
            devices = mps_devices()
            after = [d for d in devices if d["gpu"] == 0 and d.get("mig") == 1]
            renewed = after and after[0]["uuid"] != before["uuid"] and after[0].get("up")
            if renewed and len(devices) == 8:
                break
            assert time.monotonic() < deadline, devices
            time.sleep(0.05)
        assert after[0]["profile"] == before["profile"]
        assert after[0]["threads_percent"] == 40
        assert after[0]["observed_threads_percent"] == 40
        assert [d.get("threads_percent") for d in devices if d["uuid"] != after[0]["uuid"]] == [
            None
        ] * 7
        code, out, _ = gpuctl("--json", "events", "--kind", "mps.limits_restored")
        restored = json.loads(out)["events"]
        assert len(restored) == 1
        assert restored[0]["fields"]["previous_uuid"] == before["uuid"]
        assert restored[0]["fields"]["uuid"] == after[0]["uuid"]

    run_daemon(config, body)


def test_devices_are_current_as_soon_as_a_mig_apply_returns(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job started right after ``mig apply`` is placed on the new layout, not on the one of
    the last tick: no whole GPU that has just gone into MIG mode, and its MIG devices are
    there to be had."""
    slow = {
        "telemetry.interval_s": 600.0,
        "daemon.tick_s": 600.0,
        "backend.simulate": "H100-SXM5-80GB:1",
    }
    config = make_config(root).with_overrides(slow, source="test")
    layout = root / "balanced.yaml"
    layout.write_text(
        HELD_OUT.replace("3g.20gb", "3g.40gb")
        .replace("2g.10gb", "2g.20gb")
        .replace("1g.5gb", "1g.10gb")
    )
    gpuctl = Gpuctl(config, capsys)
    seen = root / "devices"

    def body() -> None:
        code, out, err = gpuctl("mig", "apply", "-f", str(layout), "-c", "custom-balanced")
        assert code == 0, out + err
        (gpu,) = gpuctl.gpus()
        assert gpu["mig_mode"] == {"current": True, "pending": True}, gpu
        assert len(gpu["mig_devices"]) == 4, gpu
        run = ("run", "--job", "j", "--no-wait")
        show = ("--", "sh", "-c", f"echo $CUDA_VISIBLE_DEVICES > {seen}")
        code, out, err = gpuctl(*run, "--gpus", "1", *show)
        assert code != 0 and not seen.exists(), err
        code, out, err = gpuctl(*run, "--mig", "1g.10gb", *show)
        assert code == 0, err
        assert seen.read_text().startswith("MIG-")

    run_daemon(config, body)


def test_a_job_in_a_mig_device_of_a_lost_gpu_stays_on_it_in_colo_show(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A lost GPU's sample lists no MIG devices: a job reserved in one of them is still
    shown on its GPU, left alone until it answers, and a job on the other GPU as before."""
    config = make_config(root)
    layout = root / "held-out.yaml"
    layout.write_text(HELD_OUT)
    gpuctl = Gpuctl(config, capsys)

    def placements() -> dict[str, dict[str, object]]:
        code, out, err = gpuctl("--json", "colo", "show")
        assert code == 0, err
        return {p["job"]: p for p in json.loads(out)["placements"]}

    def wait_for(predicate: Callable[[dict[str, dict[str, object]]], bool]) -> None:
        deadline = time.monotonic() + 20
        while not predicate(placements()):
            assert time.monotonic() < deadline, placements()
            time.sleep(0.05)

    def body() -> None:
        code, out, err = gpuctl("mig", "apply", "-f", str(layout), "-c", "custom-balanced")
        assert code == 0, out + err
        gpuctl.wait(lambda gpus: all(len(g["mig_devices"]) == 4 for g in gpus))  # type: ignore[arg-type]
        for job, device in (("a", "0:0"), ("b", "1:0")):
            code, _, err = gpuctl("jobs", "add", job, "--devices", device, "--queue")
            assert code == 0, err
        wait_for(lambda p: {"a", "b"} <= p.keys())
        assert gpuctl("sim", "fault", "--gpu", "1", "lost")[0] == 0
        gpuctl.wait(lambda gpus: gpus[1]["healthy"] is False)
        wait_for(lambda p: "left alone" in str(p.get("b", {}).get("reason")))
        shown = placements()
        assert shown["b"]["gpu"] == 1 and shown["b"]["mig_profile"] == "3g.20gb"
        assert str(shown["b"]["reason"]).startswith("GPU 1 lost")
        assert shown["a"]["gpu"] == 0 and "left alone" not in str(shown["a"]["reason"])
        # back on the bus: planned again like the job beside it
        assert gpuctl("sim", "fault", "--gpu", "1", "clear")[0] == 0
        assert gpuctl("xid", "clear", "1")[0] == 0
        wait_for(lambda p: "left alone" not in str(p.get("b", {}).get("reason")))
        assert placements()["b"]["gpu"] == 1

    run_daemon(config, body)


def test_gpuds_stop_leaves_the_mps_control_daemons_running(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A restart (an upgrade, a setting that needs one) must not take their MPS servers
    from running jobs: the next start adopts the daemons."""
    config = make_config(root).with_overrides({"mps.enabled": True}, source="test")
    gpuctl = Gpuctl(config, capsys)

    def body() -> list[int]:
        deadline = time.monotonic() + 20
        while True:
            code, out, err = gpuctl("--json", "mps", "show")
            assert code == 0, err
            devices = json.loads(out)["devices"]
            if devices and all(d.get("up") for d in devices):
                return [int(d["pid"]) for d in devices]
            assert time.monotonic() < deadline, devices
            time.sleep(0.05)

    pids = run_daemon(config, body)
    assert len(pids) == 2
    assert all(alive(pid) for pid in pids)
    with (root / "state" / "events.jsonl").open() as lines:
        events = [json.loads(line) for line in lines]
    (left,) = [e for e in events if e["kind"] == "mps.leave"]
    assert left["message"].startswith("leaving 2 MPS control daemons running")


def test_an_mps_daemon_waits_for_its_gpus_critical_xid_to_be_cleared(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPU with an uncleared critical XID takes no job, and gets no new MPS control
    daemon: `gpuctl mps` says why, naming the GPU; `gpuctl xid clear` starts it. The GPU
    beside it keeps its daemon. The skip names the job reserving the device, read by the
    daemon's own wiring from the state database."""
    config = make_config(root).with_overrides({"mps.enabled": True}, source="test")
    gpuctl = Gpuctl(config, capsys)

    def devices() -> dict[int, dict[str, object]]:
        code, out, err = gpuctl("--json", "mps", "show")
        assert code == 0, err
        return {d["gpu"]: d for d in json.loads(out)["devices"]}

    def wait_for(predicate: Callable[[dict[int, dict[str, object]]], bool]) -> None:
        until(lambda: predicate(devices()), "MPS devices")

    def body() -> None:
        wait_for(lambda found: len(found) == 2 and all(d.get("up") for d in found.values()))
        kept = devices()[0]["pid"]
        code, _, err = gpuctl("jobs", "add", "held", "--devices", "1", "--queue")
        assert code == 0, err
        wait_for(lambda found: found[1].get("jobs") == ["held"])
        assert gpuctl("sim", "fault", "--gpu", "1", "xid", "48")[0] == 0
        gpuctl.wait(lambda gpus: gpus[1]["healthy"] is False)
        # its daemon stopped for good (an operator's change): none is started anew
        assert gpuctl("mps", "set", "--gpu", "1", "--disable")[0] == 0
        code, out, err = gpuctl("mps", "set", "--gpu", "1", "--enable")
        assert code == 0, err
        assert "DOWN: not started while GPU 1 is unhealthy" in out, out
        assert "\nGPU 1 unhealthy: critical Xid 48:" in out, out
        shown = devices()
        assert shown[1]["up"] is False and shown[1].get("pid") is None
        assert shown[1]["last_error"] == "not started while GPU 1 is unhealthy"
        assert str(shown[1]["gpu_unhealthy"]).startswith("critical Xid 48:")
        assert shown[0]["up"] is True and shown[0]["pid"] == kept
        assert gpuctl("xid", "clear", "1")[0] == 0
        wait_for(lambda found: found[1].get("up") is True)
        code, out, err = gpuctl("--json", "events", "--kind", "mps.start_skipped")
        assert code == 0, err
        (skipped,) = json.loads(out)["events"]
        fields = skipped["fields"]
        assert fields["gpu"] == 1 and fields["reason"].startswith("critical Xid 48:")
        assert fields["jobs"] == ["held"]
        assert skipped["message"].endswith("; job held loses MPS until then")

    run_daemon(config, body)


def test_a_simulated_reboot_ends_the_mps_daemons_and_starts_them_anew(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``gpuctl sim reboot`` ends the MPS control daemons as a reboot does, and gpud starts
    each device's anew: new PIDs, one mps.start per device after the reboot, no failed
    stop."""
    config = make_config(root).with_overrides({"mps.enabled": True}, source="test")
    gpuctl = Gpuctl(config, capsys)

    def daemons() -> dict[str, object]:
        code, out, err = gpuctl("--json", "mps", "show")
        assert code == 0, err
        return {d["uuid"]: d.get("pid") for d in json.loads(out)["devices"] if d.get("up")}

    def wait_for(predicate: Callable[[dict[str, object]], bool]) -> dict[str, object]:
        deadline = time.monotonic() + 30
        while not predicate(found := daemons()):
            assert time.monotonic() < deadline, found
            time.sleep(0.05)
        return found

    def body() -> None:
        before = wait_for(lambda up: len(up) == 2)
        assert gpuctl("sim", "reboot")[0] == 0
        for pid in before.values():
            assert isinstance(pid, int) and not alive(pid)
        after = wait_for(lambda up: len(up) == 2 and not set(up.values()) & set(before.values()))
        assert after.keys() == before.keys()
        code, out, err = gpuctl("--json", "events", "--kind", "mps.")
        assert code == 0, err
        kinds = [e["kind"] for e in json.loads(out)["events"]]
        assert kinds.count("mps.start") == 4 and "mps.restart" not in kinds, kinds
        assert "mps.stop_failed" not in kinds, kinds
        code, out, err = gpuctl("--json", "events", "--kind", "sim.reboot")
        (reboot,) = json.loads(out)["events"]
        assert "2 MPS control daemons ended" in reboot["message"]

    run_daemon(config, body)


def test_a_simulated_reboot_that_fails_says_how_many_mps_daemons_ended(
    root: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """``gpuctl sim reboot`` failing once the MPS control daemons were SIGKILLed (the
    simulated node's state cannot be saved): the reboot fails, and the log says how many
    daemons ended, which no event says."""
    config = make_config(root).with_overrides({"mps.enabled": True}, source="test")
    gpuctl = Gpuctl(config, capsys)
    sim_dir = root / "run" / "sim"

    def up() -> list[object]:
        code, out, err = gpuctl("--json", "mps", "show")
        assert code == 0, err
        return [d for d in json.loads(out)["devices"] if d.get("up")]

    def body() -> None:
        # up: started and their limits applied, not only a PID file written
        until(lambda: len(up()) == 2, "the two MPS control daemons did not come up", 30)
        shutil.move(sim_dir, root / "sim.saved")
        sim_dir.write_text("")  # node.json cannot be written under it
        try:
            assert gpuctl("sim", "reboot")[0] != 0
        finally:
            sim_dir.unlink()
            shutil.move(root / "sim.saved", sim_dir)

    with caplog.at_level(logging.WARNING, logger="gpud.daemon"):
        run_daemon(config, body)
    said = [r.getMessage() for r in caplog.records if r.name == "gpud.daemon"]
    assert "the simulated reboot failed after 2 MPS control daemons ended" in said, said


def test_a_gpu_gone_from_the_bus_after_a_restart_keeps_its_layout_until_forgotten_as_gone(
    root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPU 1 gets a layout, then falls off the bus while gpud is down: the next run's driver
    counts 1 GPU. Its record is left alone as faulty (gone from the bus), not forgotten by a
    plain forget; ``forget --gone`` drops it."""
    config = make_config(root)
    layout = root / "held-out.yaml"
    layout.write_text(HELD_OUT)
    gpuctl = Gpuctl(config, capsys)

    def first() -> list[dict[str, object]]:
        code, out, err = gpuctl("mig", "apply", "-f", str(layout), "-c", "custom-balanced")
        assert code == 0, out + err
        return _read_and_kept(config, gpuctl)

    before = run_daemon(config, first)
    uuid = str(before[1]["uuid"])
    # the board is gone: the simulated node is one GPU now, GPU 0 as it was
    (config.daemon.run_dir / "sim" / "node.json").unlink()
    one = config.with_overrides({"backend.simulate": "A100-SXM4-40GB:1"}, source="test")

    def mig_events(kind: str) -> list[dict[str, object]]:
        code, out, err = gpuctl("--json", "events", "--kind", kind)
        assert code == 0, err
        events: list[dict[str, object]] = json.loads(out)["events"]
        return events

    def again() -> None:
        # the reconcile step leaves it alone as faulty: not missing (no layout_matches 0)
        deadline = time.monotonic() + 20
        while not (drift := [e for e in mig_events("mig.drift") if e["fields"]["gpu"] == 1]):
            assert time.monotonic() < deadline, "no reconcile outcome for GPU 1"
            time.sleep(0.05)
        assert [e["fields"]["status"] for e in drift] == ["faulty"], drift
        assert "gone from the bus" in str(drift[0]["message"]), drift
        code, out, err = gpuctl("mig", "forget", uuid)
        assert code == 6, out + err
        assert "gone from the bus: the driver counts 1 GPU(s), none at index 1" in err, err
        assert "--gone" in err, err
        code, out, err = gpuctl("mig", "forget", "--gone", uuid)
        assert code == 0, out + err
        assert f"forgot {uuid}" in out, out
        (forgotten,) = mig_events("mig.forgotten")
        assert forgotten["fields"] == {
            "gpu": 1,
            "uuid": uuid,
            "config": "custom-balanced",
            "gone": True,
        }

    run_daemon(one, again)
