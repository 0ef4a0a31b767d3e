"""The jobs' cgroup directories as the jobs' users meet them."""

from __future__ import annotations

import os
from pathlib import Path

from gpud.net.cgroups import JobCgroups
from tests.unit.other_user import as_nobody, needs_root


def test_directories_are_0755_whatever_the_umask(open_dir: Path) -> None:
    """Under the unit's UMask=0027 mkdir makes 0750: gpud's and the job's directories are
    0755 all the same, as systemd makes cgroups; another cgroup above is left as it is."""
    mount = open_dir / "unified"
    (mount / "system.slice").mkdir(parents=True, mode=0o700)
    cgroups = JobCgroups(mount, parent="system.slice/gpud/jobs", nft_root=open_dir)
    umask = os.umask(0o027)
    try:
        path = cgroups.ensure("train")
    finally:
        os.umask(umask)
    assert path == mount / "system.slice/gpud/jobs/gpud-job-train"
    modes = {p.relative_to(mount): p.stat().st_mode & 0o777 for p in (path, *path.parents[:3])}
    assert modes == {
        Path("system.slice/gpud/jobs/gpud-job-train"): 0o755,
        Path("system.slice/gpud/jobs"): 0o755,
        Path("system.slice/gpud"): 0o755,
        Path("system.slice"): 0o700,
    }


def test_an_earlier_runs_directories_are_opened(open_dir: Path) -> None:
    """Those a gpud of an earlier version made 0750 are 0755 once a job is placed again."""
    cgroups = JobCgroups(open_dir / "unified", nft_root=open_dir)
    (cgroups.dir("train")).mkdir(parents=True, mode=0o750)
    cgroups.base.chmod(0o750)
    cgroups.ensure("train")
    assert cgroups.base.stat().st_mode & 0o777 == cgroups.dir("train").stat().st_mode & 0o777
    assert cgroups.base.stat().st_mode & 0o777 == 0o755


@needs_root
def test_a_job_of_another_user_reads_its_own_cgroup(open_dir: Path) -> None:
    """A job's process (user nobody) reads its cgroup's files, as ``cat
    /sys/fs/cgroup/gpud/gpud-job-train/memory.max`` in the job would."""
    cgroups = JobCgroups(open_dir / "unified", nft_root=open_dir)
    cgroups.mount.mkdir(mode=0o755)  # the cgroup2 mount
    umask = os.umask(0o027)
    try:
        path = cgroups.ensure("train")
    finally:
        os.umask(umask)
    (path / "memory.max").write_text("max\n")
    (path / "memory.max").chmod(0o644)  # as cgroupfs shows it
    assert as_nobody(lambda: 0 if (path / "memory.max").read_text() == "max\n" else 1) == 0
