"""Shipped stand-ins for NVIDIA programs on machines without a GPU.

``FAKE_MPS_CONTROL`` is the fake ``nvidia-cuda-mps-control`` (a python script, standard
library only); ``FAKE_MPS_CONTROL_BIN`` the same under the real program's name, executable,
for ``mps.control_binary`` with ``--simulate``.
"""

from __future__ import annotations

from pathlib import Path

FAKE_MPS_CONTROL = Path(__file__).with_name("fake_mps_control.py")
FAKE_MPS_CONTROL_BIN = Path(__file__).with_name("nvidia-cuda-mps-control")
