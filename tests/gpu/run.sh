#!/usr/bin/env bash
# The real-GPU checks, in one go, on a machine with an NVIDIA driver: read-only NVML queries
# and a read-only daemon run (no MIG or MPS changes, no clocks, power limits or resets).
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ ! -x .venv/bin/python ]]; then
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e . --group dev
fi
nvidia-smi -L || true
exec .venv/bin/python -m pytest -v -m gpu tests/gpu "$@"
