#!/usr/bin/env bash
# Set up this checkout on a fresh Debian machine (as root): Debian packages and a virtual
# environment in .venv with gpud installed in editable mode.
#   tools/setup.sh          runtime only
#   tools/setup.sh --dev    plus what the tests need (pytest, ruff, mypy, iperf3, promtool, etcd, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
dev=0
[[ "${1:-}" == "--dev" ]] && dev=1

apt_pkgs=(python3-venv iproute2 nftables)
if (( dev )); then
    apt_pkgs+=(iperf3 prometheus etcd-server etcd-client systemd procps python3-pyverbs)
fi
missing=()
for p in "${apt_pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if (( ${#missing[@]} )); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "setup: need root to install Debian packages: ${missing[*]}" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # etcd and prometheus start services on install; tests start their own instances.
    made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
        made_policy=1
    fi
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    if (( made_policy )); then rm -f /usr/sbin/policy-rc.d; fi
fi

python=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
    "$python" -m venv .venv
fi
# pip's output goes to a log, shown only when it fails.
log=$(mktemp /tmp/gpud-setup.XXXXXX)
trap 'rm -f "$log"' EXIT
pip_install() {
    if ! .venv/bin/python -m pip install -q "$@" >"$log" 2>&1; then
        cat "$log" >&2
        echo "setup: pip install $* failed" >&2
        exit 1
    fi
}
pip_install --upgrade pip
# pyverbs is not on PyPI: rdma-core's Debian binding (python3-pyverbs), when installed, is
# made importable from .venv alone (not every system package) if it was built for its Python.
verbs=/usr/lib/python3/dist-packages/pyverbs
suffix=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
if compgen -G "$verbs/*$suffix" >/dev/null; then
    mkdir -p .venv/rdma-core
    ln -sfn "$verbs" .venv/rdma-core/pyverbs
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$PWD/.venv/rdma-core" >"$site/rdma-core.pth"
fi
if (( dev )); then
    pip_install -e . --group dev
else
    pip_install -e .
fi
