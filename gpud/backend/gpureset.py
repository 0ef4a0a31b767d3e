"""GPU reset through ``nvidia-smi --gpu-reset -i N``: NVML has no reset call.

:func:`nvidia_smi_reset` builds the ``reset`` runner :class:`gpud.backend.nvml.NvmlBackend`
takes; the composition root injects it. The program runner is itself a parameter, so the
translation of nvidia-smi's answers is tested without the program.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence

from gpud.errors import BackendError, DriverTimeout, InUse, NotSupported

RunProgram = Callable[[Sequence[str], float], tuple[int, str]]
"""``(argv, timeout_s) -> (exit status, stdout and stderr)``; raises ``FileNotFoundError``
when the program is missing and ``subprocess.TimeoutExpired`` when it runs too long."""

RESET_TIMEOUT_S = 120.0


def run_program(argv: Sequence[str], timeout_s: float) -> tuple[int, str]:
    proc = subprocess.run(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    return proc.returncode, proc.stdout


def nvidia_smi_reset(
    run: RunProgram = run_program,
    *,
    binary: str = "nvidia-smi",
    timeout_s: float = RESET_TIMEOUT_S,
) -> Callable[[int], None]:
    """A runner resetting GPU ``N`` with ``nvidia-smi --gpu-reset -i N``. It raises
    :class:`InUse` when nvidia-smi says the GPU is in use (processes, or another client
    holding it open), :class:`DriverTimeout` past ``timeout_s``, :class:`NotSupported` when
    nvidia-smi is missing, :class:`BackendError` with its output otherwise."""

    def reset(gpu: int) -> None:
        argv = [binary, "--gpu-reset", "-i", str(gpu)]
        command = " ".join(argv)
        try:
            code, output = run(argv, timeout_s)
        except FileNotFoundError as err:
            raise NotSupported(f"cannot reset GPU {gpu}: {binary} not found", gpu=gpu) from err
        except subprocess.TimeoutExpired as err:
            raise DriverTimeout(
                f"{command} did not finish within {timeout_s:g} s", gpu=gpu, call=command
            ) from err
        if code == 0:
            return
        text = " ".join(output.split())
        if "in use" in text.lower():
            raise InUse(f"GPU {gpu} cannot be reset: {text}", gpu=gpu, call=command)
        raise BackendError(
            f"{command} failed (exit {code}): {text}", gpu=gpu, call=command, code=code
        )

    return reset
