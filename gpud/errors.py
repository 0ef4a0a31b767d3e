"""The one exception tree of gpud, and how each error surfaces to users.

::

    GpudError                      (exit 1, gRPC INTERNAL)
    ├── StoreRefused               etcd answers but refuses this node's call (login, keys)
    ├── ConfigError                bad config file or flag: names the file and key (exit 2)
    ├── StateError                 the state database cannot be opened now: lock, disk (exit 1)
    │   ├── StateDamaged           damaged or not gpud's: no restart mends it (gpud exits 65)
    │   └── StateUnwritable        it cannot be written now: disk full, I/O error (exit 3)
    │       └── StateInUse         another process holds its lock past the write's wait
    ├── InvalidArgument            a request field is wrong: names the field (exit 2)
    ├── NotFound                   a GPU, MIG device, job, ... does not exist (exit 4)
    │   └── LeftQueue              a waiting gpuctl run was taken out (gpuctl queue --leave)
    ├── AlreadyExists              (exit 5)
    ├── FailedPrecondition         refused in the current state, e.g. busy instance (exit 6)
    │   ├── Busy                   processes still run on what would be destroyed
    │   ├── NotLeader              a cluster node that does not lead; carries the leader it knows
    │   │   └── LeaderNotReady     it restarted within its previous run's lease: leads after it
    │   ├── DuplicateNode          a cluster node's name is reported by two gpuds
    │   └── ColocationOff          co-location is switched off ([colocate] enabled = false)
    ├── ResourceExhausted          over-subscription: carries the numbers (exit 7)
    ├── Unavailable                the daemon or a peer cannot be reached (exit 3)
    │   ├── StoreFull              etcd refuses writes: out of space (alarm NOSPACE)
    │   └── HandshakeFailed        the TLS handshake with a cluster peer failed
    ├── PermissionDenied           (exit 77)
    ├── Partial                    done for the GPUs that answer; faulty ones left alone (exit 11)
    └── BackendError               the GPU driver said no; carries the gpu index/uuid
        ├── NotSupported           the field or call is not supported on this device
        ├── GpuLost                the GPU fell off the bus
        ├── GpuFault               the GPU needs an operator: reset required, IRQ issue, power
        ├── NoPermission           the driver refused gpud's user (device nodes, root-only calls)
        ├── DriverTimeout          a driver call did not return in time
        ├── DriverNotLoaded        NVML cannot be initialised
        ├── InsufficientResources  MIG: no room for the instance
        ├── DeviceNotFound         the driver has no such device or instance
        └── InUse                  the driver refused: the device or instance is in use

Adapters translate native errors into this tree at the edge (``raise ... from err``).
``ERROR_TABLE`` maps each class to a gRPC status code name and a CLI exit code; the
gRPC server and gpuctl both read it. ``GPU_FAULTS`` are the errors that are the GPU's own
fault rather than one call's: caught together wherever a GPU, not a reading, is to be set
aside.
"""

from __future__ import annotations

from typing import Final


class GpudError(Exception):
    """Base of every error gpud raises on purpose."""


class ConfigError(GpudError):
    """A config file or flag is wrong. ``path`` and ``key`` name where."""

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None):
        where = ":".join(p for p in (path, key) if p)
        super().__init__(f"{where}: {message}" if where else message)
        self.message = message
        self.path = path
        self.key = key

    def in_file(self, path: str) -> ConfigError:
        """This error, naming ``path`` as the file it is in unless it names one already."""
        return self if self.path else ConfigError(self.message, path=path, key=self.key)


class StateError(GpudError):
    """The daemon's state database cannot be opened or is damaged; the message names it."""


class StateDamaged(StateError):
    """The state database's content is what SQLite or gpud refuses: damaged (SQLITE_CORRUPT,
    SQLITE_NOTADB, ``PRAGMA quick_check`` errors, a truncated file), another program's
    database, one read through another database's ``-wal``, a table without a column gpud
    declares, a directory in its place. Unlike a full disk or a lock another process holds,
    no restart mends it: an operator restores the file or moves it aside, so the daemon's
    start exits 65 (EX_DATAERR), which the unit does not restart."""


class StateUnwritable(StateError):
    """The state database cannot be written now (disk full, an I/O error, read only)."""


class StateInUse(StateUnwritable):
    """Another process (a sqlite3 shell, a backup tool) held the state database's lock
    past the wait of a write (SQLITE_BUSY): nothing of the change was kept,
    and a retry once it lets go can work."""


class InvalidArgument(GpudError):
    """A request field is wrong. ``field`` names it."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


class NotFound(GpudError):
    """Something named in a request does not exist."""


class LeftQueue(NotFound):
    """A ``gpuctl run`` waiting for co-location was taken out (``gpuctl queue --leave ID``)
    while it waited: nothing is to start. NOT_FOUND and exit 4 in the status, so that a
    gpuctl that does not know this class stops as for a removed job; gpuctl exits 1, as
    for a queued run taken out."""


class AlreadyExists(GpudError):
    """Something to be created exists already."""


class FailedPrecondition(GpudError):
    """Refused in the current state."""


class Busy(FailedPrecondition):
    """Processes still run where something would be destroyed.

    ``pids`` and ``jobs`` name them.
    """

    def __init__(self, message: str, *, pids: tuple[int, ...] = (), jobs: tuple[str, ...] = ()):
        super().__init__(message)
        self.pids = pids
        self.jobs = jobs


class NotLeader(FailedPrecondition):
    """A cluster node that does not lead refused what only the leader answers.

    ``leader`` and ``address`` name the leader it knows of ("" when none): a hint only
    (its view of etcd may be old), which travels in trailing metadata (``LEADER_KEY``,
    ``LEADER_ADDRESS_KEY``)."""

    def __init__(self, message: str, *, leader: str = "", address: str = ""):
        super().__init__(message)
        self.leader = leader
        self.address = address


class LeaderNotReady(NotLeader):
    """The node the leader key names refused a report: it restarted within its previous
    run's lease (or another gpud holds that key under its name), and leads once that lease
    expires. It names no other leader."""


class DuplicateNode(FailedPrecondition):
    """The leader refused a report: another gpud reports under the same ``cluster.node``
    (``node`` names it)."""

    def __init__(self, message: str, *, node: str = ""):
        super().__init__(message)
        self.node = node


class ColocationOff(FailedPrecondition):
    """The co-location loop is off (``[colocate] enabled = false``): it gives no advice, and
    ``gpuctl run`` places its job as the jobs service does."""


class ResourceExhausted(GpudError):
    """A request over-subscribes a resource; the message carries the numbers."""


class DscpPoolExhausted(ResourceExhausted):
    """Every DSCP tag of ``traffic.dscp_pool`` is held by a job in use: no placement of
    the job changes that, only a tag that frees. ``reason`` says why without the job's
    name (the same for every job refused with it), ``job`` names the job."""

    def __init__(self, reason: str, *, job: str = "") -> None:
        super().__init__(f"job {job!r}: {reason}" if job else reason)
        self.reason = reason
        self.job = job


class Unavailable(GpudError):
    """The daemon or a peer cannot be reached."""


class StoreFull(Unavailable):
    """etcd refuses writes until an operator frees space and disarms its NOSPACE alarm;
    reads and lease renewals still work."""


class HandshakeFailed(Unavailable):
    """The TLS handshake with a cluster peer failed: the certificates are not signed by
    the same cluster CA, do not name their node, or are not valid now."""


class StoreRefused(GpudError):
    """etcd answers but refuses this node's call: its login, a call without one, the
    user's keys, or another refusal in etcd's words; the message says what to change."""


class PermissionDenied(GpudError):
    """The caller may not do this."""


class Partial(GpudError):
    """A node-wide command was done for the GPUs that answer while faulty ones (lost, not
    answering) were left alone: gpuctl prints the result and exits with this code."""


class BackendError(GpudError):
    """The GPU driver refused or failed a call.

    ``gpu`` is the GPU index (or None when not about one GPU), ``uuid`` its UUID when known,
    ``call`` the driver function, ``code`` the driver's numeric error code.
    """

    def __init__(
        self,
        message: str,
        *,
        gpu: int | None = None,
        uuid: str | None = None,
        call: str | None = None,
        code: int | None = None,
    ):
        super().__init__(message)
        self.gpu = gpu
        self.uuid = uuid
        self.call = call
        self.code = code


class NotSupported(BackendError):
    """The device or driver does not support this field or call."""


class GpuLost(BackendError):
    """The GPU is lost (fell off the bus, needs a reset)."""


class GpuFault(BackendError):
    """The GPU answers, but needs an operator before it can be used: it requires a reset
    (NVML_ERROR_RESET_REQUIRED), the kernel saw an interrupt issue (IRQ_ISSUE), its external
    power cables are not attached (INSUFFICIENT_POWER), its infoROM is corrupted.
    ``problem`` says which, in a few words ("reset required")."""

    def __init__(
        self,
        message: str,
        *,
        problem: str,
        gpu: int | None = None,
        uuid: str | None = None,
        call: str | None = None,
        code: int | None = None,
    ):
        super().__init__(message, gpu=gpu, uuid=uuid, call=call, code=code)
        self.problem = problem


class NoPermission(BackendError):
    """The driver refused gpud's user (NVML_ERROR_NO_PERMISSION): a device node it may not
    open, or a call only root may make (MIG changes, some counters and clocks)."""


class DriverTimeout(BackendError):
    """A driver call did not complete in time."""


class DriverNotLoaded(BackendError):
    """NVML cannot be initialised: no driver, or no library."""


class InsufficientResources(BackendError):
    """MIG: no room for the requested instance."""


class DeviceNotFound(BackendError):
    """The driver has no such device, MIG device or instance (NVML_ERROR_NOT_FOUND)."""


class InUse(BackendError):
    """The driver refused because something still uses the device or instance (NVML_ERROR_IN_USE)."""


GPU_FAULTS: Final[tuple[type[BackendError], ...]] = (GpuLost, GpuFault, DriverTimeout)
"""Driver errors that make the whole GPU faulty, as opposed to one reading missing or one
step refused: lost, in need of an operator (reset required, interrupt issue, insufficient
power, corrupted infoROM), hung. A GPU that raises one is shown as faulty with why, left
alone, and the other GPUs go on."""

READING_FAULTS: Final[tuple[type[BackendError], ...]] = (GpuLost, GpuFault)
"""Of :data:`GPU_FAULTS`, those a reading's call answers for the whole GPU: lost, or in need
of an operator. NVML_ERROR_TIMEOUT (:class:`DriverTimeout`) belongs to calls given a timeout
(``nvmlEventSetWait``), so on a reading it is that reading's error alone; a GPU hung in a
reading is found by the call not returning (see :mod:`gpud.telemetry.sampler`)."""


# Trailing metadata of a failed gRPC call: the error class, and the exit code gpuctl uses.
ERROR_KEY: Final = "gpud-error"
EXIT_CODE_KEY: Final = "gpud-exit-code"
# ... and of a NotLeader: the leader the refusing node knows of, and where it listens
LEADER_KEY: Final = "gpud-leader"
LEADER_ADDRESS_KEY: Final = "gpud-leader-address"

# class -> (gRPC status code name, CLI exit code). Most specific class wins (MRO order).
ERROR_TABLE: Final[dict[type[GpudError], tuple[str, int]]] = {
    GpudError: ("INTERNAL", 1),
    ConfigError: ("INVALID_ARGUMENT", 2),
    InvalidArgument: ("INVALID_ARGUMENT", 2),
    Unavailable: ("UNAVAILABLE", 3),
    StateUnwritable: ("UNAVAILABLE", 3),
    NotFound: ("NOT_FOUND", 4),
    AlreadyExists: ("ALREADY_EXISTS", 5),
    FailedPrecondition: ("FAILED_PRECONDITION", 6),
    ResourceExhausted: ("RESOURCE_EXHAUSTED", 7),
    PermissionDenied: ("PERMISSION_DENIED", 77),
    Partial: ("UNAVAILABLE", 11),
    BackendError: ("INTERNAL", 8),
    NotSupported: ("UNIMPLEMENTED", 9),
    InsufficientResources: ("RESOURCE_EXHAUSTED", 7),
    GpuLost: ("UNAVAILABLE", 10),
    GpuFault: ("UNAVAILABLE", 10),
    NoPermission: ("PERMISSION_DENIED", 77),
    DeviceNotFound: ("NOT_FOUND", 4),
    InUse: ("FAILED_PRECONDITION", 6),
}


def classify(err: GpudError) -> tuple[str, int]:
    """The gRPC status code name and CLI exit code for ``err``."""
    for cls in type(err).__mro__:
        if cls in ERROR_TABLE:
            return ERROR_TABLE[cls]
    return ERROR_TABLE[GpudError]
