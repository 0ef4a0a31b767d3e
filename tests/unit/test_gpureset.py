"""nvidia-smi --gpu-reset as the NVML adapter's reset runner: its answers, translated."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import pytest

from gpud.backend.gpureset import nvidia_smi_reset
from gpud.errors import BackendError, DriverTimeout, InUse, NotSupported


class Program:
    def __init__(self, code: int = 0, output: str = "", error: BaseException | None = None):
        self.calls: list[tuple[list[str], float]] = []
        self._answer = (code, output)
        self._error = error

    def __call__(self, argv: Sequence[str], timeout_s: float) -> tuple[int, str]:
        self.calls.append((list(argv), timeout_s))
        if self._error is not None:
            raise self._error
        return self._answer


def test_runs_nvidia_smi_gpu_reset_on_the_gpu() -> None:
    program = Program(0, "GPU 00000000:07:00.0 was successfully reset.\nAll done.\n")
    nvidia_smi_reset(program, timeout_s=90)(3)
    assert program.calls == [(["nvidia-smi", "--gpu-reset", "-i", "3"], 90)]


def test_a_gpu_in_use_is_in_use() -> None:
    text = (
        "The following GPUs could not be reset:\n  GPU 00000000:07:00.0: In use by another"
        " client\n\n1 device is currently being used by one or more other processes"
    )
    with pytest.raises(InUse, match=r"GPU 2 cannot be reset: .*In use by another client") as info:
        nvidia_smi_reset(Program(255, text))(2)
    assert info.value.gpu == 2


def test_other_failures_carry_the_output_and_status() -> None:
    with pytest.raises(BackendError, match=r"exit 3\): Insufficient Permissions") as info:
        nvidia_smi_reset(Program(3, "Insufficient Permissions\n"))(0)
    assert info.value.code == 3 and not isinstance(info.value, InUse)


def test_missing_program_and_timeouts() -> None:
    with pytest.raises(NotSupported, match="nvidia-smi not found"):
        nvidia_smi_reset(Program(error=FileNotFoundError("nvidia-smi")))(0)
    timeout = subprocess.TimeoutExpired(["nvidia-smi"], 120)
    with pytest.raises(DriverTimeout, match="did not finish within 120 s"):
        nvidia_smi_reset(Program(error=timeout))(0)
