"""The alerting rules and the Grafana dashboard name only metrics that gpud exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from gpud.cluster.fencing import Mode
from gpud.telemetry.sampler import NOT_ANSWERING

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "docs" / "monitoring"
_METRIC = re.compile(r"\b(gpud_[a-z0-9_]+)")
# what prometheus_client appends to a family's name in the exposition
_SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_info")


def _declared_families() -> set[str]:
    """Every metric family name that appears as a string in gpud's code."""
    names = set()
    for path in (ROOT / "gpud").rglob("*.py"):
        names.update(re.findall(r"[\"'](gpud_[a-z0-9_]+)[\"']", path.read_text()))
    return names


def _family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _check_names(text: str, where: str) -> set[str]:
    declared = _declared_families()
    used = set(_METRIC.findall(text))
    unknown = {n for n in used if n not in declared and _family(n) not in declared}
    assert unknown == set(), f"{where} names metrics gpud does not export: {sorted(unknown)}"
    return used


def test_alert_rules_use_exported_metrics_and_say_what_to_do() -> None:
    text = (MONITORING / "gpud-alerts.yml").read_text()
    rules = yaml.safe_load(text)["groups"][0]["rules"]
    names = {r["alert"] for r in rules}
    assert names == {
        "GpudDown",
        "GpudLoopOverrunning",
        "GpuLost",
        "GpuUnhealthy",
        "GpuCriticalXid",
        "GpudSamplesStale",
        "GpuSamplesStale",
        "MigApplyFailed",
        "MigApplyUnfinished",
        "MigLayoutDiffers",
        "MpsDaemonDown",
        "TrafficNotEnforced",
        "TrafficJobsUntagged",
        "TrafficMarkingFailed",
        "TrafficRdmaMapFailed",
        "ClusterEtcdAlarm",
        "ClusterLeaderLost",
        "ClusterStoreDown",
        "ClusterCertificateExpiring",
    }
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    used = _check_names(text, "gpud-alerts.yml")
    assert len(used) >= 10


def _alert_expr(name: str) -> str:
    rules = yaml.safe_load((MONITORING / "gpud-alerts.yml").read_text())["groups"][0]["rules"]
    return str(next(r["expr"] for r in rules if r["alert"] == name))


def _reason_regex(expr: str) -> re.Pattern[str]:
    """The regex of the expression's ``reason`` matcher, anchored as Prometheus anchors it."""
    match = re.search(r'reason[=!]~"([^"]*)"', expr)
    assert match, expr
    return re.compile(match.group(1))


def test_a_hung_gpus_reasons_are_left_to_gpu_samples_stale() -> None:
    """The reasons gpud gives a hung GPU are the ones the rules exclude from GpuUnhealthy and
    keep for GpuSamplesStale, so a hung GPU pages once; another reason pages GpuUnhealthy."""
    hung = [
        NOT_ANSWERING,
        NOT_ANSWERING + "; last seen as GPU-1 (NVIDIA H100 80GB HBM3)",
        # gpud releases that reported a hung GPU as timed out once its call was 5 s old
        "driver call timed out after 5 s",
    ]
    unhealthy_unless = _reason_regex(_alert_expr("GpuUnhealthy"))
    stale_unless = _reason_regex(_alert_expr("GpuSamplesStale"))
    for reason in hung:
        assert unhealthy_unless.fullmatch(reason), reason
        assert stale_unless.fullmatch(reason), reason  # the regex of a !~: not excluded
    for reason in ("readings failed: Unknown Error", "power failed: Unknown Error"):
        assert not unhealthy_unless.fullmatch(reason), reason
        assert not stale_unless.fullmatch(reason), reason


@pytest.mark.parametrize("alert", ["ClusterLeaderLost", "ClusterStoreDown"])
def test_cluster_alerts_read_every_mode_without_a_leader(alert: str) -> None:
    """ClusterLeaderLost fires in those modes, and ClusterStoreDown leaves them to it."""
    match = re.search(r'gpud_cluster_mode\{mode=~"([^"]*)"\}', _alert_expr(alert))
    assert match
    without = re.compile(match.group(1))
    assert {m for m in Mode if without.fullmatch(m.value)} == {Mode.HOLDING, Mode.LOCAL}


def test_dashboard_uses_exported_metrics() -> None:
    text = (MONITORING / "gpud-dashboard.json").read_text()
    dashboard = json.loads(text)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) >= 20
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
    used = _check_names(text, "gpud-dashboard.json")
    assert len(used) >= 25
