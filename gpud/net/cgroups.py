"""One cgroup v2 directory per job, so nftables can mark the job's packets by cgroup.

``gpuctl run`` starts a job's command in ``<cgroup2 mount>/<parent>/gpud-job-<name>``
(``/sys/fs/cgroup/gpud/gpud-job-train-a`` on a pure cgroup-v2 host,
``/sys/fs/cgroup/unified/gpud/...`` on a hybrid one): gpud, as root, writes the command's
PID to that directory's ``cgroup.procs`` before the command runs, and every process it
forks stays there. The name also lets job attribution find GPU processes by cgroup.

nft resolves a ``socket cgroupv2`` path relative to ``/sys/fs/cgroup`` whatever the mount,
so the mount is found in ``/proc/self/mountinfo`` and the rule's path and level derived
from it (:meth:`JobCgroups.mark`). ``ip netns exec`` remounts ``/sys`` and hides the cgroup2
mount: run gpud in a namespace with ``nsenter --net=`` instead.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from gpud.errors import FailedPrecondition, NotFound
from netshaper.nftables import CgroupMark

PREFIX = "gpud-job-"
NFT_CGROUP_ROOT = Path("/sys/fs/cgroup")


def find_cgroup2(mountinfo: Path = Path("/proc/self/mountinfo")) -> Path | None:
    """The cgroup2 mount point (the first one), or None when cgroup v2 is not mounted."""
    try:
        text = mountinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields = left.split()
        if right.split()[:1] == ["cgroup2"] and len(fields) >= 5:
            return Path(fields[4].replace("\\040", " "))
    return None


class JobCgroups:
    """The jobs' cgroup directories under ``mount / parent``: ``<prefix><name>`` each.

    ``nft_root`` is where nft resolves cgroup paths (``/sys/fs/cgroup``); tests pass a
    temporary tree for both. ``prefix``: ``gpud-job-`` for jobs; the MPS control daemons
    have cgroups of their own beside them (``gpud-mps-<uuid>``, :mod:`gpud.mps.manager`),
    which no job listing sees.
    """

    def __init__(
        self,
        mount: Path,
        *,
        parent: str = "gpud",
        nft_root: Path = NFT_CGROUP_ROOT,
        prefix: str = PREFIX,
    ):
        self.mount = mount
        self.base = mount / parent
        self.nft_root = nft_root
        self.prefix = prefix

    def dir(self, job: str) -> Path:
        return self.base / f"{self.prefix}{job}"

    def ensure(self, job: str) -> Path:
        """The job's directory, made with those above it up to the mount where missing.

        gpud's and the jobs' directories are 0755 whatever gpud's umask, as systemd makes
        cgroups: a job reads its own cgroup's files (``memory.max``, ``cpu.max``,
        ``cgroup.procs``; JVMs and other runtimes size themselves by them), and under the
        unit's ``UMask=0027`` they would be 0750, closed to every job's user."""
        path = self.dir(job)
        under = [d for d in path.parents if self.mount in d.parents]  # those of `parent`
        missing = [d for d in under if not d.is_dir()]
        path.mkdir(parents=True, exist_ok=True)
        for directory in (*missing, self.base, path):
            directory.chmod(0o755)
        return path

    def place(self, job: str, pid: int) -> Path:
        """Move ``pid`` (and nothing else) into the job's cgroup."""
        path = self.ensure(job)
        try:
            (path / "cgroup.procs").write_text(f"{pid}\n")
        except ProcessLookupError:
            raise NotFound(f"no process {pid}") from None
        except OSError as err:
            if err.errno == errno.ESRCH:
                raise NotFound(f"no process {pid}") from None
            raise FailedPrecondition(
                f"cannot move process {pid} into {path}: {err.strerror or err}"
            ) from err
        return path

    def jobs(self) -> list[str]:
        """Jobs that have a cgroup directory."""
        try:
            names = os.listdir(self.base)
        except OSError:
            return []
        return sorted(n[len(self.prefix) :] for n in names if n.startswith(self.prefix))

    def busy(self, job: str) -> bool:
        """Whether a process is in the job's cgroup (its ``cgroup.procs`` lists one)."""
        return bool(self.pids(job))

    def pids(self, job: str) -> list[int]:
        """The processes in the job's cgroup (none when it has no directory)."""
        try:
            text = (self.dir(job) / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split() if p.isdigit()]

    def remove(self, job: str) -> bool:
        """Remove the job's cgroup; False while processes remain in it (or it is gone)."""
        try:
            self.dir(job).rmdir()
        except OSError:
            return False
        return True

    def mark(self, job: str, dscp: int) -> CgroupMark | None:
        """The nftables mark for the job's cgroup, or None when it has no directory or the
        cgroup2 mount is outside ``nft_root`` (nft could not resolve the path)."""
        path = self.dir(job)
        try:
            inode = path.stat().st_ino
            rel = path.relative_to(self.nft_root)
            level = len(path.relative_to(self.mount).parts)
        except (OSError, ValueError):
            return None
        return CgroupMark(job=job, dscp=dscp, path=str(rel), level=level, cgroup_id=inode)
