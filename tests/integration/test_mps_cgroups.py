"""MPS control daemons in cgroups of their own, on this host's cgroup v2 mount (root): the
daemon is moved as soon as it started, the server it spawns later starts there, and the
directory goes once the daemon is stopped for good. Everything made is removed."""

from __future__ import annotations

import contextlib
import os
import uuid as uuidlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpud.mps.manager import CGROUP_PREFIX
from gpud.net.cgroups import JobCgroups, find_cgroup2
from tests.unit.mps_support import gpu_sample, gpu_uuid, make_manager, short_dir, snapshot


def _cgroup_of(pid: int) -> str:
    """The process's cgroup v2 path (the ``0::`` line)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    return ""


@pytest.fixture
def cgroups() -> Iterator[JobCgroups]:
    mount = find_cgroup2()
    if mount is None or os.geteuid() != 0:
        pytest.skip("needs root and a cgroup v2 mount")
    parent = f"gpud-test-{uuidlib.uuid4().hex[:8]}"
    groups = JobCgroups(mount, parent=parent, prefix=CGROUP_PREFIX)
    try:
        yield groups
    finally:
        for child in sorted(groups.base.glob(f"{CGROUP_PREFIX}*")):
            with contextlib.suppress(OSError):
                child.rmdir()
        with contextlib.suppress(OSError):
            groups.base.rmdir()


def test_a_daemon_and_its_servers_run_in_its_own_cgroup(cgroups: JobCgroups) -> None:
    with short_dir() as root:
        mgr, store, _ = make_manager(root, cgroups=cgroups)
        try:
            mgr.reconcile(snapshot(gpu_sample(0)))
            (status,) = mgr.status()
            assert status.up and status.pid is not None
            own = "/" + str(cgroups.dir(gpu_uuid(0)).relative_to(cgroups.mount))
            assert _cgroup_of(status.pid) == own
            (server,) = mgr.start_server("0", os.getuid())
            assert _cgroup_of(server) == own  # spawned by the daemon: in its cgroup
            assert sorted(cgroups.pids(gpu_uuid(0))) == sorted([status.pid, server])
            mgr.leave()  # gpud's stop: it stays, and so does its cgroup
            assert cgroups.jobs() == [gpu_uuid(0)]
            mgr.stop()  # stopped for good: the cgroup goes
            assert not cgroups.dir(gpu_uuid(0)).exists()
        finally:
            mgr.stop()
            store.close()
