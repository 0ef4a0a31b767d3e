"""What the API needs from the rest of the daemon, as small Protocols and plain values.

The servicers depend on these, never on the daemon's concrete classes, so the composition
root wires them (``Sampler.latest``, ``EventLog``, the simulated node's fault injector) and
tests pass hand-built values.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpud import __version__
from gpud.events import Event, Watcher
from gpud.net.port import TrafficSummary
from gpud.telemetry.snapshot import Snapshot

SnapshotSource = Callable[[], Snapshot | None]
"""The latest telemetry snapshot, or None before the first sampling tick (``Sampler.latest``)."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """What does not change while the daemon runs: known at start by the composition root.

    ``started_monotonic`` is on the same clock the servicer is given (``time.monotonic`` by
    default), so uptime is ``clock() - started_monotonic``.
    """

    backend: str  # "sim" or "nvml"
    driver_version: str
    gpu_count: int
    simulated: bool
    started_monotonic: float
    hostname: str = field(default_factory=socket.gethostname)
    version: str = __version__
    build: str = ""  # the code's digest (gpud.build.current()), computed at start
    reload: ReloadState | None = None  # the config file's reloads; None: not reloadable
    state_files: StateFiles | None = None  # what gpud cannot write; None: not known
    # why systemd may kill gpud while its loop still moves (gpud.daemon.config_watchdog_warning
    # of the running config); "" when the gap fits or systemd does not watch gpud
    watchdog_warning: str = ""


@dataclass(frozen=True, slots=True)
class ReloadState:
    """The config file's reloads (SIGHUP), for ``gpuctl status``: whether the config gpud
    runs is the file's. ``last_monotonic`` is on the servicer's clock."""

    reloads: int = 0  # acted on since start, failed ones included
    last_monotonic: float | None = None  # when the latest one ran; None before the first
    error: str = ""  # why the latest failed (the running config is the one before); "" if not
    restart_needed: tuple[str, ...] = ()  # changed keys kept at their values until a restart
    # keys the file changed since start that a flag sets over it ("daemon.log_level changed
    # in /etc/gpud/gpud.toml but --log-level overrides it"): the file's value is not used
    overridden: tuple[str, ...] = ()
    # the file is not the one last read (edited, replaced, removed, created): what gpud runs
    # may not be what it says, until a reload (systemctl reload gpud)
    file_changed: bool = False


@dataclass(frozen=True, slots=True)
class StateFiles:
    """Whether the state database and the event log take gpud's writes, for ``gpuctl
    status``: without it the operator sees only log lines and a counter."""

    state_db: str  # the database's path
    event_log: str  # events.jsonl's path; "" when there is none
    # why the latest change to the database was refused, and when (the servicer's clock);
    # "" and None while changes are written
    state_db_error: str = ""
    state_db_error_monotonic: float | None = None
    event_log_error: str = ""  # why the file's writes fail; "" while they succeed
    event_log_lines_missing: int = 0  # events the file lacks since they began to fail
    # writes not ended (a hung disk fails none): the event log's lines not yet in the file
    # and when its write under way began, and when the database's transaction under way
    # began (the servicer's clock); 0 and None while none runs
    event_log_lines_queued: int = 0
    event_log_write_monotonic: float | None = None
    state_db_write_monotonic: float | None = None


NodeInfoSource = Callable[[], NodeInfo]


TrafficSource = Callable[[], TrafficSummary]


class EventSource(Protocol):
    """The structured event log as the API reads and writes it (:class:`gpud.events.EventLog`)."""

    def recent(
        self, limit: int = 100, kind_prefix: str = "", *, gpu: str = "", job: str = ""
    ) -> list[Event]: ...

    def emit(self, kind: str, message: str, **fields: Any) -> Event: ...

    def watch(
        self,
        wake: Callable[[], None],
        *,
        limit: int = 100,
        kind_prefix: str = "",
        gpu: str = "",
        job: str = "",
        after_seq: int = 0,
        after_time: float = 0.0,
        buffer: int = ...,
    ) -> tuple[Watcher, list[Event], int]: ...

    def take(self, watcher: Watcher) -> tuple[list[Event], int, bool]: ...

    def unwatch(self, watcher: Watcher) -> None: ...


class FaultPort(Protocol):
    """Fault injection into the simulated node (the sim's ``FaultInjector``).

    Only a simulated daemon has one; a daemon on real NVML passes ``None`` and the API refuses
    injections with FAILED_PRECONDITION. Calls may take the simulated driver's lock, so the
    API makes them off the event loop. Return values of the mutators are ignored.
    """

    def lose(self, gpu: int) -> object:
        """The GPU falls off the bus: every call on it raises ``GpuLost``."""
        ...

    def reset_required(self, gpu: int) -> object:
        """The GPU requires a reset: every query that reaches it raises ``GpuFault``."""
        ...

    def not_supported(self, gpu: int, field: str) -> object:
        """Reads of ``field`` (e.g. "power") on the GPU raise ``NotSupported``."""
        ...

    def error(self, gpu: int, reading: str) -> object:
        """Reads of ``reading`` (e.g. "mig_memory") on the GPU fail with a driver error."""
        ...

    def slow(self, gpu: int, seconds: float) -> object:
        """Every driver call on the GPU takes ``seconds`` longer (a hung driver)."""
        ...

    def slow_mig(self, gpu: int, seconds: float) -> object:
        """Each call that changes MIG on the GPU takes ``seconds`` longer; reads do not."""
        ...

    def xid(self, gpu: int, code: int) -> object:
        """Raise an XID event with ``code`` on the GPU."""
        ...

    def clear(self, gpu: int) -> object:
        """Remove every fault on the GPU."""
        ...

    def active(self) -> object:
        """The faults in force now: a mapping (shown as ``key: value``) or a collection of
        faults (each shown with ``str()``)."""
        ...


class SimProcessView(Protocol):
    """A simulated compute process (the sim's ``Workload``): what ``nvidia-smi`` lists under
    "Processes" for it."""

    @property
    def pid(self) -> int: ...
    @property
    def gpu(self) -> int: ...
    @property
    def gpu_instance_id(self) -> int | None:
        """None: it runs on the whole GPU (and so for ``compute_instance_id``)."""
        ...

    @property
    def compute_instance_id(self) -> int | None: ...
    @property
    def used_memory_bytes(self) -> int: ...
    @property
    def sm_ratio(self) -> float: ...


class WorkloadPort(Protocol):
    """Simulated compute processes (the sim's ``Workloads``); None on real NVML."""

    def start(
        self, gpu: int, pid: int, used_memory_bytes: int, sm_ratio: float, mig: int | str | None
    ) -> bool:
        """``pid`` runs on the GPU (or its MIG device), using that memory and SM share:
        whether it ends when host process ``pid`` exits (one runs now)."""
        ...

    def stop(self, pid: int) -> bool:
        """Stop ``pid``; False when it was not running."""
        ...

    def list(self) -> Sequence[SimProcessView]:
        """The simulated processes now running, by PID."""
        ...
