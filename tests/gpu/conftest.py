"""Real-GPU tests: they need NVML and a GPU, and skip cleanly without them.

Read-only by rule: NVML queries only. Nothing here changes MIG mode, compute mode, clocks or
power limits, or resets a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def real_nvml() -> Iterator[Any]:
    """The ``pynvml`` module, initialised; skips the test when there is no driver or GPU."""
    try:
        import pynvml
    except ImportError:
        pytest.skip("pynvml (nvidia-ml-py) is not installed")
    try:
        pynvml.nvmlInit()
    except Exception as err:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        pytest.skip(f"NVML is not available here: {err}")
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            pytest.skip("NVML sees no GPU")
        yield pynvml
    finally:
        pynvml.nvmlShutdown()
