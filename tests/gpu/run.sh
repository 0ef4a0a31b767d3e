#!/usr/bin/env bash
# The real-GPU checks, in one go, on a machine with an NVIDIA driver: read-only NVML queries,
# a read-only daemon run and an MPS control daemon started through gpud (no MIG mode,
# compute mode, clock or power-limit changes, no resets).
#
#   tests/gpu/run.sh                      # in .venv, made with pip (needs a package index)
#   tests/gpu/run.sh --python python3 [--wheels DIR]
#       with an interpreter that already has gpud's dependencies (a GPU image without a
#       package index), after installing any wheels in DIR offline; gpud and gpuctl run
#       from this checkout.
# Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
python=""
wheels=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python | --wheels)
            if [[ $# -lt 2 ]]; then
                echo "tests/gpu/run.sh: $1 needs a value" >&2
                exit 2
            fi
            if [[ "$1" == --python ]]; then python="$2"; else wheels="$2"; fi
            shift 2 ;;
        *) break ;;
    esac
done
if [[ -n "$wheels" ]] && ! compgen -G "$wheels/*.whl" > /dev/null; then
    echo "tests/gpu/run.sh: --wheels $wheels: no .whl files there" >&2
    exit 2
fi
if [[ -n "$python" ]] && ! command -v "$python" > /dev/null; then
    echo "tests/gpu/run.sh: --python $python: no such program" >&2
    exit 2
fi
nvidia-smi -L || true
if [[ -z "$python" ]]; then
    if [[ ! -x .venv/bin/python ]]; then
        python3 -m venv .venv
        .venv/bin/python -m pip install -q --upgrade pip
        .venv/bin/python -m pip install -q -e . --group dev
    fi
    exec .venv/bin/python -m pytest -v -m gpu tests/gpu "$@"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
path="$PWD"
if [[ -n "$wheels" ]]; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --target "$work/site" "$wheels"/*.whl
    path="$PWD:$work/site"
fi
interpreter=$(command -v "$python")
mkdir "$work/bin"
for entry in gpud:gpud.main gpuctl:gpud.cli.main; do
    printf '#!%s\nimport sys\nfrom %s import main\nsys.exit(main())\n' \
        "$interpreter" "${entry#*:}" > "$work/bin/${entry%%:*}"
    chmod +x "$work/bin/${entry%%:*}"
done
PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" GPUD_TEST_BIN="$work/bin" \
    "$python" -m pytest -v -m gpu -p no:cacheprovider tests/gpu "$@"
