"""gpuctl mig end to end: gpuctl -> gRPC (Mig service) -> MigManager -> the simulated node;
and the MIG metric source."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from prometheus_client import CollectorRegistry

from gpud.api import ApiServer
from gpud.backend.nvml import NvmlBackend
from gpud.backend.sim import SimNode, SimulatedCrash
from gpud.cli.main import main
from gpud.errors import InsufficientResources
from gpud.events import EventLog
from gpud.metrics import Collector
from gpud.mig.api import MigServicer
from gpud.mig.layout import DeviceLayout, load_config
from gpud.mig.manager import MigManager
from gpud.mig.metrics import MigMetrics
from gpud.mig.store import ApplyOptions, MigStore
from gpud.store import StateStore
from gpud.v1 import mig_pb2 as pb
from gpud.v1 import mig_pb2_grpc as pb_grpc
from tests.unit.api_support import ServerThread, short_dir
from tests.unit.nvml_doubles import HeldSleep

DATA = Path(__file__).parent.parent / "data" / "mig-parted"
CONFIG = str(DATA / "config.yaml")
GIB = 1 << 30


@dataclass
class Node:
    sim: SimNode
    mig: MigManager
    socket: str
    jobs: dict[int, str]
    events: EventLog
    store: StateStore


@contextmanager
def serve(
    tmp_path: Path,
    spec: list[tuple[str, int]],
    *,
    read_timeout_s: float = 10.0,
    wrap: Callable[[Any], Any] = lambda backend: backend,
    servicer_class: type[MigServicer] = MigServicer,
    driver_sleep: Callable[[float], None] = time.sleep,
    manager: type[MigManager] = MigManager,
) -> Iterator[Node]:
    """``wrap``: the backend the manager calls, made from the simulated node's;
    ``servicer_class``: the Mig service gpuctl calls; ``driver_sleep``: how the node's slow
    calls hang."""
    sim = SimNode(spec, state_file=tmp_path / "driver.json", sleep=driver_sleep)
    store = StateStore(tmp_path / "state")
    jobs: dict[int, str] = {}
    events = EventLog(None)
    mig = manager(wrap(NvmlBackend(sim.nvml)), store, events, job_resolver=jobs.get)
    try:
        with short_dir() as d:
            path = d / "gpud.sock"
            servicer = servicer_class(mig, read_timeout_s=read_timeout_s)
            with ServerThread(ApiServer(path, servicers=[servicer.register])):
                yield Node(sim, mig, str(path), jobs, events, store)
    finally:
        store.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with serve(tmp_path, [("H100-SXM5-80GB", 2)]) as n:
        yield n


def gpuctl(capsys: pytest.CaptureFixture[str], node: Node, *argv: str) -> tuple[int, str, str]:
    code = main(["--socket", node.socket, *argv], env={})
    out, err = capsys.readouterr()
    return code, out, err


def test_apply_assert_show_export(capsys: pytest.CaptureFixture[str], node: Node) -> None:
    code, out, err = gpuctl(capsys, node, "mig", "assert", "-f", CONFIG, "-c", "all-balanced")
    assert code == 1 and "GPU 0: has MIG disabled; wants 1x 3g.40gb" in out
    # H100 switches MIG mode without a reset: the instances are created in the apply
    code, out, err = gpuctl(capsys, node, "mig", "apply", "-f", CONFIG, "-c", "all-balanced")
    assert code == 0, err
    assert "all-balanced: success" in out and "pending" not in err
    code, out, _ = gpuctl(capsys, node, "mig", "assert", "-f", CONFIG, "-c", "all-balanced")
    assert code == 0 and "match" in out
    code, out, _ = gpuctl(
        capsys, node, "mig", "apply", "-f", CONFIG, "-c", "all-1g.10gb", "--dry-run"
    )
    assert code == 0 and "steps would run" in out and "destroy GPU instance" in out
    code, out, _ = gpuctl(capsys, node, "--json", "mig", "apply", "-f", CONFIG, "-c", "all-1g.10gb")
    doc = json.loads(out)
    assert code == 0 and doc["result"] == "success" and len(doc["gpus"]) == 2

    mig_uuid = node.mig.show()[0].instances[0].uuid
    node.sim.workloads.start(0, 777, 3 * GIB, 0.4, mig=mig_uuid)
    node.jobs[777] = "infer-b"
    code, out, _ = gpuctl(capsys, node, "mig", "show", "--profiles")
    assert code == 0
    assert (
        "GPU 0 H100-SXM5-80GB" in out
        and "MIG on; 7x 1g.10gb; desired: 7x 1g.10gb (all-1g.10gb)" in out
    )
    assert mig_uuid is not None and mig_uuid in out and "777 (infer-b)" in out
    assert "1g.20gb" in out  # the profile table
    code, out, _ = gpuctl(capsys, node, "--json", "mig", "show")
    doc = json.loads(out)
    procs = [p for g in doc["gpus"] for i in g["instances"] for p in i["processes"]]
    assert procs == [{"pid": 777, "used_memory_bytes": 3 * GIB, "job": "infer-b"}]

    # busy: refused with the pid and job, exit code of FailedPrecondition
    code, _, err = gpuctl(capsys, node, "mig", "apply", "-f", CONFIG, "-c", "all-7g.80gb")
    assert code == 6 and "pid 777 (job infer-b)" in err
    code, _, err = gpuctl(
        capsys,
        node,
        "mig",
        "apply",
        "-f",
        CONFIG,
        "-c",
        "all-7g.80gb",
        "--drain",
        "--drain-timeout",
        "0.5",
    )
    assert code == 6 and "after draining" in err

    code, out, _ = gpuctl(capsys, node, "mig", "export", "-c", "mine")
    assert code == 0
    exported = yaml.safe_load(out)
    assert exported["mig-configs"]["mine"] == [
        {"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}
    ]
    path = Path(node.socket).parent / "exported.yaml"
    path.write_text(out)
    code, _, _ = gpuctl(capsys, node, "mig", "assert", "-f", str(path), "-c", "mine")
    assert code == 0


@pytest.mark.parametrize("name", ["a\nb", "x\x1b[2J", "y" * 300])
def test_a_config_name_no_apply_could_take_is_refused_naming_it_and_nothing_is_exported(
    capsys: pytest.CaptureFixture[str], node: Node, name: str
) -> None:
    # export would write it as a key of its YAML; apply and assert refuse it by the same rule
    for argv in (
        ("export", "-c", name),
        ("apply", "-f", CONFIG, "-c", name),
        ("assert", "-f", CONFIG, "-c", name),
    ):
        code, out, err = gpuctl(capsys, node, "mig", *argv)
        assert code == 2 and out == "", err
        assert "argument -c/--config: " in err and err.count("\n") <= 2, err
    with grpc.insecure_channel(f"unix:{node.socket}") as channel:
        stub = pb_grpc.MigStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ExportMig(pb.ExportMigRequest(name=name), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (refused.value.details() or "").startswith("name: "), refused.value
        source = pb.MigConfigSource(name=name, text=Path(CONFIG).read_text(), path=CONFIG)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ApplyMig(pb.ApplyMigRequest(config=source, dry_run=True), timeout=10)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (refused.value.details() or "").startswith("config.name: "), refused.value


def _headers(out: str) -> list[str]:
    """The GPUs' lines of ``gpuctl mig show``, less the product and UUID."""
    return [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("GPU ")]


def test_show_says_the_mig_mode_once(capsys: pytest.CaptureFixture[str], node: Node) -> None:
    """A GPU's line gives its MIG mode, then what the mode leaves unsaid: MIG off holds no
    layout to name, and MIG on with no instances says so without saying MIG again."""
    code, out, err = gpuctl(capsys, node, "mig", "show")
    assert (code, _headers(out)) == (0, ["MIG off", "MIG off"]), err
    code, out, err = gpuctl(capsys, node, "mig", "apply", "-f", CONFIG, "-c", "all-enabled")
    assert code == 0, err
    code, out, _ = gpuctl(capsys, node, "mig", "show")
    desired = "desired: MIG enabled, no instances (all-enabled)"
    assert _headers(out) == [f"MIG on; no instances; {desired}"] * 2
    code, out, _ = gpuctl(capsys, node, "--json", "mig", "show")  # the API keeps its words
    assert [g["layout"] for g in json.loads(out)["gpus"]] == ["MIG enabled, no instances"] * 2


def test_a_mode_change_pending_a_reset(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """An A100 leaves the MIG mode change pending a reset (this daemon has no reset at hand):
    gpuctl says so, a dry run with --skip-reset foresees it and exits as the apply does, and
    the instances come with the next reboot and reconcile."""
    with serve(tmp_path, [("A100-SXM4-40GB", 2)]) as a100:
        dry = ("mig", "apply", "-f", CONFIG, "-c", "all-balanced", "--dry-run", "--skip-reset")
        code, out, err = gpuctl(capsys, a100, *dry)
        assert code == 0, err
        assert "GPU 0: reset_pending (1 steps would run)" in out
        assert "all-balanced: reset_pending" in out and "would be pending a GPU reset" in err
        code, out, err = gpuctl(capsys, a100, "--json", *dry)  # the document says it
        assert (code, json.loads(out)["result"], err) == (0, "reset_pending", "")
        code, out, err = gpuctl(capsys, a100, "mig", "apply", "-f", CONFIG, "-c", "all-balanced")
        assert code == 0, err
        assert "all-balanced: reset_pending" in out and "pending a GPU reset" in err
        code, out, _ = gpuctl(capsys, a100, "mig", "show")
        pending = "MIG off (on pending a GPU reset); desired: 1x 3g.20gb"
        assert code == 0 and [h.split(", ")[0] for h in _headers(out)] == [pending] * 2, out
        code, out, _ = gpuctl(capsys, a100, "mig", "assert", "-f", CONFIG, "-c", "all-balanced")
        assert code == 1 and "pending a GPU reset" in out
        a100.sim.reboot()
        a100.mig.reconcile()
        code, out, _ = gpuctl(capsys, a100, "mig", "assert", "-f", CONFIG, "-c", "all-balanced")
        assert code == 0 and "match" in out


def test_show_names_an_apply_left_unfinished_in_report_mode(
    capsys: pytest.CaptureFixture[str], node: Node
) -> None:
    """An apply cut off (gpud killed mid-apply) that reconcile in "report" mode leaves alone
    is named by ``gpuctl mig show`` with the command that finishes it, until it is run."""
    node.sim.faults.crash_after_mutations(2)
    with pytest.raises(SimulatedCrash):
        node.mig.apply(load_config(Path(CONFIG)), "all-balanced")
    node.mig.reconcile("report")
    code, out, err = gpuctl(capsys, node, "mig", "show")
    assert code == 0, err
    assert out.startswith("unfinished apply: the apply of all-balanced was interrupted"), out
    assert "finish it with `gpuctl mig apply -f FILE -c all-balanced`" in out
    code, out, _ = gpuctl(capsys, node, "--json", "mig", "show")
    assert "gpuctl mig apply -f FILE -c all-balanced" in json.loads(out)["unfinished_apply"]
    code, out, err = gpuctl(capsys, node, "mig", "apply", "-f", CONFIG, "-c", "all-balanced")
    assert code == 0, err
    node.mig.reconcile("report")
    code, out, _ = gpuctl(capsys, node, "mig", "show")
    assert "unfinished" not in out
    # none: null, not "" (which `jq -e .unfinished_apply` takes for one)
    code, out, _ = gpuctl(capsys, node, "--json", "mig", "show")
    assert code == 0 and json.loads(out)["unfinished_apply"] is None


def test_bad_requests(capsys: pytest.CaptureFixture[str], node: Node, tmp_path: Path) -> None:
    code, _, err = gpuctl(
        capsys, node, "mig", "apply", "-f", str(DATA / "impossible.yaml"), "-c", "too-many-slices"
    )
    assert code == 2 and "GPU 0 (H100-SXM5-80GB): too many slices" in err
    code, _, err = gpuctl(capsys, node, "mig", "apply", "-f", CONFIG, "-c", "nope")
    assert code == 2 and "no config named 'nope'" in err
    # a GPU index the node lacks: an unknown GPU, exit 4 as in every command
    for cmd in ("apply", "assert"):
        code, _, err = gpuctl(capsys, node, "mig", cmd, "-f", CONFIG, "-c", "custom-config")
        assert code == 4, err
        assert "no GPU with indexes 2, 3, 4, 5, 6, 7" in err and CONFIG in err
    code, _, err = gpuctl(capsys, node, "mig", "assert", "-f", "/nonexistent.yaml", "-c", "x")
    assert code == 2 and "cannot read" in err
    # Whatever the file turns out to be: one line, at once, never a traceback or a hang.
    binary = tmp_path / "image.bin"
    binary.write_bytes(b"\xd8\x00" * 64)
    code, _, err = gpuctl(capsys, node, "mig", "apply", "-f", str(binary), "-c", "x")
    assert (code, err.strip()) == (2, f"gpuctl: {binary}: not UTF-8 text (byte 0)")
    code, _, err = gpuctl(capsys, node, "mig", "assert", "-f", "/dev/zero", "-c", "x")
    assert code == 2
    assert err.strip() == "gpuctl: /dev/zero: larger than 128 KiB: not a file of this kind"
    fifo = tmp_path / "layout.fifo"
    os.mkfifo(fifo)  # nobody writes to it: read as empty, not waited on
    code, _, err = gpuctl(capsys, node, "mig", "assert", "-f", str(fifo), "-c", "x")
    assert code == 2 and str(fifo) in err, err
    code, _, _ = gpuctl(capsys, node, "mig", "apply", "-f", CONFIG, "-c", "x", "--drain", "--force")
    assert code == 2
    # --skip-reset: an apply that may reset GPUs is waited for far longer than --timeout
    apply = ("mig", "apply", "-f", CONFIG, "-c", "all-balanced", "--skip-reset")
    code, _, err = gpuctl(capsys, node, *apply, "--drain-timeout", "5")
    assert code == 2 and "--drain-timeout goes with --drain" in err
    code, _, err = gpuctl(capsys, node, *apply, "--drain", "--drain-timeout", "-1")
    assert code == 2 and "--drain-timeout: '-1' is not a number of seconds (0 < s <= 86400)" in err


def test_metric_source(node: Node) -> None:
    cfg = load_config(DATA / "config.yaml")
    assert node.mig.apply(cfg, "all-balanced").result == "success"  # H100: no reset needed
    uuid = next(i.uuid for i in node.mig.show()[0].instances if i.profile == "3g.40gb")
    node.sim.workloads.start(0, 55, 5 * GIB, 0.5, mig=uuid)
    node.jobs[55] = "train-x"
    node.mig.refresh_view()  # reconcile re-reads instances only every VIEW_REFRESH_S
    node.mig.reconcile()
    node.mig.apply(cfg, "all-balanced")
    registry = CollectorRegistry()
    registry.register(Collector(lambda: None, sources=[MigMetrics(node.mig)]))
    assert registry.get_sample_value("gpud_mig_apply_total", {"result": "success"}) == 1
    assert registry.get_sample_value("gpud_mig_apply_total", {"result": "reset_pending"}) == 0
    assert registry.get_sample_value("gpud_mig_apply_total", {"result": "noop"}) == 1
    assert registry.get_sample_value("gpud_mig_apply_total", {"result": "busy"}) == 0
    assert registry.get_sample_value("gpud_mig_apply_duration_seconds_count") == 2
    labels = {"gpu": "0", "mig_uuid": uuid, "profile": "3g.40gb"}
    assert registry.get_sample_value("gpud_mig_instance_memory_limit_bytes", labels) > 40 * 10**9
    assert registry.get_sample_value("gpud_mig_instance_processes", labels) == 1
    samples = [
        s
        for m in registry.collect()
        if m.name == "gpud_mig_instance_info"
        for s in m.samples
        if s.labels["mig_uuid"] == uuid
    ]
    assert samples[0].labels["job"] == "train-x" and samples[0].labels["placement"] == "4:4"
    assert (
        registry.get_sample_value(
            "gpud_mig_layout_matches", {"gpu": "1", "gpu_uuid": node.mig.show()[1].identity.uuid}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "gpud_mig_reset_pending", {"gpu": "0", "gpu_uuid": node.mig.show()[0].identity.uuid}
        )
        == 0
    )


class _HeldAtItsFirstRead:
    """The backend, with the next apply's first driver call (the GPU count) held until the
    test lets it go: that apply stays in flight, its client gone, for as long as needed."""

    def __init__(self, backend: Any) -> None:
        self._backend = backend
        self.armed = threading.Event()
        self.reached = threading.Event()
        self.let_go = threading.Event()

    def gpu_count(self) -> int:
        if self.armed.is_set():
            self.armed.clear()
            self.reached.set()
            self.let_go.wait(60)
        return int(self._backend.gpu_count())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


@contextmanager
def _served_held(tmp_path: Path) -> Iterator[tuple[Node, _HeldAtItsFirstRead]]:
    """A node whose next apply is held at its first driver call (:class:`_HeldAtItsFirstRead`,
    armed)."""
    held: list[_HeldAtItsFirstRead] = []

    def gated(backend: Any) -> _HeldAtItsFirstRead:
        held.append(_HeldAtItsFirstRead(backend))
        return held[-1]

    with serve(tmp_path, [("H100-SXM5-80GB", 2)], wrap=gated) as node:
        (gate,) = held
        gate.armed.set()
        yield node, gate


def test_applies_whose_client_gave_up(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The client's deadline passes while the apply has not started its changes: the same
    apply made again meanwhile is refused at once, naming the one still in flight; once
    that one goes on, it finds its client gone and is logged as not started (an apply
    whose client left during its steps is finished: tests/unit/test_mig_apply.py)."""
    with _served_held(tmp_path) as (node, gate):
        # gpuctl waits minutes for an apply: a client of its own gives up after 1 s
        source = pb.MigConfigSource(text=Path(CONFIG).read_text(), path=CONFIG, name="all-balanced")
        with (
            grpc.insecure_channel(f"unix:{node.socket}") as channel,
            pytest.raises(grpc.RpcError) as gave_up,
        ):
            pb_grpc.MigStub(channel).ApplyMig(
                pb.ApplyMigRequest(config=source, skip_reset=True), timeout=1
            )
        assert gave_up.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert gate.reached.wait(30)  # the apply is in flight, whatever the client's timing
        apply = ("mig", "apply", "-f", CONFIG, "-c", "all-balanced", "--skip-reset")
        code, _, err = gpuctl(capsys, node, "--timeout", "1", *apply)
        assert code == 6 and "an apply of all-balanced is in flight (started " in err
        gate.let_go.set()
        _assert_refused_then_not_started(node)


class _DeadlineSeen(MigServicer):
    """The Mig service, keeping the seconds each ApplyMig's caller gave it."""

    deadlines: list[float | None] = []

    async def ApplyMig(self, request: pb.ApplyMigRequest, context: Any) -> pb.ApplyMigResponse:
        self.deadlines.append(context.time_remaining())
        return await super().ApplyMig(request, context)


def test_an_apply_without_a_reset_waits_for_gpud_to_stop_mps_daemons_gpu_after_gpu(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An apply with --skip-reset, --drain or not, may wait for the MPS control daemons on
    each GPU to stop, GPUs one after another (12 s for a busy one): gpuctl gives it
    minutes, not its 10 s, whatever --timeout says; a dry run stops none and keeps it."""
    _DeadlineSeen.deadlines = []
    with serve(tmp_path, [("H100-SXM5-80GB", 2)], servicer_class=_DeadlineSeen) as node:
        apply = ("mig", "apply", "-f", CONFIG, "-c", "all-balanced", "--skip-reset")
        for argv in (apply, ("--timeout", "5", *apply), (*apply, "--dry-run")):
            code, _, err = gpuctl(capsys, node, *argv)
            assert code == 0, err
    applied, short, dry = _DeadlineSeen.deadlines
    assert applied is not None and short is not None and dry is not None
    # gRPC rounds the deadline it sends up: a dry run's 10 s may read a little over
    assert applied > 500 and short > 500 and dry < 60


def test_an_apply_not_answered_in_time_by_a_running_gpud_says_gpud_answers(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """gpuctl's deadline passes while gpud, running, is busy with the apply: gpuctl says
    gpud answers and the apply was not over, not that gpud did not answer (exit 3, "check
    systemctl status gpud")."""
    with _served_held(tmp_path) as (node, gate):
        try:
            dry = ("mig", "apply", "-f", CONFIG, "-c", "all-balanced", "--dry-run")
            code, _, err = gpuctl(capsys, node, "--timeout", "1", *dry)
        finally:
            gate.let_go.set()
    assert (code, err.strip()) == (
        1,
        "gpuctl: gpud answers, but the dry run of all-balanced did not end within 1 s"
        " (raise --timeout)",
    )


def test_an_apply_interrupted_by_ctrl_c_says_it_goes_on_in_gpud(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Ctrl-C while gpuctl waits for an apply (minutes, now): gpuctl exits 130 saying that
    an apply that had begun goes on in gpud, not silently."""
    with _served_held(tmp_path) as (node, gate):

        def interrupt_once_held() -> None:
            if gate.reached.wait(30):
                os.kill(os.getpid(), signal.SIGINT)

        interrupter = threading.Thread(target=interrupt_once_held, daemon=True)
        interrupter.start()
        try:
            apply = ("mig", "apply", "-f", CONFIG, "-c", "all-balanced", "--skip-reset")
            code, _, err = gpuctl(capsys, node, *apply)
        finally:
            gate.let_go.set()
            interrupter.join(30)
    assert code == 130
    assert (
        "gpuctl: interrupted: an apply of all-balanced that had begun its changes goes on in"
        " gpud; see `gpuctl mig show`"
    ) in err


def _assert_refused_then_not_started(node: Node) -> None:

    def results() -> list[tuple[object, object]]:
        return [(e.fields["result"], e.fields.get("client_gone")) for e in node.events.recent()]

    deadline = time.monotonic() + 60
    while len(results()) < 2:
        assert time.monotonic() < deadline, results()
        time.sleep(0.05)
    refused, first = node.events.recent()  # the refusal is logged at once
    assert (refused.fields["result"], refused.fields["client_gone"]) == ("not_started", False)
    assert "an apply of all-balanced is in flight" in refused.message
    assert (first.fields["result"], first.fields["client_gone"]) == ("not_started", True)
    assert "the client had gone before it started" in first.message


def test_export_leaves_a_lost_gpu_out_and_says_so(
    capsys: pytest.CaptureFixture[str], node: Node
) -> None:
    node.sim.faults.lose(0)
    code, out, err = gpuctl(capsys, node, "mig", "export", "-c", "mine")
    assert code == 11  # partial
    assert out.startswith("# GPU 0 left out: ") and "GPU is lost" in out
    assert [e["devices"] for e in yaml.safe_load(out)["mig-configs"]["mine"]] == [[1]]
    assert "gpuctl: not exported: GPU 0: " in err
    code, out, err = gpuctl(capsys, node, "--json", "mig", "export")
    assert code == 11 and json.loads(out)["left_out"][0].startswith("GPU 0: ")
    # stderr: one JSON document, as for an error (`2>&1 >/dev/null | jq` reads it)
    error = json.loads(err)["error"]
    assert error["exit_code"] == 11 and error["message"].startswith("not exported: GPU 0: ")


def test_a_faulty_gpus_mig_mode_is_unknown_in_show_json(
    capsys: pytest.CaptureFixture[str], node: Node
) -> None:
    """A lost GPU's MIG mode is not read: a reset or reboot may change it meanwhile, so
    ``mig_current`` and ``mig_pending`` are null, not the false of a GPU with MIG off."""
    node.sim.faults.lose(1)
    code, out, _ = gpuctl(capsys, node, "--json", "mig", "show")
    assert code == 11
    healthy, lost = json.loads(out)["gpus"]
    assert lost["fault"] and (lost["mig_current"], lost["mig_pending"]) == (None, None)
    assert (healthy["mig_current"], healthy["mig_pending"]) == (False, False)


class _OlderGpud(MigServicer):
    """The Mig service of a gpud from before ``mig_current`` and ``mig_pending`` were
    optional: a plain false of either is not on the wire."""

    async def ShowMig(self, request: pb.ShowMigRequest, context: Any) -> pb.ShowMigResponse:
        resp = await super().ShowMig(request, context)
        for gpu in resp.gpus:
            for name in ("mig_current", "mig_pending"):
                if not getattr(gpu, name):
                    gpu.ClearField(name)
        return resp


def test_show_json_against_an_older_gpud_gives_mig_off_as_false(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A gpud not yet restarted onto the new fields sends no MIG mode for a healthy,
    MIG-capable GPU with MIG off: ``mig show --json`` says false for it, not null (that is
    a faulty GPU's unknown mode), and a lost GPU's stays null."""
    with serve(tmp_path, [("H100-SXM5-80GB", 2)], servicer_class=_OlderGpud) as node:
        node.sim.faults.lose(1)
        code, out, _ = gpuctl(capsys, node, "--json", "mig", "show")
    assert code == 11
    healthy, lost = json.loads(out)["gpus"]
    assert (healthy["mig_current"], healthy["mig_pending"]) == (False, False)
    assert lost["fault"] and (lost["mig_current"], lost["mig_pending"]) == (None, None)


def test_a_faulty_gpu_shows_the_layout_it_is_to_take(
    capsys: pytest.CaptureFixture[str], node: Node
) -> None:
    """A faulty GPU's line says the desired layout reconcile brings it to once it answers,
    as a GPU that answers says its own."""
    code, _, err = gpuctl(capsys, node, "mig", "apply", "-f", CONFIG, "-c", "all-balanced")
    assert code == 0, err
    code, out, _ = gpuctl(capsys, node, "mig", "show")
    (healthy,) = [line for line in out.splitlines() if line.startswith("GPU 1 ")]
    desired = healthy[healthy.index("; desired: ") :]
    node.sim.faults.lose(1)
    code, out, _ = gpuctl(capsys, node, "mig", "show")
    (lost,) = [line for line in out.splitlines() if line.startswith("GPU 1 ")]
    assert code == 11 and ": faulty: GPU lost" in lost and lost.endswith(desired), lost


def test_show_and_assert_name_each_faulty_gpu_on_stderr(
    capsys: pytest.CaptureFixture[str], node: Node
) -> None:
    """A partial answer (exit 11) says on stderr which GPU was left alone and why, one
    line each, so that one who reads only ``$?`` or stderr (stdout to a file) learns it;
    under --json stdout keeps the answer and stderr is the one JSON error document."""
    code, out, err = gpuctl(capsys, node, "--json", "mig", "show")
    assert (code, err) == (0, "")
    uuid = json.loads(out)["gpus"][1]["uuid"]
    node.sim.faults.lose(1)
    show, check = ("mig", "show"), ("mig", "assert", "-f", CONFIG, "-c", "all-disabled")
    code, out, err = gpuctl(capsys, node, *show)
    assert code == 11 and f"GPU 1 H100-SXM5-80GB {uuid}: faulty: GPU lost" in out, out
    assert err.startswith(f"gpuctl: faulty: GPU 1 ({uuid}): GPU lost") and "GPU is lost" in err
    assert err.count("\n") == 1, err
    code, out, err = gpuctl(capsys, node, *check)
    assert code == 11 and "the GPUs that answer match" in out
    assert err.startswith("gpuctl: not checked: GPU 1: GPU lost") and err.count("\n") == 1, err
    for argv, said in ((show, f"faulty: GPU 1 ({uuid}): GPU lost"), (check, "not checked: GPU 1")):
        code, out, err = gpuctl(capsys, node, "--json", *argv)
        assert code == 11 and json.loads(out) is not None
        error = json.loads(err)["error"]
        assert error["exit_code"] == 11 and error["message"].startswith(said), error


def test_an_assert_whose_gpus_differ_still_names_the_gpu_it_did_not_check_on_stderr(
    capsys: pytest.CaptureFixture[str], node: Node
) -> None:
    """GPU 0 differs (exit 1) and GPU 1 is lost: one who reads only stderr (stdout to a
    file) learns that GPU 1 was not checked, as where the others match."""
    node.sim.faults.lose(1)
    check = ("mig", "assert", "-f", CONFIG, "-c", "all-3g.40gb")
    code, out, err = gpuctl(capsys, node, *check)
    assert code == 1 and out.startswith("GPU 0: has MIG disabled"), out
    assert err.startswith("gpuctl: not checked: GPU 1: ") and err.count("\n") == 1, err
    assert err.rstrip().endswith("GPU is lost"), err
    code, out, err = gpuctl(capsys, node, "--json", *check)
    assert code == 1 and err == "", err  # the answer says it: matches false, faulty GPU 1
    answer = json.loads(out)
    assert not answer["matches"] and answer["faulty"][0].startswith("GPU 1: "), answer


class _NoRoomOnGpu0:
    """The backend, except that GPU 0 has no room for any GPU instance (the driver's
    INSUFFICIENT_RESOURCES): its apply fails, not for a fault of the GPU."""

    def __init__(self, backend: NvmlBackend) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def create_gpu_instance(self, gpu: int, profile_id: int, placement: Any) -> Any:
        if gpu == 0:
            raise InsufficientResources("nvmlDeviceCreateGpuInstance failed on GPU 0")
        return self._backend.create_gpu_instance(gpu, profile_id, placement)


def test_an_apply_that_failed_still_names_the_gpu_it_left_alone_on_stderr(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """GPU 0's apply fails (exit 1) and GPU 1 is lost: one who reads only stderr learns
    that GPU 1 was left alone, as where the others succeed (exit 11)."""
    with serve(tmp_path, [("H100-SXM5-80GB", 2)], wrap=_NoRoomOnGpu0) as n:
        n.sim.faults.lose(1)
        argv = ("mig", "apply", "-f", CONFIG, "-c", "all-3g.40gb")
        code, out, err = gpuctl(capsys, n, *argv)
        assert code == 1 and "all-3g.40gb: failed" in out, (out, err)
        assert err.startswith("gpuctl: faulty, left alone: GPU 1") and err.count("\n") == 1, err
        assert "GPU is lost; its product unknown" in err, err
        assert err.rstrip().endswith("its desired layout is unchanged"), err
        code, out, err = gpuctl(capsys, n, "--json", *argv)
    assert code == 1 and err == "", err  # the answer says it: GPU 1 faulty
    assert [g["status"] for g in json.loads(out)["gpus"]][1] == "faulty", out


ONLY_GPU_3 = """version: v1
mig-configs:
  gpu3:
    - devices: [3]
      mig-enabled: true
      mig-devices:
        "3g.40gb": 2
"""


class _LosesGpuAtFirstInstance:
    """The backend, except that ``lose()`` is called once, right after the first GPU
    instance is created: a GPU lost in the middle of an apply."""

    def __init__(self, backend: NvmlBackend, lose: Callable[[], None]) -> None:
        self._backend, self._lose = backend, lose
        self._lost = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def create_gpu_instance(self, gpu: int, profile_id: int, placement: Any) -> Any:
        out = self._backend.create_gpu_instance(gpu, profile_id, placement)
        if not self._lost:
            self._lost = True
            self._lose()
        return out


def test_a_gpu_lost_in_the_middle_of_an_apply_is_named_once_on_stderr(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """GPU 3 falls off the bus after its first instance is created: stderr names it once,
    by index and UUID, and says why, as for a GPU found faulty before the apply."""
    served: list[Node] = []

    def wrap(backend: NvmlBackend) -> _LosesGpuAtFirstInstance:
        return _LosesGpuAtFirstInstance(backend, lambda: served[0].sim.faults.lose(3))

    config = tmp_path / "gpu3.yaml"
    config.write_text(ONLY_GPU_3)
    with serve(tmp_path, [("H100-SXM5-80GB", 4)], wrap=wrap) as n:
        served.append(n)
        code, out, err = gpuctl(capsys, n, "mig", "apply", "-f", str(config), "-c", "gpu3")
        uuid = n.mig.show()[3].identity.uuid
    assert code == 11 and "GPU 3: faulty (2 steps did run)" in out, out
    (line,) = err.splitlines()
    assert line.startswith(f"gpuctl: faulty, left alone: GPU 3 ({uuid}): GPU lost: "), err
    # the driver's error names it too ("... failed on GPU 3"): the line's own words once
    assert line.count("GPU 3 (") == 1 and "is faulty" not in line, err
    assert line.endswith("GPU is lost"), err


def test_assert_and_apply_of_a_config_say_nothing_of_a_lost_gpu_it_does_not_name(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The config names GPU 3 only; GPU 1 is lost: assert checks what the config names, and
    apply changes only that, so neither speaks of GPU 1 (``mig show`` does)."""
    config = tmp_path / "gpu3.yaml"
    config.write_text(ONLY_GPU_3)
    with serve(tmp_path, [("H100-SXM5-80GB", 4)]) as n:
        argv = ("-f", str(config), "-c", "gpu3")
        assert gpuctl(capsys, n, "mig", "apply", *argv)[0] == 0
        n.sim.faults.lose(1)
        assert gpuctl(capsys, n, "mig", "assert", *argv) == (0, "gpu3: the GPUs match\n", "")
        assert gpuctl(capsys, n, "mig", "apply", *argv) == (0, "GPU 3: ok\ngpu3: noop\n", "")
        code, _, err = gpuctl(capsys, n, "mig", "show")
        assert code == 11 and err.startswith("gpuctl: faulty: GPU 1 ("), err


class _Waits(MigManager):
    """A manager that records, for each of its bounded reads (one thread per GPU, given up
    on past its time), what it was for and how long it waited at most."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waits: list[tuple[str, float]] = []

    def _bounded(self, gpus: Any, call: Any, timeout_s: float, what: str, **kw: Any) -> Any:
        self.waits.append((what, timeout_s))
        return super()._bounded(gpus, call, timeout_s, what, **kw)


def test_show_answers_within_the_telemetry_call_timeout_when_a_gpu_starts_hanging(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before telemetry has marked a hung GPU, ``mig show`` waits for its reads no longer
    than telemetry's own call timeout (here 1 s), not the client's whole deadline."""
    held = HeldSleep()
    spec = [("H100-SXM5-80GB", 2)]
    with serve(tmp_path, spec, read_timeout_s=1.0, driver_sleep=held, manager=_Waits) as n:
        assert isinstance(n.mig, _Waits)
        assert gpuctl(capsys, n, "mig", "show")[0] == 0  # identities read, as at gpud's start
        n.sim.faults.slow(1, 30.0)  # GPU 1's calls hang until released
        n.mig.waits.clear()
        code, out, _ = gpuctl(capsys, n, "--timeout", "20", "mig", "show")
        returned = held.returned  # as the answer came
        n.sim.faults.clear(1)
        held.release()
    assert code == 11 and "GPU 1" in out and "not answering" in out, out
    assert held.entered >= 1 and returned == 0  # GPU 1's read was left in the driver
    assert n.mig.waits == [("show", 1.0)]  # telemetry's call timeout, not the client's 20 s


def test_export_leaves_out_a_gpu_that_starts_hanging(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before telemetry has marked a hung GPU, the export reads each GPU as ``mig show``
    does, within MigManager.VIEW_TIMEOUT_S, and leaves out the one that does not answer."""
    held = HeldSleep()
    with serve(tmp_path, [("H100-SXM5-80GB", 2)], driver_sleep=held, manager=_Waits) as n:
        assert isinstance(n.mig, _Waits)
        assert gpuctl(capsys, n, "mig", "show")[0] == 0  # identities read, as at gpud's start
        n.sim.faults.slow(1, 30.0)  # GPU 1's calls hang until released
        n.mig.waits.clear()
        code, out, err = gpuctl(capsys, n, "--timeout", "20", "mig", "export", "-c", "mine")
        returned = held.returned  # as the answer came
        n.sim.faults.clear(1)
        held.release()
    assert code == 11 and out.startswith("# GPU 1 left out: not answering"), out
    assert [e["devices"] for e in yaml.safe_load(out)["mig-configs"]["mine"]] == [[0]]
    assert "gpuctl: not exported: GPU 1: not answering" in err
    assert held.entered >= 1 and returned == 0  # GPU 1's read was left in the driver
    assert n.mig.waits == [("export", MigManager.VIEW_TIMEOUT_S)]


def test_an_apply_stuck_in_the_driver_does_not_hold_up_gpuds_exit() -> None:
    """A GPU that starts hanging mid-command holds the apply until its driver call returns;
    the apply's thread must not hold the process past its stop as well (asyncio.run waits
    for its executor's threads at exit)."""
    import subprocess
    import sys

    # The driver call never returns: the process can exit only without waiting for it.
    script = (
        "import asyncio, threading\n"
        "from gpud.mig.api import _run_while_wanted\n"
        "in_driver = threading.Event()\n"
        "def stuck():\n"
        "    in_driver.set()\n"
        "    threading.Event().wait()\n"
        "async def main():\n"
        "    task = asyncio.create_task(_run_while_wanted(threading.Event(), stuck))\n"
        "    while not in_driver.is_set():\n"
        "        await asyncio.sleep(0.01)\n"
        "    task.cancel()\n"
        "asyncio.run(main())\n"
    )
    # timeout: a hang guard only; a process that waits for the call never exits
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)


def test_show_keeps_the_instances_of_a_gpu_whose_processes_cannot_be_listed(
    capsys: pytest.CaptureFixture[str], node: Node
) -> None:
    """Only the process column is missing: instances, memory and profiles are shown as the
    MIG reads found them, the processes as unknown with the reason; the GPU is no fault."""
    code, _, err = gpuctl(capsys, node, "mig", "apply", "-f", CONFIG, "-c", "all-1g.10gb")
    assert code == 0, err
    mig_uuid = node.mig.show()[0].instances[0].uuid
    node.sim.workloads.start(0, 777, 3 * GIB, 0.4, mig=mig_uuid)
    node.sim.faults.not_supported(0, "processes")
    code, out, _ = gpuctl(capsys, node, "mig", "show", "--profiles")
    assert code == 0, out
    header = next(line for line in out.splitlines() if line.startswith("GPU 0 "))
    assert "MIG on; 7x 1g.10gb" in header and "faulty" not in header
    assert "processes unknown: " in header and "Not Supported" in header
    rows = [line.split() for line in out.splitlines() if line.startswith("0 ")]
    assert len([r for r in rows if r[-1] == "?"]) == 7  # the instance rows
    assert mig_uuid is not None and mig_uuid in out and "777" not in out
    code, out, _ = gpuctl(capsys, node, "--json", "mig", "show")
    gpu0 = json.loads(out)["gpus"][0]
    assert code == 0 and gpu0["fault"] == "" and len(gpu0["instances"]) == 7
    assert gpu0["profiles"]
    first = next(i for i in gpu0["instances"] if i["uuid"] == mig_uuid)
    # null, not [] ("none run"), beside why
    assert first["processes"] is None and "Not Supported" in first["processes_unknown"]
    assert all(i["processes"] is None for i in gpu0["instances"])
    assert first["memory_used_bytes"] >= 3 * GIB
    # nothing shows the instances idle: destroying them is refused unless forced
    code, out, err = gpuctl(capsys, node, "mig", "apply", "-f", CONFIG, "-c", "all-7g.80gb")
    # stderr names each GPU left alone and why, one line each
    (line,) = err.splitlines()
    assert code == 11 and line.startswith("gpuctl: faulty, left alone: GPU 0 (GPU-"), err
    assert line.endswith(
        ": cannot list its processes: _processes_newest failed on GPU 0: "
        "Not Supported (apply with --force to change it anyway)"
    ), err
    assert "cannot list its processes" in out
    # --json: the whole outcome is the one document on stdout; stderr has the note as one
    # JSON document, as an error is
    code, out, err = gpuctl(
        capsys, node, "--json", "mig", "apply", "-f", CONFIG, "-c", "all-7g.80gb"
    )
    doc = json.loads(out)
    assert code == 11 and (doc["config_name"], doc["result"]) == ("all-7g.80gb", "partial")
    assert [(g["gpu"], g["status"]) for g in doc["gpus"]] == [(0, "faulty"), (1, "ok")]
    assert "cannot list its processes" in doc["gpus"][0]["detail"]
    error = json.loads(err)["error"]
    assert error["message"].startswith("faulty, left alone: GPU 0 (GPU-")
    assert "cannot list its processes" in error["message"]
    assert (error["exit_code"], error["class"]) == (11, None)
    code, out, _ = gpuctl(capsys, node, "mig", "assert", "-f", CONFIG, "-c", "all-1g.10gb")
    assert code == 1  # GPU 1 was applied; GPU 0 kept its instances
    assert not any(line.startswith("GPU 0") for line in out.splitlines()), out
    node.sim.faults.clear(0)
    code, out, _ = gpuctl(capsys, node, "--json", "mig", "show")
    first = next(i for i in json.loads(out)["gpus"][0]["instances"] if i["uuid"] == mig_uuid)
    assert first["processes_unknown"] == "" and [p["pid"] for p in first["processes"]] == [777]


def test_a_dry_run_exits_as_the_apply_would(capsys: pytest.CaptureFixture[str], node: Node) -> None:
    """Refused (exit 6) while a process runs on an instance the apply would destroy;
    partial (exit 11) with a GPU whose processes cannot be listed; each GPU's steps and
    status word in the table and in --json; nothing changed."""
    code, _, err = gpuctl(capsys, node, "mig", "apply", "-f", CONFIG, "-c", "all-1g.10gb")
    assert code == 0, err
    mig_uuid = node.mig.show()[0].instances[0].uuid
    node.sim.workloads.start(0, 777, 3 * GIB, 0.4, mig=mig_uuid)
    node.jobs[777] = "infer-b"
    dry = ("mig", "apply", "-f", CONFIG, "-c", "all-7g.80gb", "--dry-run")
    code, out, err = gpuctl(capsys, node, *dry)
    assert code == 6, (out, err)
    assert "GPU 0: busy (16 steps would be refused)" in out
    assert "pid 777 (job infer-b)" in out and "destroy GPU instance" in out
    assert "GPU 1: differs" in out and "all-7g.80gb: busy" in out
    assert err.startswith("gpuctl: the apply would be refused")
    code, out, err = gpuctl(capsys, node, "--json", *dry)
    doc = json.loads(out)
    assert code == 6 and doc["result"] == "busy" and doc["dry_run"]
    error = json.loads(err)["error"]
    assert error["message"].startswith("the apply would be refused") and error["exit_code"] == 6
    assert [(g["gpu"], g["status"]) for g in doc["gpus"]] == [(0, "busy"), (1, "differs")]
    assert doc["gpus"][0]["steps"] and "pid 777" in doc["gpus"][0]["detail"]
    code, out, _ = gpuctl(capsys, node, *dry, "--force")
    assert code == 0 and "GPU 0: differs (16 steps would run)" in out

    node.sim.workloads.stop(777)
    node.sim.faults.not_supported(0, "processes")
    code, out, err = gpuctl(capsys, node, *dry)
    assert code == 11 and "GPU 0: faulty" in out and "cannot list its processes" in out
    assert err.startswith("gpuctl: faulty, left alone: GPU 0 (GPU-") and "cannot list" in err
    code, out, err = gpuctl(capsys, node, "--json", *dry)
    doc = json.loads(out)
    assert code == 11 and doc["result"] == "partial"
    assert json.loads(err)["error"]["exit_code"] == 11
    assert [(g["gpu"], g["status"]) for g in doc["gpus"]] == [(0, "faulty"), (1, "differs")]
    code, _, _ = gpuctl(capsys, node, "mig", "assert", "-f", CONFIG, "-c", "all-1g.10gb")
    assert code == 0  # the dry runs changed nothing


def test_show_keeps_the_instances_of_a_gpu_whose_mig_memory_cannot_be_read(
    capsys: pytest.CaptureFixture[str], node: Node
) -> None:
    """A driver error on the MIG devices' memory query alone: the instances, their processes
    and the profiles are shown, memory used as unknown with the reason; the GPU is no fault."""
    code, _, err = gpuctl(capsys, node, "mig", "apply", "-f", CONFIG, "-c", "all-1g.10gb")
    assert code == 0, err
    mig_uuid = node.mig.show()[0].instances[0].uuid
    node.sim.workloads.start(0, 777, 3 * GIB, 0.4, mig=mig_uuid)
    node.sim.faults.error(0, "mig_memory")
    code, out, _ = gpuctl(capsys, node, "mig", "show", "--profiles")
    assert code == 0, out
    header = next(line for line in out.splitlines() if line.startswith("GPU 0 "))
    assert "MIG on; 7x 1g.10gb" in header and "faulty" not in header
    assert "memory unknown: " in header and "Unknown Error" in header
    assert "processes unknown" not in header
    rows = [line for line in out.splitlines() if line.startswith("0 ")]
    assert len([r for r in rows if " ? / " in r]) == 7  # the instance rows
    assert mig_uuid is not None and mig_uuid in out and "777" in out
    code, out, _ = gpuctl(capsys, node, "--json", "mig", "show")
    gpu0 = json.loads(out)["gpus"][0]
    assert code == 0 and gpu0["fault"] == "" and len(gpu0["instances"]) == 7
    assert gpu0["profiles"]
    first = next(i for i in gpu0["instances"] if i["uuid"] == mig_uuid)
    assert first.get("memory_used_bytes") is None and "Unknown Error" in first["memory_unknown"]
    assert [p["pid"] for p in first["processes"]] == [777] and first["processes_unknown"] == ""
    node.sim.faults.clear(0)
    code, out, _ = gpuctl(capsys, node, "--json", "mig", "show")
    first = next(i for i in json.loads(out)["gpus"][0]["instances"] if i["uuid"] == mig_uuid)
    assert first["memory_unknown"] == "" and first["memory_used_bytes"] >= 3 * GIB


def test_show_names_gpu_instances_without_compute_instances(
    capsys: pytest.CaptureFixture[str], node: Node
) -> None:
    """An apply cut off between creating a GPU instance and its compute instance leaves the
    GPU instance on its own: ``gpuctl mig show`` shows it (as ``nvidia-smi mig -lgi``
    does) on the GPU's line and as a row without a compute instance, MIG device or UUID,
    and the GPU still differs from its layout; the other GPU is shown as it is."""
    node.sim.faults.crash_after_mutations(5)  # GPU 0: mode, GI, CI; GPU 1: mode, GI
    with pytest.raises(SimulatedCrash):
        node.mig.apply(load_config(Path(CONFIG)), "all-7g.80gb")
    node.mig.reconcile("report")
    code, out, err = gpuctl(capsys, node, "mig", "show")
    assert code == 0, err
    lines = out.splitlines()
    gpu0 = next(line for line in lines if line.startswith("GPU 0 "))
    gpu1 = next(line for line in lines if line.startswith("GPU 1 "))
    assert "MIG on; 1x 7g.80gb;" in gpu0 and "without" not in gpu0
    assert "no instances" not in gpu1, gpu1
    empty = "GPU instances without compute instances: 0"
    assert f"MIG on; no MIG devices; {empty}; desired: 1x 7g.80gb" in gpu1
    rows = [line.split() for line in lines if line.startswith(("0 ", "1 "))]
    assert [r[:3] for r in rows] == [["0", "0", "0"], ["1", "0", "none"]], rows
    assert rows[1][3:] == ["7g.80gb", "0:8", "-", "-", "-", "-"], rows
    code, out, _ = gpuctl(capsys, node, "--json", "mig", "show")
    doc = json.loads(out)["gpus"]
    assert code == 0 and [g["fault"] for g in doc] == ["", ""]
    assert doc[0]["layout"] == "1x 7g.80gb"
    assert doc[1]["layout"] == f"MIG enabled, no MIG devices; {empty}"
    (inst,) = doc[1]["instances"]
    assert inst["profile"] == "7g.80gb" and inst["uuid"] == ""
    assert inst["compute_instance_id"] is None and inst["mig"] is None
    # the GPU still differs from its layout, as before
    code, out, _ = gpuctl(capsys, node, "mig", "assert", "-f", CONFIG, "-c", "all-7g.80gb")
    assert code == 1
    assert f"GPU 1: has MIG enabled, no MIG devices; {empty}; wants 1x 7g.80gb" in out
    assert not any(line.startswith("GPU 0") for line in out.splitlines()), out


def test_forget_drops_the_layout_of_a_gpu_replaced_and_refuses_one_present(
    capsys: pytest.CaptureFixture[str], node: Node
) -> None:
    """A layout recorded for a GPU since replaced is reported ``missing`` with
    gpud_mig_layout_matches 0 for as long as it is kept: ``gpuctl mig forget`` drops it (a
    ``mig.forgotten`` event), the series with it. A UUID a GPU has now is refused, naming
    the GPU; one with no layout recorded is not found."""
    code, _, err = gpuctl(capsys, node, "mig", "apply", "-f", CONFIG, "-c", "all-balanced")
    assert code == 0, err
    MigStore(node.store).begin_apply(
        "all-disabled",
        {"GPU-replaced": (1, DeviceLayout(False, ()))},
        (),
        ApplyOptions(),
        0.0,
        inflight=False,
    )
    assert {o.uuid: o.status for o in node.mig.reconcile()}["GPU-replaced"] == "missing"

    def matches() -> dict[str, float]:
        return {
            s.labels["gpu_uuid"]: s.value
            for family in MigMetrics(node.mig)()
            if family.name == "gpud_mig_layout_matches"
            for s in family.samples
        }

    assert matches()["GPU-replaced"] == 0.0
    present = node.mig.show()[0].identity.uuid
    code, _, err = gpuctl(capsys, node, "mig", "forget", present)
    assert code == 6 and f"{present} is GPU 0 (H100-SXM5-80GB), present now" in err, err
    code, _, err = gpuctl(capsys, node, "mig", "forget", "GPU-unknown")
    assert code == 4 and "no MIG layout is recorded for GPU-unknown" in err, err
    code, out, err = gpuctl(capsys, node, "--json", "mig", "forget", "GPU-replaced")
    assert code == 0, err
    assert json.loads(out) == {
        "gpu_uuid": "GPU-replaced",
        "gpu": 1,
        "config_name": "all-disabled",
    }
    assert "GPU-replaced" not in node.mig.desired() and present in node.mig.desired()
    assert "GPU-replaced" not in matches()
    assert "GPU-replaced" not in {o.uuid for o in node.mig.reconcile()}
    forgotten = [e for e in node.events.recent() if e.kind == "mig.forgotten"]
    assert [e.fields for e in forgotten] == [
        {"gpu": 1, "uuid": "GPU-replaced", "config": "all-disabled", "gone": False}
    ]


def test_an_instance_with_many_processes_names_the_first_few_and_counts_the_rest() -> None:
    from gpud.cli.mig import _processes

    many = pb.MigInstance(
        processes=[pb.MigInstanceProcess(pid=100 + i, job="j" if i < 2 else "") for i in range(20)]
    )
    assert (
        _processes(many)
        == "100 (j), 101 (j), " + ", ".join(str(100 + i) for i in range(2, 8)) + ", ... (+12 more)"
    )
    assert _processes(pb.MigInstance()) == "-"
