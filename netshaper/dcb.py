"""The NIC's DSCP -> priority map, for RDMA (RoCE v2) traffic.

An RDMA job's queue pairs carry its tag as traffic class (``NCCL_IB_TC = DSCP * 4``); the
NIC picks the egress priority (traffic class queue, ETS/strict scheduling, PFC) from the
packet's DSCP through its APP table. Re-prioritizing a job therefore rewrites one entry
of that table -- never the job.

Pure part: :func:`dscp_prio_map` (tags, levels, level -> NIC priority) and
:func:`map_changes` (current table vs wanted: only the entries that differ).

Backends (chosen once, from configuration):

* :class:`DcbAppBackend` runs iproute2's ``dcb``. It reads the table with
  ``dcb -j app show dev X dscp-prio`` (``{"dscp_prio": [[26, 3], ...]}``) and writes only
  entries that differ, in one ``dcb app replace dev X dscp-prio 26:3 34:5`` (``replace``
  drops any other priority the DSCP had). Entries for DSCPs gpud does not manage -- the
  congestion-notification DSCP, an operator's own -- are never touched.
* :class:`DryRunBackend` prints the same commands without running them, for a first
  rollout or a NIC managed by other tools; it remembers what it printed so it prints only
  changes.

:class:`NicMap` writes one map on every RoCE netdev (the daemon's RDMA port). What the
switches must do is in the README ("RDMA: the NIC's DSCP map and the switch side").
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Protocol

from netshaper import ethtool
from netshaper.ethtool import ARPHRD_LOOPBACK
from netshaper.tc_netlink import netns_socket

log = logging.getLogger(__name__)

DSCP_MAX = 63
PRIO_MAX = 7
DEFAULT_LEVEL_PRIOS = (7, 6, 5, 4, 3, 2, 1, 0)  # level 0 (highest) -> NIC priority 7


class DcbError(Exception):
    """Reading or writing one netdev's APP table failed. ``netdev``, ``command`` (the
    argv, as a string) and ``detail`` (what dcb said) name it.

    From :meth:`NicMap.apply`: ``failed`` names each netdev whose table was not written
    (its ``dcb`` failed, or it is the loopback) and ``written`` holds what the others'
    tables did not hold and were written, as :meth:`NicMap.apply` returns it. From one
    backend, ``failed`` is ``(netdev,)`` and ``written`` empty."""

    def __init__(
        self,
        netdev: str,
        message: str,
        *,
        command: str = "",
        detail: str = "",
        failed: Sequence[str] = (),
        written: Sequence[MapResult] = (),
    ) -> None:
        text = f"{netdev}: {message}"
        if detail:
            text += f": {detail}"
        super().__init__(text)
        self.netdev = netdev
        self.command = command
        self.detail = detail
        self.failed = tuple(failed) or (netdev,)
        self.written = tuple(written)


def dscp_prio_map(
    tags: Mapping[str, int], levels: Mapping[str, int], level_prios: Sequence[int]
) -> dict[int, int]:
    """DSCP -> NIC priority for every job with a tag and a level.

    ``level_prios[level]`` is the NIC priority of a level (configuration). Raises
    ValueError naming the job or level that does not fit.
    """
    for lvl, prio in enumerate(level_prios):
        if not 0 <= prio <= PRIO_MAX:
            raise ValueError(f"level_prios[{lvl}] must be in [0, {PRIO_MAX}], got {prio}")
    out: dict[int, int] = {}
    for job, lvl in sorted(levels.items()):
        dscp = tags.get(job)
        if dscp is None:
            raise ValueError(f"{job}: has level {lvl} but no DSCP tag")
        if not 0 <= dscp <= DSCP_MAX:
            raise ValueError(f"{job}: DSCP must be in [0, {DSCP_MAX}], got {dscp}")
        if not 0 <= lvl < len(level_prios):
            raise ValueError(
                f"{job}: level {lvl} has no NIC priority (level_prios has {len(level_prios)})"
            )
        out[dscp] = level_prios[lvl]
    return out


def map_changes(current: Mapping[int, Sequence[int]], want: Mapping[int, int]) -> dict[int, int]:
    """The entries of ``want`` the table does not hold exactly (a DSCP mapped to another
    priority, to several, or to none). DSCPs not in ``want`` are left alone."""
    return {d: p for d, p in sorted(want.items()) if tuple(current.get(d, ())) != (p,)}


def replace_args(netdev: str, changes: Mapping[int, int]) -> list[str]:
    """``dcb`` arguments writing ``changes`` in one command."""
    return [
        "app",
        "replace",
        "dev",
        netdev,
        "dscp-prio",
        *(f"{d}:{p}" for d, p in sorted(changes.items())),
    ]


@dataclass(frozen=True)
class MapResult:
    """What one apply did on one netdev: the entries written (DSCP -> priority), and
    what the APP table held for each of them before (``before``: DSCP -> the priorities
    ``dcb app show`` listed; a DSCP it did not list is absent). ``remade``: (its ifindex
    now, the one at the last write that held there) when the kernel made the netdev again
    since (a driver reset, a VF re-created: its table lost with it); None otherwise."""

    netdev: str
    changed: Mapping[int, int]
    before: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    remade: tuple[int, int] | None = None

    def lines(self) -> list[str]:
        """One line per entry written (``eth2: DSCP 26 -> prio 7 (was 3)``), for the log."""
        return [
            f"{self.netdev}: DSCP {d} -> prio {p} (was "
            + (",".join(map(str, self.before[d])) if self.before.get(d) else "none")
            + ")"
            for d, p in self.changed.items()
        ]


def _held(
    current: Mapping[int, tuple[int, ...]], changes: Mapping[int, int]
) -> dict[int, tuple[int, ...]]:
    return {d: current[d] for d in changes if current.get(d)}


class DscpMapBackend(Protocol):
    @property
    def netns(self) -> str | None:
        """The network namespace (``/run/netns/NAME``) whose netdevs the backend writes;
        None: this process's."""
        ...

    def current(self, netdev: str) -> dict[int, tuple[int, ...]]: ...

    def apply(self, netdev: str, want: Mapping[int, int]) -> MapResult: ...


Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)


def parse_app_json(text: str) -> dict[int, tuple[int, ...]]:
    """DSCP -> priorities from ``dcb -j app show`` output.

    iproute2 prints ``{"dscp_prio": [[DSCP, PRIO], ...]}``; objects with ``dscp`` and
    ``prio`` keys are accepted too.
    """
    data = json.loads(text or "{}")
    out: dict[int, list[int]] = {}
    for entry in data.get("dscp_prio", []) if isinstance(data, dict) else []:
        if isinstance(entry, list) and len(entry) == 2:
            dscp, prio = int(entry[0]), int(entry[1])
        elif isinstance(entry, dict):
            dscp, prio = int(entry["dscp"]), int(entry["prio"])
        else:
            raise ValueError(f"unexpected dscp_prio entry {entry!r}")
        out.setdefault(dscp, []).append(prio)
    return {d: tuple(sorted(p)) for d, p in sorted(out.items())}


def _verb(args: list[str]) -> str:
    words = [a for a in args if not a.startswith("-")]
    return " ".join(words[:2])  # "app show", "app replace"


class DcbAppBackend:
    """Writes the map with iproute2's ``dcb app`` (needs CAP_NET_ADMIN).

    ``dcb``: the program; ``netns``: run as ``dcb -n NETNS``; ``runner``: runs an argv
    (injectable for tests that do not fork).
    """

    def __init__(
        self, dcb: str = "dcb", *, netns: str | None = None, runner: Runner = _run
    ) -> None:
        self._netns = netns or None
        self._argv0 = [dcb, *(["-n", netns] if netns else [])]
        self._run = runner

    @property
    def netns(self) -> str | None:
        """``dcb -n NETNS``'s namespace; None: this process's."""
        return self._netns

    def _call(self, netdev: str, args: list[str]) -> str:
        argv = [*self._argv0, *args]
        try:
            r = self._run(argv)
        except (OSError, subprocess.SubprocessError) as err:
            raise DcbError(
                netdev, f"cannot run {argv[0]}", command=" ".join(argv), detail=str(err)
            ) from err
        if r.returncode != 0:
            said = (r.stderr or r.stdout).strip()
            if "Operation not supported" in said:  # EOPNOTSUPP from dcbnl: no DCB ops
                said += " (the netdev's driver has no DCB support)"
            raise DcbError(
                netdev,
                f"{_verb(args)} failed (exit {r.returncode})",
                command=" ".join(argv),
                detail=said,
            )
        return r.stdout

    def current(self, netdev: str) -> dict[int, tuple[int, ...]]:
        """The netdev's DSCP entries (``dcb -j app show dev NETDEV dscp-prio``)."""
        out = self._call(netdev, ["-j", "app", "show", "dev", netdev, "dscp-prio"])
        try:
            return parse_app_json(out)
        except (ValueError, KeyError, TypeError) as err:
            raise DcbError(netdev, "cannot parse dcb's JSON", detail=str(err)) from err

    def apply(self, netdev: str, want: Mapping[int, int]) -> MapResult:
        """Replace only the entries that differ; one ``dcb`` run, none when all match."""
        current = self.current(netdev)
        changes = map_changes(current, want)
        if changes:
            self._call(netdev, replace_args(netdev, changes))
        return MapResult(netdev, changes, _held(current, changes))


class DryRunBackend:
    """Prints the ``dcb`` commands instead of running them (``write`` gets each line)."""

    def __init__(self, write: Callable[[str], None] | None = None, *, dcb: str = "dcb") -> None:
        self._write = write or (lambda line: log.info("dry-run: %s", line))
        self._dcb = dcb
        self._shown: dict[str, dict[int, tuple[int, ...]]] = {}

    @property
    def netns(self) -> str | None:
        """Always this process's namespace: the printed commands carry no ``-n``."""
        return None

    def current(self, netdev: str) -> dict[int, tuple[int, ...]]:
        return dict(self._shown.get(netdev, {}))

    def apply(self, netdev: str, want: Mapping[int, int]) -> MapResult:
        current = self.current(netdev)
        changes = map_changes(current, want)
        if changes:
            self._write(" ".join([self._dcb, *replace_args(netdev, changes)]))
            shown = self._shown.setdefault(netdev, {})
            shown.update({d: (p,) for d, p in changes.items()})
        return MapResult(netdev, changes, _held(current, changes))


LinkType = Callable[[str], "int | None"]
"""A netdev's link type (the kernel's ``ARPHRD_*``), None where it cannot be read."""
IfIndex = Callable[[str], "int | None"]
"""A netdev's ifindex, None where it cannot be read."""


def _read_in(read: Callable[..., int | None], netns: str | None) -> Callable[[str], int | None]:
    """``read`` (an ioctl of :mod:`netshaper.ethtool`) as ``netns`` (None: this process's
    namespace) sees it: a name such as lb0 is the loopback, eth3 the netdev with its
    ifindex, only in the namespace dcb writes in."""
    if netns is None:
        return partial(read)
    opener = partial(netns_socket, netns, socket.AF_INET, socket.SOCK_DGRAM)
    return partial(read, open_socket=opener)


class NicMap:
    """The same DSCP -> priority map on every RoCE netdev: what the daemon drives.

    ``netdevs``: the netdevs whose map gpud owns (configuration, or
    ``rdma.roce_v2_targets`` of the discovered devices). Each netdev is tried; when some
    fail, the others are still written and one :class:`DcbError` names every failure.
    The loopback is refused under any name (``ip link set lo name lb0``), by its link
    type (``link_type``: the kernel's ``ARPHRD_LOOPBACK``, 772, unless given as the
    backend's network namespace sees it -- ``dcb -n NETNS``'s, else this process's --
    :func:`netshaper.ethtool.link_type`), read on every apply: it has no NIC, so nothing
    is run or printed for it. A backend that raises anything else on one netdev fails
    that netdev alone, as a :class:`DcbError` naming it.

    Each netdev's ifindex (``ifindex``, by default ``SIOCGIFINDEX`` in the same namespace
    as ``link_type``) is kept from the last write that held there: a netdev the kernel made
    again since comes back with another one, and its result says so (``remade``).
    """

    def __init__(
        self,
        backend: DscpMapBackend,
        netdevs: Sequence[str],
        *,
        link_type: LinkType | None = None,
        ifindex: IfIndex | None = None,
    ) -> None:
        if not netdevs:
            raise ValueError("NicMap needs at least one netdev")
        self._backend = backend
        self._netdevs = tuple(netdevs)
        self._link_type = link_type or _read_in(ethtool.link_type, backend.netns)
        self._ifindex = ifindex or _read_in(ethtool.ifindex, backend.netns)
        self._written_at: dict[str, int] = {}  # netdev -> its ifindex at its last write

    @property
    def netdevs(self) -> tuple[str, ...]:
        return self._netdevs

    def apply(self, dscp_priorities: Mapping[int, int]) -> list[MapResult]:
        """Write the map; returns what each netdev's APP table did not hold and was
        written (``dcb app replace``): one :class:`MapResult` per netdev that had any, none
        when every table held the map already."""
        for d, p in dscp_priorities.items():
            if not (0 <= d <= DSCP_MAX and 0 <= p <= PRIO_MAX):
                raise ValueError(f"DSCP {d} -> priority {p} is out of range")
        written: list[MapResult] = []
        failures: list[DcbError] = []
        for netdev in self._netdevs:
            if self._link_type(netdev) == ARPHRD_LOOPBACK:
                failures.append(
                    DcbError(
                        netdev,
                        f"the loopback (ARPHRD_LOOPBACK, type {ARPHRD_LOOPBACK}), named"
                        f" {netdev}: it has no NIC, so no DSCP -> priority map, and carries"
                        " no RDMA traffic; not written (list the RoCE netdevs in"
                        " traffic.rdma_interfaces)",
                    )
                )
                continue
            index = self._ifindex(netdev)
            try:
                result = self._backend.apply(netdev, dscp_priorities)
            except DcbError as err:
                failures.append(err)
                continue
            except Exception as err:
                # any failure is this netdev's alone: the ones written before and after
                # keep their results, which the caller needs to count write-backs
                failures.append(DcbError(netdev, "write failed", detail=f"{err!r}"))
                continue
            was = self._written_at.get(netdev)
            if index is not None:
                self._written_at[netdev] = index
                if was is not None and was != index:
                    result = replace(result, remade=(index, was))
            if result.changed:
                written.append(result)
        if failures:
            first = failures[0]
            names = ", ".join(f.netdev for f in failures)
            raise DcbError(
                names,
                f"{len(failures)} of {len(self._netdevs)} netdev(s) not written",
                command=first.command,
                detail=str(first),
                failed=[f.netdev for f in failures],
                written=written,
            )
        return written
