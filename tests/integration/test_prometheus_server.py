"""The shipped alerting rules in a real Prometheus server scraping a real gpud.

``promtool test rules`` (test_alerts.py) feeds the rules series it synthesizes; here
``prometheus`` scrapes a simulated gpud every second and evaluates the rules every second, as
an operator's server does (``rule_files: [gpud-alerts.yml]``, a job named ``gpud``): every
rule evaluates without error on what gpud really exports (``/api/v1/rules``), a lost GPU pages
once, by GpuLost, and a SIGKILL and restart of gpud neither resolve it nor page it again (its
``activeAt`` in ``/api/v1/alerts`` stays the same), while GpudDown goes pending.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.conftest import (
    RunningDaemon,
    free_port,
    start_daemon,
    stop_daemon,
    terminate,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "monitoring" / "gpud-alerts.yml"
NODE = "H100-SXM5-80GB:2"


@dataclass
class PrometheusServer:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as resp:
            body = json.loads(resp.read().decode())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query", query=expr)["result"]
        return result

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self.api("rules")["groups"] for rule in group["rules"]]

    def alerts(self, gpu: str | None = None) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return [a for a in found if gpu is None or a["labels"].get("gpu") == gpu]


def start_prometheus(root: Path, target: str) -> PrometheusServer:
    root.mkdir(parents=True)
    config = root / "prometheus.yml"
    config.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "  evaluation_interval: 1s\n"
        f"rule_files: [{json.dumps(str(RULES))}]\n"
        "scrape_configs:\n"
        "  - job_name: gpud\n"
        "    static_configs:\n"
        f"      - targets: [{json.dumps(target)}]\n"
    )
    port = free_port()
    log = root / "prometheus.log"
    prometheus = shutil.which("prometheus")
    assert prometheus, "prometheus is required (Debian package prometheus)"
    with log.open("wb") as log_file:
        proc = subprocess.Popen(
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=root,
        )
    server = PrometheusServer(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"{server.url}/-/ready", timeout=2) as resp:
                if resp.status == 200:
                    return server
        except OSError:
            pass
        time.sleep(0.2)
    terminate(proc)
    raise AssertionError(f"prometheus did not start:\n{log.read_text()}")


def wait_for(what: str, predicate: Callable[[], object], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in {timeout:.0f} s: {what}"
        time.sleep(0.25)


@dataclass
class Setup:
    root: Path
    prometheus: PrometheusServer
    daemons: list[RunningDaemon]  # each gpud started, the latest last: all stopped at the end


@pytest.fixture
def setup() -> Iterator[Setup]:
    """A simulated gpud scraped by a real prometheus, in a temporary directory removed at the
    end with both stopped, pass or fail."""
    root = Path(tempfile.mkdtemp(prefix="gpud-prom-"))
    daemons: list[RunningDaemon] = []
    server = None
    try:
        daemons.append(start_daemon(root / "gpud", "--simulate", NODE))
        server = start_prometheus(root / "prometheus", f"127.0.0.1:{daemons[0].metrics_port}")
        yield Setup(root, server, daemons)
    finally:
        if server is not None:
            terminate(server.proc)
        for daemon in daemons:
            stop_daemon(daemon)
        shutil.rmtree(root, ignore_errors=True)


def wait_scraped(server: PrometheusServer, expr: str) -> None:
    wait_for(f"{expr} in prometheus", lambda: server.query(expr), timeout=20)


def rule_names() -> list[str]:
    """The rules docs/monitoring/gpud-alerts.yml defines: every one is loaded and evaluated."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule.get("alert") or rule["record"] for group in groups for rule in group["rules"]]


def up(server: PrometheusServer) -> float | None:
    found = server.query('up{job="gpud"}')
    return float(found[0]["value"][1]) if found else None


def assert_rules_healthy(server: PrometheusServer) -> None:
    """Every rule evaluated, without error (a vector with two series of the same labels, a
    many-to-many match, ...)."""
    rules = server.rules()
    assert len(rules) == len(rule_names()), [r["name"] for r in rules]
    bad = [
        (r["name"], r["health"], r.get("lastError"))
        for r in rules
        if r["health"] != "ok" or r.get("lastError")
    ]
    assert not bad, bad


def evaluations(server: PrometheusServer) -> list[str]:
    return [group["lastEvaluation"] for group in server.api("rules")["groups"]]


def settle(server: PrometheusServer, seconds: float = 3.0) -> None:
    """A few scrapes and evaluations, then one more evaluation: what the server shows next
    follows them."""
    time.sleep(seconds)
    before = evaluations(server)
    wait_for(
        "a rule evaluation",
        lambda: all(a != b for a, b in zip(evaluations(server), before, strict=True)),
        timeout=10,
    )


def firing(server: PrometheusServer, name: str, gpu: str) -> dict[str, Any] | None:
    found = [
        a for a in server.alerts(gpu) if a["labels"]["alertname"] == name and a["state"] == "firing"
    ]
    assert len(found) <= 1, found
    return found[0] if found else None


def test_a_lost_gpu_pages_once_through_a_gpud_restart(setup: Setup) -> None:
    server, gpud = setup.prometheus, setup.daemons[0]
    wait_for('up{job="gpud"} == 1', lambda: up(server) == 1.0)
    settle(server)
    assert_rules_healthy(server)
    assert server.alerts() == [], server.alerts()

    gpud.gpuctl("sim", "fault", "--gpu", "1", "lost")
    wait_for("GpuLost firing for GPU 1", lambda: firing(server, "GpuLost", "1"), timeout=20)
    # the XID 79 it raised falling off the bus is scraped too: GpuCriticalXid stays silent
    wait_scraped(server, 'gpud_gpu_critical_xid_uncleared{gpu="1",xid="79"}')
    settle(server)
    lost = firing(server, "GpuLost", "1")
    assert lost is not None
    assert [a["labels"]["alertname"] for a in server.alerts("1")] == ["GpuLost"]
    assert server.alerts("0") == []
    assert_rules_healthy(server)

    # gpud killed: its series go stale, the scrapes fail; the alert holds, GpudDown pends
    gpud.proc.send_signal(signal.SIGKILL)
    gpud.proc.wait(timeout=10)
    wait_for('up{job="gpud"} == 0', lambda: up(server) == 0.0)
    settle(server)
    assert up(server) == 0.0
    assert server.query('gpud_gpu_unhealthy_info{gpu="1"}') == []  # stale: the hold is what fires
    held = firing(server, "GpuLost", "1")
    assert held is not None, server.alerts()
    assert held["activeAt"] == lost["activeAt"]
    down = [a for a in server.alerts() if a["labels"]["alertname"] == "GpudDown"]
    assert [a["state"] for a in down] == ["pending"], down  # for: 2m
    assert [a["labels"]["alertname"] for a in server.alerts("1")] == ["GpuLost"]
    assert_rules_healthy(server)

    # restarted on the same directories and port: the GPU is still lost (device state of
    # the simulated node), and the alert that fired goes on, not paged again
    stop_daemon(gpud)
    gpud = start_daemon(setup.root / "gpud", "--simulate", NODE, metrics_port=gpud.metrics_port)
    setup.daemons.append(gpud)
    listed = {g["index"]: g for g in json.loads(gpud.gpuctl("gpus", "--json").stdout)["gpus"]}
    assert listed[1]["healthy"] is False and "lost" in str(listed[1]["reason"]).lower()
    wait_for('up{job="gpud"} == 1 again', lambda: up(server) == 1.0)
    wait_scraped(server, 'gpud_gpu_unhealthy_info{gpu="1"}')
    settle(server)
    again = firing(server, "GpuLost", "1")
    assert again is not None, server.alerts()
    assert again["activeAt"] == lost["activeAt"], (lost, again)
    assert again["labels"] == lost["labels"], (lost, again)
    assert [a["labels"]["alertname"] for a in server.alerts("1")] == ["GpuLost"]
    assert not [a for a in server.alerts() if a["labels"]["alertname"] == "GpudDown"]
    assert_rules_healthy(server)

    # back on the bus: GpuLost resolves; the XID 79 it raised stays uncleared, the GPU
    # unhealthy for it in gpud's eyes (`gpuctl gpus`), so GpuCriticalXid pages it until a
    # reset or `gpuctl xid clear`, which resolves it at once
    gpud.gpuctl("sim", "fault", "--gpu", "1", "clear")
    wait_for("GpuLost resolved", lambda: firing(server, "GpuLost", "1") is None, timeout=20)
    wait_for("GpuCriticalXid firing", lambda: firing(server, "GpuCriticalXid", "1"), timeout=20)
    settle(server)
    assert [(a["labels"]["alertname"], a["labels"].get("xid")) for a in server.alerts("1")] == [
        ("GpuCriticalXid", "79")
    ]
    assert_rules_healthy(server)
    gpud.gpuctl("xid", "clear", "1", "--xid", "79")
    wait_for("no alert left", lambda: server.alerts() == [], timeout=20)
    settle(server)
    assert server.alerts() == []
    assert_rules_healthy(server)
