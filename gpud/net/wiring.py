"""Builds the traffic service with its real backends (called once, by the daemon).

* tc: :class:`netshaper.tc_netlink.TcNetlink` in the daemon's own network namespace,
  opened before the gRPC server starts (opening a netlink socket may fork).
* marking: :class:`netshaper.nftables.NftablesMarker` and the jobs' cgroups under the
  cgroup2 mount found in ``/proc/self/mountinfo``. Without cgroup v2 or ``nft`` the service
  runs without marking and says why (``gpuctl net show``); tagged traffic is still shaped.
* RDMA: the configured ``traffic.rdma_backend`` (none, dcb, dry-run).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from gpud.config import Config
from gpud.events import EventLog
from gpud.jobs.ends import RunEnd
from gpud.jobs.placement import Reservation
from gpud.jobs.registry import JobSpec
from gpud.jobs.service import JobService
from gpud.net.cgroups import JobCgroups, find_cgroup2
from gpud.net.enforce import MarkPort, RdmaPort, TcPort
from gpud.net.service import TrafficService, job_pool
from gpud.net.shaped import ShapedInterfaces
from gpud.net.shaped import ensure_schema as ensure_shaped_schema
from gpud.net.tagstore import TagStore, has_empty_item, reserved_in_pool, shown_pool
from gpud.store import StateStore

log = logging.getLogger(__name__)


def open_traffic(
    config: Config,
    store: StateStore,
    events: EventLog,
    jobs: JobService,
    *,
    mountinfo: Path = Path("/proc/self/mountinfo"),
    which: Callable[[str], str | None] = shutil.which,
    config_path: str = "",
) -> TrafficService:
    """The traffic service, its warnings about ``config`` logged (``config_path``: the file
    they name, :func:`config_warnings`)."""
    t = config.traffic
    tags = TagStore(store, pool=job_pool(t))
    for warning in config_warnings(config, path=config_path):
        log.warning("%s", warning)
    tc: TcPort | None = None
    marker: MarkPort | None = None
    cgroups: JobCgroups | None = None
    rdma: RdmaPort | None = None
    rdma_error = ""
    marking_error = ""
    if not t.enabled:
        # no tree is put on, but the tables are checked as when it is: mark_ours follows
        ensure_shaped_schema(store)
    if t.enabled:
        from netshaper.tc_netlink import TcNetlink

        tc = TcNetlink()
        if t.marking:
            mount = find_cgroup2(mountinfo)
            nft = which("nft")
            if mount is None:
                marking_error = (
                    "cgroup v2 is not mounted here (under `ip netns exec` it is hidden:"
                    " use nsenter --net=)"
                )
            elif nft is None:
                marking_error = "nft not found (install the nftables package)"
            else:
                from netshaper.nftables import NftablesMarker, subprocess_runner

                cgroups = JobCgroups(mount, parent=t.cgroup_parent)
                marker = NftablesMarker(runner=subprocess_runner(nft))
        else:
            marking_error = "off (traffic.marking = false)"
        rdma, rdma_error = open_rdma(config)
    if marking_error and t.enabled and t.marking:
        log.warning("traffic marking by cgroup unavailable: %s", marking_error)

    def registered() -> list[str]:
        return jobs.registry.names()

    def active() -> set[str]:
        """The jobs holding a reservation, read through ``store.transaction()``: the
        writer's lock, so the read takes its turn with the writes and sees every release
        and reservation said to the service (``run_ended``, ``run_started``: inside their
        transactions) before it began, committed or rolled back. The tick's sequence
        numbers rely on it: a run end or start counted before the read is in it. Never
        ``store.reading()``, whose snapshot holds only what was committed: a release said
        but not yet committed would read as held."""
        return {r.job for r in jobs.reservations.held()}

    service = TrafficService(
        t,
        tags=tags,
        events=events,
        jobs=registered,
        active=active,
        tc=tc,
        marker=marker,
        cgroups=cgroups,
        rdma=rdma,
        shaped=ShapedInterfaces(store) if t.enabled else None,
        marking_error=marking_error,
        rdma_error=rdma_error,
    )

    def ended(what: str, reservation: Reservation, spec: JobSpec, end: RunEnd | None) -> None:
        # `gpuctl net show` says a job whose run ended is done, not stopped
        if what == "release":
            # inside the release's transaction: the read sees it gone, and no other run's
            service.run_ended(
                reservation.job,
                end.since_end_s if end is not None else 0.0,
                others_held=bool(jobs.reservations.held(reservation.job)),
            )
        elif what == "reserve":
            service.run_started(reservation.job)

    if t.enabled:  # the tick forgets what it keeps of removed jobs; off, none runs
        jobs.add_observer(ended)
    return service


def config_warnings(config: Config, *, path: str = "") -> list[str]:
    """What the traffic settings take but an operator should hear of: reserved DSCPs named in
    ``traffic.dscp_pool`` (left out, never a job's tag), an empty item in it (skipped),
    ``traffic.level_priorities`` that defeat the levels. Said at start and by ``gpud
    --check-config``; none with traffic off. ``path``: the config file, named as an error
    about it would name it (``FILE:traffic.dscp_pool``)."""
    t = config.traffic
    if not t.enabled:
        return []
    out = []
    where = f"{path}:traffic.dscp_pool" if path else "traffic.dscp_pool"
    if has_empty_item(t.dscp_pool):
        # taken, as gpud always has (a pool that loaded before must not stop gpud at its
        # next start), but never silently: "10,,34" most likely lost a DSCP
        out.append(
            f"{where}: {shown_pool(t.dscp_pool)} has an empty item (nothing between two"
            " commas, or before or after them), skipped: a DSCP left out?"
        )
    left_out = reserved_in_pool(t.dscp_pool, {*t.reserved_dscp, t.cnp_dscp})
    if left_out:
        # accepted as the docs say (reserved values are left out), but never silently:
        # an operator who listed 46 expects a job to get it
        why = [
            f"{d} (in traffic.reserved_dscp)" if d in t.reserved_dscp else f"{d} (traffic.cnp_dscp)"
            for d in left_out
        ]
        out.append(
            f"{where}: {shown_pool(t.dscp_pool)} names reserved DSCPs, left out of the pool and"
            f" never a job's tag: {', '.join(why)}"
        )
    odd = level_priorities_warning(t.level_priorities)
    if odd:
        out.append(f"{path}:{odd}" if path else odd)  # FILE:traffic.level_priorities
    return out


def level_priorities_warning(priorities: Sequence[int]) -> str:
    """What defeats the levels in ``traffic.level_priorities`` (the NIC priority of each
    level, in the RDMA DSCP map), or "". Level 0 holds the slowest jobs, so each level should
    get a lower NIC priority than the one before it (the default, 7 - level, does): two
    levels on one priority are not told apart on RDMA, and a level above the one before it
    turns the order round. Accepted all the same (it may be meant), but never silently."""
    prios = list(priorities)
    if len(prios) > 1 and len(set(prios)) == 1:
        return (
            f"traffic.level_priorities = {prios} maps every level to NIC priority {prios[0]}:"
            " levels would not be distinguished on RDMA"
        )
    odd = []
    for level in range(1, len(prios)):
        before, now = prios[level - 1], prios[level]
        if now == before:
            odd.append(f"levels {level - 1} and {level} share NIC priority {now}")
        elif now > before:
            odd.append(f"level {level} gets NIC priority {now}, above level {level - 1}'s {before}")
    if not odd:
        return ""
    return (
        f"traffic.level_priorities = {prios}: {'; '.join(odd)} (level 0 holds the slowest"
        " jobs: each level should get a lower NIC priority than the one before it, as the"
        " default 7 - level does, or RDMA traffic does not follow the levels)"
    )


def open_rdma(
    config: Config,
    *,
    sysfs_root: str = "/sys",
    link_type: Callable[[str], int | None] | None = None,
) -> tuple[RdmaPort | None, str]:
    """The NIC DSCP -> priority map ``traffic.rdma_backend`` names, on
    ``traffic.rdma_interfaces`` or, when that is empty, on every netdev behind a RoCE v2
    GID (pyverbs discovery, or ``/sys/class/infiniband``). Returns the port (None: no map
    to keep) and, when one was asked for but cannot be kept, why. ``link_type``: a
    netdev's ``ARPHRD_*`` (None: as gpud's network namespace sees it), which keeps the
    loopback under any name out of the map."""
    t = config.traffic
    if t.rdma_backend == "none":
        return None, ""
    from netshaper.dcb import DcbAppBackend, DryRunBackend, NicMap
    from netshaper.rdma import roce_v2_targets
    from netshaper.rdma_verbs import open_discovery

    netdevs = list(t.rdma_interfaces)
    if not netdevs:
        netdevs = [x.netdev for x in roce_v2_targets(open_discovery(sysfs_root).devices())]
    if not netdevs:
        why = "no RoCE v2 netdev found: set traffic.rdma_interfaces"
        log.warning("traffic.rdma_backend = %r: %s", t.rdma_backend, why)
        return None, why
    backend = DcbAppBackend() if t.rdma_backend == "dcb" else DryRunBackend()
    log.info("RDMA DSCP -> priority map (%s) on %s", t.rdma_backend, ", ".join(netdevs))
    return NicMap(backend, netdevs, link_type=link_type), ""
