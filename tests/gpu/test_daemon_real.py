"""gpud on the real driver, read-only: it starts, lists every GPU with live readings and
serves metrics that pass promtool. No MIG layout is desired and MPS stays off, so the daemon
changes nothing on the GPUs."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.integration.conftest import start_daemon, stop_daemon

pytestmark = pytest.mark.gpu


def test_daemon_lists_real_gpus(real_nvml: Any, tmp_path: Path) -> None:
    count = real_nvml.nvmlDeviceGetCount()
    daemon = start_daemon(tmp_path / "g", config_text='[mig]\non_start = "report"\n')
    try:
        listed = json.loads(daemon.gpuctl("gpus", "--json").stdout)["gpus"]
        assert len(listed) == count
        for gpu in listed:
            assert gpu["uuid"].startswith("GPU-")
            assert gpu["healthy"], gpu["reason"]
            assert gpu["memory"]["total_bytes"] > 0
        status = json.loads(daemon.gpuctl("status", "--json").stdout)
        assert status["backend"] == "nvml"
        promtool = shutil.which("promtool")
        if promtool:
            result = subprocess.run(
                [promtool, "check", "metrics"],
                input=daemon.metrics(),
                capture_output=True,
                text=True,
                check=False,
            )
            assert result.returncode == 0, result.stdout + result.stderr
    finally:
        assert stop_daemon(daemon) == 0
