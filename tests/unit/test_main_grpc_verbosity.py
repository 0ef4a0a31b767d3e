"""gpud quiets gRPC's per-handshake lines by setting ``GRPC_VERBOSITY`` in ``main()``;
gRPC reads it when grpc is first imported, so importing gpud's entry point must not load it."""

from __future__ import annotations

import subprocess
import sys


def test_importing_gpuds_entry_point_loads_no_grpc_so_its_verbosity_setting_holds() -> None:
    out = subprocess.run(
        [sys.executable, "-c", "import sys, gpud.main; print('grpc' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"
