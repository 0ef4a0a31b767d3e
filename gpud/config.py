"""gpud's configuration: ``/etc/gpud/gpud.toml``, defaults for everything, flags on top.

Every section and key is declared by the dataclasses below; the file may set any subset.
An unknown section or key, or a value of the wrong type or out of range, stops start-up (or
a reload) with a :class:`~gpud.errors.ConfigError` naming the file and the dotted key. See
``docs/configuration.md`` for the reference.

Every numeric key declares its allowed range where it is declared (:func:`ranged`), and
:func:`validate` checks them all; a numeric key without a range is refused by the tests.
"""

from __future__ import annotations

import contextlib
import dataclasses
import grp
import ipaddress
import math
import os
import re
import stat
import tomllib
import types
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from gpud import files
from gpud.errors import ConfigError
from gpud.shared import MAX_DRAIN_SECONDS, MAX_XID, read_regular

DEFAULT_PATH = Path("/etc/gpud/gpud.toml")
DEFAULT_SIMULATE = "H100-SXM5-80GB:8"

# sun_path holds 108 bytes, the last a NUL
MAX_UNIX_PATH = 107

N = TypeVar("N", int, float)
RANGE = "range"  # field metadata key: (low, high), both allowed


def ranged(default: N, low: N, high: N) -> N:
    """A numeric key's default and its allowed range ``low <= value <= high``.

    Bounds keep values the daemon can act on: a timeout of 1e10 s overflows the event loop's
    timers, a history of 1e11 samples the memory.
    """
    return field(default=default, metadata={RANGE: (low, high)})


@dataclass(frozen=True)
class DaemonConfig:
    state_dir: Path = Path("/var/lib/gpud")
    run_dir: Path = Path("/run/gpud")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    tick_s: float = ranged(1.0, 0.01, 3600.0)  # reconcile loop period


@dataclass(frozen=True)
class BackendConfig:
    kind: Literal["nvml", "sim"] = "nvml"
    simulate: str = DEFAULT_SIMULATE  # PRODUCT:COUNT,... when kind = "sim"


# XIDs an application causes (the Kubernetes device plugin's list): they leave the GPU
# healthy. Every other XID marks it unhealthy until a reset or `gpuctl xid clear`.
DEFAULT_IGNORED_XIDS = (13, 31, 43, 45, 68, 109)


@dataclass(frozen=True)
class TelemetryConfig:
    interval_s: float = ranged(1.0, 0.01, 3600.0)
    history: int = ranged(60, 1, 86_400)  # samples kept per GPU
    call_timeout_s: float = ranged(5.0, 0.01, 600.0)
    # each item within the range
    ignored_xids: tuple[int, ...] = field(
        default=DEFAULT_IGNORED_XIDS, metadata={RANGE: (1, MAX_XID)}
    )


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True
    address: str = "127.0.0.1:9400"


@dataclass(frozen=True)
class ApiConfig:
    socket: Path | None = None  # default: <run_dir>/gpud.sock
    socket_group: str = ""  # group allowed to use the socket; "" keeps the daemon's group
    tcp_address: str = ""  # "HOST:PORT" to also serve gRPC on TCP; "" disables
    # what TCP serves: "read" (queries and jobs' own reports) or "full" (every call)
    tcp_access: Literal["read", "full"] = "read"


@dataclass(frozen=True)
class MigConfig:
    on_start: Literal["reconcile", "report"] = "reconcile"
    drain_timeout_s: float = ranged(300.0, 0.0, MAX_DRAIN_SECONDS)


@dataclass(frozen=True)
class MpsConfig:
    enabled: bool = False
    control_binary: str = "nvidia-cuda-mps-control"


@dataclass(frozen=True)
class AdmissionConfig:
    enabled: bool = True  # queue jobs that cannot start now; false: run fails as before
    backfill: bool = True  # start later jobs that cannot delay the head of the queue
    max_queue: int = ranged(1000, 1, 100_000)  # queued jobs at most
    # job history the quotes are estimated from
    history_window_s: float = ranged(7 * 86400.0, 60.0, 366 * 86400.0)
    # job history rows kept: the newest, and those of runs still running
    history_keep: int = ranged(100_000, 100, 10_000_000)
    mig_config: Path | None = None  # mig-parted file whose configs are offered as remedies


@dataclass(frozen=True)
class ColocateConfig:
    """The co-location loop (colocate library): planner, shadow prices and SLO guard."""

    enabled: bool = True
    tick_s: float = ranged(5.0, 0.1, 3600.0)  # co-location loop period
    # fraction of each GPU's memory never planned (half or more would leave the plan nothing)
    memory_headroom: float = ranged(0.05, 0.0, 0.49)
    # no job predicted slower than 1/max_slowdown of alone
    max_slowdown: float = ranged(2.0, 1.0, 10.0)
    max_jobs_per_gpu: int = ranged(3, 1, 16)
    # guard throttles when p99 is within this fraction of the SLO, gives duty back under
    # (1 - 2 * margin) of it: half or more, never
    slo_margin: float = ranged(0.2, 0.01, 0.49)
    guard_decrease: float = ranged(0.5, 0.01, 0.99)  # duty multiplied by this on SLO pressure
    guard_increase: float = ranged(0.1, 0.001, 1.0)  # duty added back per calm tick
    min_duty: float = ranged(0.05, 0.001, 1.0)  # the guard's floor before it evicts training
    # a service's declared peak must hold with the training beside it at this duty (the
    # guard's cut at a burst); below min_duty, min_duty counts
    peak_duty: float = ranged(0.25, 0.001, 1.0)
    # how much a training job's speed counts by its SM activity in the gain that ranks
    # sharing (0: normalized progress only; 1: SM work only)
    activity_weight: float = ranged(0.75, 0.0, 1.0)
    latency_window_s: float = ranged(10.0, 1.0, 3600.0)  # p99 over this many seconds of reports
    # the predictor forgets an error kept on scant evidence (under 30 errors of its kind)
    # after this many seconds of the loop's ticks; 0: never (see docs/colocate.md)
    scant_margin_memory_s: float = ranged(900.0, 0.0, 30 * 86400.0)
    # a gpuctl run that has waited this long and fits nowhere has a GPU held for it, as a
    # run of a job the loop evicted has at once; 0: only the latter (see docs/colocate.md)
    head_hold_s: float = ranged(0.0, 0.0, 30 * 86400.0)


@dataclass(frozen=True)
class TrafficConfig:
    """Traffic enforcement (``[traffic]``); see docs/configuration.md."""

    enabled: bool = False
    interfaces: tuple[str, ...] = ()  # enforce here, never on any other interface
    link_rates: tuple[str, ...] = ()  # "IF=RATE" ("eth0=100gbit"); default: sysfs speed
    dscp_pool: str = ""  # "10-30,34"; "" = every DSCP not reserved below
    reserved_dscp: tuple[int, ...] = field(
        default=(0, 8, 16, 24, 32, 40, 46, 48, 56), metadata={RANGE: (0, 63)}
    )
    cnp_dscp: int = ranged(
        48, 0, 63
    )  # the congestion-notification DSCP (RoCE CNPs): never a job's tag
    levels: int = ranged(4, 2, 8)
    min_share: float = ranged(0.02, 0.0, 0.24)
    default_share: float = ranged(0.02, 0.001, 0.5)
    # each level-0 job leaf's guaranteed fraction of the link: a rate HTB takes up once the
    # leaf's tokens allow, where a changed prio waits for the leaf's queue to drain; 0 =
    # none beyond any leaf's
    top_share: float = ranged(0.0, 0.0, 0.9)
    threshold: float = ranged(0.1, 0.0, 10.0)
    hysteresis: float = ranged(0.02, 0.0, 0.99)
    # jobs whose progress rates are this close (relative) share a level; 0 = never
    group_tolerance: float = ranged(0.0, 0.0, 1.0)
    # inside a level, HTB shares by demand (bytes per iteration / T*) rather than equally
    weigh_by_demand: bool = True
    max_age_s: float = ranged(10.0, 0.1, 86400.0)
    progress_window_s: float = ranged(20.0, 0.1, 86400.0)
    # the rate a job is ranked by is the geometric mean of the window's rate and its rate
    # over this span (a job that fell behind is paid back); 0 = the window's rate alone
    progress_long_window_s: float = ranged(300.0, 0.0, 7 * 86400.0)
    # that long-run rate's exponent in the mean: 0.5 the plain geometric mean, 1 the
    # long-run rate alone (a job's deficit is all that ranks it)
    progress_long_weight: float = ranged(0.5, 0.0, 1.0)
    # once the window holds this many iterations, a job's open iteration is averaged with
    # them (a job that waited one tick is not taken for the slowest); 0 = the open one alone
    progress_stall_iterations: int = ranged(8, 0, 1000)
    # a job with no progress for this many of its usual spacings between progress points
    # is stopped (SIGSTOP, a debugger), not slowed: the gap counts up to there, no further
    progress_gap_spacings: float = ranged(20.0, 2.0, 1000.0)
    idle_after_s: float = ranged(
        60.0, 1.0, 86400.0
    )  # a job without a reservation or report for this long is idle
    future_tolerance_s: float = ranged(5.0, 0.0, 3600.0)
    shutdown: Literal["fail-static", "restore"] = "fail-static"
    marking: bool = True  # nftables: set the DSCP of `gpuctl run` jobs by cgroup
    cgroup_parent: str = "gpud"  # under the cgroup2 mount
    rdma_backend: Literal["none", "dcb", "dry-run"] = "none"
    rdma_interfaces: tuple[str, ...] = ()  # netdevs whose DSCP -> priority map gpud owns
    # level -> NIC priority; default 7 - level
    level_priorities: tuple[int, ...] = field(default=(), metadata={RANGE: (0, 7)})


@dataclass(frozen=True)
class ClusterConfig:
    """One leader across nodes (``[cluster]``); see docs/configuration.md."""

    election: Literal["single", "etcd"] = "single"
    node: str = ""  # this node's name in the cluster; "" = the host name
    listen: str = ""  # HOST:PORT of the peer API (mutual TLS); needed with etcd
    advertise: str = ""  # HOST:PORT peers dial; "" = listen (with the port bound)
    ca_file: Path | None = None  # the cluster CA (PEM)
    cert_file: Path | None = None  # this node's certificate, signed by the CA
    key_file: Path | None = None
    etcd_endpoints: str = "http://127.0.0.1:2379"  # comma-separated http(s)://HOST:PORT
    etcd_prefix: str = "/gpud/cluster"
    etcd_ca_file: Path | None = None
    etcd_cert_file: Path | None = None
    etcd_key_file: Path | None = None
    etcd_username: str = ""
    etcd_password_file: Path | None = None
    etcd_timeout_s: float = ranged(1.0, 0.01, 60.0)
    lease_ttl_s: int = ranged(5, 2, 300)
    grace_s: float = ranged(30.0, 0.0, 86400.0)  # no leader for this long: back to the local policy
    node_timeout_s: float = ranged(
        5.0, 0.1, 3600.0
    )  # the leader forgets a node silent for this long
    report_timeout_s: float = ranged(1.0, 0.01, 60.0)


@dataclass(frozen=True)
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    mig: MigConfig = field(default_factory=MigConfig)
    mps: MpsConfig = field(default_factory=MpsConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    colocate: ColocateConfig = field(default_factory=ColocateConfig)
    traffic: TrafficConfig = field(default_factory=TrafficConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    @property
    def socket_path(self) -> Path:
        return self.api.socket or self.daemon.run_dir / "gpud.sock"

    def with_overrides(self, overrides: dict[str, Any], *, source: str = "flags") -> Config:
        """A copy with dotted keys (``"daemon.state_dir"``) replaced, each value checked."""
        config = self
        for dotted, raw in overrides.items():
            section_name, _, key = dotted.partition(".")
            section = getattr(config, section_name)
            hints = get_type_hints(type(section))
            value = _coerce(raw, hints[key], path=source, key=dotted)
            config = dataclasses.replace(
                config, **{section_name: dataclasses.replace(section, **{key: value})}
            )
        return validate(config, path=source)


FLAGS_SOURCE = "command line"  # where an error says a flag's value came from


@dataclass(frozen=True)
class Layers:
    """A config as read, layer by layer: the file's own values, and the config gpud runs
    (flags over the file). ``flags``: dotted key -> the flag that set it (``--log-level``);
    ``keys``: the dotted keys the file sets (any others hold their built-in defaults)."""

    file: Config
    final: Config
    flags: dict[str, str] = field(default_factory=dict)
    keys: frozenset[str] = frozenset()  # the dotted keys the file itself sets


def value_of(config: Config, dotted: str) -> Any:
    """The value of ``dotted`` (``"daemon.log_level"``) in ``config``."""
    section, _, key = dotted.partition(".")
    return getattr(getattr(config, section), key)


def overridden(before: Config, read: Layers, *, path: str) -> list[str]:
    """Each key the file changed since ``before`` (the file's values gpud started with) to
    a value other than the flag's, that the flag sets over it, so that the change does
    nothing (``KEY changed in FILE but --FLAG overrides it``): said on reload, which would
    otherwise take the file silently and run the flag's value. A file changed to agree with
    the flag is not said: it runs what the file says."""
    return [
        f"{key} changed in {path} but {flag} overrides it"
        for key, flag in read.flags.items()
        if value_of(read.file, key) not in (value_of(before, key), value_of(read.final, key))
    ]


def source(key: str, *, path: str, flags: Collection[str], keys: Collection[str]) -> str:
    """Where ``key``'s value came from, for an error about it: the command line when a flag
    set it (``flags``: the dotted keys flags set), the file ``path`` when it sets it
    (``keys``: the dotted keys the file sets), else "": a built-in default, said by the key
    alone rather than by a file that does not set it (or does not exist)."""
    if key in flags:
        return FLAGS_SOURCE
    return path if key in keys else ""


def where(path: str, key: str) -> str:
    """``FILE:key``, or the bare key where ``path`` is "" (a built-in default)."""
    return f"{path}:{key}" if path else key


def check_socket(
    config: Config, *, path: str, flags: Collection[str] = (), keys: Collection[str]
) -> None:
    """The API socket's path must fit a unix socket address: checked on the final config
    (flags over the file), not when the API binds at the end of start-up."""
    socket = os.fsencode(config.socket_path)
    if len(socket) > MAX_UNIX_PATH:
        key = "api.socket" if config.api.socket is not None else "daemon.run_dir"
        raise ConfigError(
            f"the socket {config.socket_path} is {len(socket)} bytes long: a unix socket "
            f"path is at most {MAX_UNIX_PATH}",
            path=source(key, path=path, flags=flags, keys=keys),
            key=key,
        )


def check_socket_file(
    config: Config, *, path: str, flags: Collection[str] = (), keys: Collection[str]
) -> None:
    """The API socket's path must not hold anything but a socket: gpud replaces only a
    socket nothing listens on (a stale one of its own) and refuses to start over anything
    else. Checked at start and by ``--check-config``, before the GPUs are touched, so that
    the error names the key and systemd does not restart gpud into it again and again."""
    socket = config.socket_path
    try:
        mode = socket.lstat().st_mode
    except OSError:
        return  # nothing there, or not reachable yet: the start makes or reports it
    if stat.S_ISSOCK(mode):
        return
    key = "api.socket" if config.api.socket is not None else "daemon.run_dir"
    raise ConfigError(
        f"{socket} is {file_kind(mode)}, not a socket: gpud binds its socket there and "
        "replaces nothing but a stale socket; remove it or choose another path",
        path=source(key, path=path, flags=flags, keys=keys),
        key=key,
    )


def check_dirs(
    config: Config, *, path: str, flags: Collection[str] = (), keys: Collection[str]
) -> None:
    """The state directory, the run directory and the socket's must be directories, or be
    makeable as ``mkdir -p`` makes them: a regular file (or other non-directory) at one of
    them, or above one, is a ConfigError naming its key, as is one that exists but that
    another user may plant files in (:func:`gpud.files.check_dir`). For ``--check-config``:
    the start finds the same when it makes them (:func:`gpud.files.make_dir`)."""
    for key, directory in (
        ("daemon.state_dir", config.daemon.state_dir),
        ("daemon.run_dir", config.daemon.run_dir),
        ("api.socket", config.socket_path.parent),
    ):
        if key == "api.socket" and config.api.socket is None:
            continue  # the run directory's own socket: checked with it
        where = source(key, path=path, flags=flags, keys=keys)
        for there in (directory, *directory.parents):
            try:
                st = there.stat()  # a link to a directory is one, as for mkdir
            except (FileNotFoundError, NotADirectoryError):
                continue  # made at start, as are those below it, or a file above it
            except OSError:
                break  # not reachable from here (no permission): the start makes or reports it
            mode = st.st_mode
            if stat.S_ISDIR(mode):
                if there == directory:  # the start takes it as it is: asked what it asks
                    try:
                        files.check_dir(there, st, key)
                    except ConfigError as err:
                        raise err.in_file(where) from None
                break
            above = "" if there == directory else f"cannot make {directory}: "
            kind = file_kind(mode)
            with contextlib.suppress(OSError):
                if there.is_symlink():  # the link is what the operator finds at the path
                    kind = f"a symbolic link to {kind}"
            raise ConfigError(
                f"{above}{there} is {kind}, not a directory: remove it or choose another path",
                path=where,
                key=key,
            )


def file_kind(mode: int) -> str:
    """What ``lstat`` found, in words; a symbolic link is said as one, whatever it points at
    (the socket's path itself must be a socket)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a special file"


def load(path: Path, *, required: bool = False) -> Config:
    """Read and check a TOML file; a missing file gives the defaults unless ``required``."""
    return read(path, required=required)[0]


def read(path: Path, *, required: bool = False) -> tuple[Config, frozenset[str]]:
    """:func:`load`, and the dotted keys the file sets (none for a missing file), so that
    an error about a key left at its default does not name the file."""
    try:
        raw = read_regular(path, MAX_CONFIG_BYTES, kind="a config file")
    except FileNotFoundError:
        if required:
            raise ConfigError("file not found", path=str(path)) from None
        return Config(), frozenset()
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror}", path=str(path)) from err
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"not valid TOML: {err}", path=str(path)) from err
    except RecursionError:
        # tomllib parses nested arrays and inline tables recursively
        raise ConfigError("not valid TOML: nested too deeply", path=str(path)) from None
    loaded = from_dict(data, path=str(path))  # each section a table, each key known
    return loaded, frozenset(f"{name}.{key}" for name, table in data.items() for key in table)


# a file's identity and version: (st_dev, st_ino, st_size, st_mtime_ns)
FileStamp = tuple[int, int, int, int]


def file_stamp(path: Path) -> FileStamp | None:
    """Which file ``path`` names now, and which version of it: taken before a read, a
    later stamp that differs says the file changed (or was replaced) since. None: there is
    none (or it cannot be looked at)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


# the most a config file may hold: gpud's fills a few KiB (each of the 999 XIDs listed in
# telemetry.ignored_xids takes 5 bytes); a bigger one (a log or a core file given by
# mistake, a runaway generator) is refused unread, not read into memory and parsed
MAX_CONFIG_BYTES = 256 << 10


def from_dict(data: dict[str, Any], *, path: str = "<config>") -> Config:
    sections: dict[str, Any] = {}
    hints = get_type_hints(Config)
    for name, value in data.items():
        if name not in hints:
            known = ", ".join(sorted(hints))
            raise ConfigError(f"unknown section (known: {known})", path=path, key=name)
        if not isinstance(value, dict):
            raise ConfigError("must be a table ([section])", path=path, key=name)
        sections[name] = _section(hints[name], value, path=path, prefix=name)
    return validate(Config(**sections), path=path)


def _section(cls: type[Any], values: dict[str, Any], *, path: str, prefix: str) -> Any:
    hints = get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, raw in values.items():
        dotted = f"{prefix}.{key}"
        if key not in hints:
            known = ", ".join(sorted(hints))
            raise ConfigError(f"unknown key (known in [{prefix}]: {known})", path=path, key=dotted)
        kwargs[key] = _coerce(raw, hints[key], path=path, key=dotted)
    return cls(**kwargs)


def _coerce(raw: Any, hint: Any, *, path: str, key: str) -> Any:
    origin = get_origin(hint)
    if origin is tuple:  # tuple[int, ...], tuple[str, ...]: a TOML array
        if not isinstance(raw, list | tuple):
            raise ConfigError(f"must be an array, not {raw!r}", path=path, key=key)
        item = get_args(hint)[0]
        return tuple(_coerce(x, item, path=path, key=key) for x in raw)
    if origin is Literal:
        choices = get_args(hint)
        if raw not in choices:
            allowed = ", ".join(repr(c) for c in choices)
            raise ConfigError(f"{raw!r} is not one of {allowed}", path=path, key=key)
        return raw
    if origin in (types.UnionType,):  # "X | None"
        if raw is None:
            return None
        inner = next(a for a in get_args(hint) if a is not type(None))
        return _coerce(raw, inner, path=path, key=key)
    if isinstance(raw, str) and "\0" in raw:
        # the OS takes no NUL in a path, a group or a program name: refused here, not
        # as a ValueError from deep inside start-up
        raise ConfigError(f"{raw!r} holds a NUL character", path=path, key=key)
    if hint is Path:
        if not isinstance(raw, str | Path) or not str(raw):
            raise ConfigError("must be a non-empty path string", path=path, key=key)
        # Absolute from the directory gpud starts in: the run directory's paths go to
        # processes that start elsewhere (MPS control daemons chdir to /, jobs run where
        # their user is), in CUDA_MPS_PIPE_DIRECTORY and GPUD_SOCKET.
        return Path(raw).absolute()
    if hint is bool:
        if not isinstance(raw, bool):
            raise ConfigError(f"must be true or false, not {raw!r}", path=path, key=key)
        return raw
    if hint is float:
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ConfigError(f"must be a number, not {raw!r}", path=path, key=key)
        if not math.isfinite(raw):
            raise ConfigError(f"must be a finite number, not {raw!r}", path=path, key=key)
        return float(raw)
    if hint is int:
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(f"must be an integer, not {raw!r}", path=path, key=key)
        return raw
    if hint is str:
        if not isinstance(raw, str):
            raise ConfigError(f"must be a string, not {raw!r}", path=path, key=key)
        return raw
    raise ConfigError(f"unsupported type {hint!r}", path=path, key=key)  # pragma: no cover


_HOST_NAME = re.compile(
    r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)*\.?"
)


def parse_address(value: str, *, path: str, key: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9400`` for IPv6) into a pair, or a ConfigError naming the key.
    The host is an IPv4 address, an IPv6 address in brackets, or a host name (not looked
    up here: that is for the moment it is used)."""
    host, sep, port = value.rpartition(":")
    # isdigit() alone takes "²", which int() refuses
    if not sep or not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{value!r} is not HOST:PORT", path=path, key=key)
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if bracketed or host.replace(".", "").isdigit():  # or a dotted quad, or meant to be one
        version = 6 if bracketed else 4
        try:
            (ipaddress.IPv6Address if bracketed else ipaddress.IPv4Address)(host)
        except ValueError:
            raise ConfigError(
                f"{value!r}: {host!r} is not an IPv{version} address", path=path, key=key
            ) from None
    elif ":" in host:
        raise ConfigError(
            f"{value!r}: an IPv6 address goes in brackets, as in [::1]:9400", path=path, key=key
        )
    elif host and not _HOST_NAME.fullmatch(host):
        raise ConfigError(f"{value!r}: {host!r} is not a host name", path=path, key=key)
    return host or "0.0.0.0", int(port)


def numeric_ranges(config: Config) -> dict[str, tuple[Any, float, float]]:
    """Every numeric key with a declared range: dotted key -> (value, low, high); the
    value of a list key is a tuple, each item within the range."""
    ranges = {}
    for section in dataclasses.fields(config):
        values = getattr(config, section.name)
        for key in dataclasses.fields(values):
            if RANGE in key.metadata:
                low, high = key.metadata[RANGE]
                ranges[f"{section.name}.{key.name}"] = (getattr(values, key.name), low, high)
    return ranges


def socket_gid(group: str, *, path: str | None = None) -> int:
    """The id of ``api.socket_group``; a ConfigError naming the key when there is no such
    group."""
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(
            f"group {group!r} does not exist: create it (groupadd --system {group}) or set another",
            path=path,
            key="api.socket_group",
        ) from None


def validate(config: Config, *, path: str) -> Config:
    """Range checks that types alone do not express."""
    for key, (value, low, high) in numeric_ranges(config).items():
        for item in value if isinstance(value, tuple) else (value,):
            if not low <= item <= high:
                raise ConfigError(
                    f"{item!r} is out of range: must be within [{low:g}, {high:g}]",
                    path=path,
                    key=key,
                )
    parse_address(config.metrics.address, path=path, key="metrics.address")
    if config.api.tcp_address:
        parse_address(config.api.tcp_address, path=path, key="api.tcp_address")
    if config.api.socket_group:
        socket_gid(config.api.socket_group, path=path)
    if not config.mps.control_binary.strip():
        # else each control daemon's start fails with "cannot run : Permission denied",
        # the empty name execve was given, and no word of the key
        raise ConfigError(
            f"{config.mps.control_binary!r}: must name the MPS control daemon's executable "
            "(a path, or a name looked up in PATH; default nvidia-cuda-mps-control)",
            path=path,
            key="mps.control_binary",
        )
    binary = config.mps.control_binary
    if "/" in binary and not binary.startswith("/"):
        # absolute from the directory gpud starts in, as a Path key is: execve resolves a
        # relative one against the cwd of whoever runs it, and --check-config, run from a
        # shell, would judge another file than the daemon (started in /) runs
        absolute = str(Path(binary).absolute())
        config = dataclasses.replace(
            config, mps=dataclasses.replace(config.mps, control_binary=absolute)
        )
    _validate_traffic(config.traffic, path=path)
    _validate_cluster(config.cluster, path=path, tick_s=config.daemon.tick_s)
    if config.backend.kind == "sim":
        # Imported here: the product table is only needed when simulating.
        from gpud.backend.sim import parse_simulate_spec

        try:
            parse_simulate_spec(config.backend.simulate)
        except ConfigError as err:
            raise ConfigError(str(err), path=path, key="backend.simulate") from err
    return config


# One DNS label: the node name is matched against a certificate's subjectAltName
_DNS_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def _validate_cluster(c: ClusterConfig, *, path: str, tick_s: float) -> None:
    if c.node and (
        len(c.node) > 253 or not all(_DNS_LABEL.fullmatch(label) for label in c.node.split("."))
    ):
        raise ConfigError(
            f"{c.node!r} is not a DNS name (letters, digits, hyphens, dot-separated labels "
            "of at most 63): the other nodes match it against its certificate",
            path=path,
            key="cluster.node",
        )
    if c.listen:
        parse_address(c.listen, path=path, key="cluster.listen")
    if c.advertise:
        host, port = parse_address(c.advertise, path=path, key="cluster.advertise")
        if host in ("0.0.0.0", "::") or port == 0:
            raise ConfigError(
                f"{c.advertise!r}: the other nodes dial this address: it needs this node's "
                "host and port (no wildcard host, no port 0; leave it out to advertise "
                "cluster.listen with the port bound)",
                path=path,
                key="cluster.advertise",
            )
    why = etcd_prefix_error(c.etcd_prefix)
    if why:
        raise ConfigError(f"{c.etcd_prefix!r} {why}", path=path, key="cluster.etcd_prefix")
    if c.election == "etcd":
        # A leader renews its lease with a keepalive and a read every lease_ttl_s/4 and
        # leads until its last renewal was sent + 3/4 TTL (gpud.clock: a suspend counts):
        # a renewal whose two requests may each block etcd_timeout_s must fit in the half
        # of the TTL left for it.
        if c.etcd_timeout_s > c.lease_ttl_s / 4:
            raise ConfigError(
                f"{c.etcd_timeout_s:g} s exceeds a quarter of cluster.lease_ttl_s "
                f"({c.lease_ttl_s} s): a lease renewal could block until the leader must "
                "step down",
                path=path,
                key="cluster.etcd_timeout_s",
            )
        # Nodes report once a tick, each report within report_timeout_s; the leader must
        # keep a node through one late or missed tick, not drop it between two reports.
        least = 2 * tick_s + c.report_timeout_s
        if c.node_timeout_s < least:
            raise ConfigError(
                f"{c.node_timeout_s:g} s is less than 2 x daemon.tick_s ({tick_s:g} s) + "
                f"cluster.report_timeout_s ({c.report_timeout_s:g} s) = {least:g} s: the "
                "leader would forget nodes between their reports",
                path=path,
                key="cluster.node_timeout_s",
            )
        if not c.listen:
            raise ConfigError(
                "needed with election = etcd (the peer API other nodes report to)",
                path=path,
                key="cluster.listen",
            )
        for key in ("ca_file", "cert_file", "key_file"):
            if getattr(c, key) is None:
                raise ConfigError(
                    "needed with election = etcd (mutual TLS between nodes; "
                    "tools/certs.py makes a CA and node certificates)",
                    path=path,
                    key=f"cluster.{key}",
                )
        _validate_etcd_auth(c, path=path)
        _validate_etcd_endpoints(c.etcd_endpoints, path=path)


def etcd_prefix_error(prefix: str) -> str:
    """Why ``cluster.etcd_prefix`` is refused, or "": it must start with "/" (every key gpud
    writes is ``<prefix>/...``, ``etcdctl get --prefix /gpud/cluster``), as gpud always
    required. What else looks wrong in it is warned about (:func:`etcd_prefix_warning`)."""
    if not prefix.startswith("/"):
        return "must start with / (like /gpud/cluster)"
    return ""


def etcd_prefix_warning(prefix: str) -> str:
    """What looks wrong in ``cluster.etcd_prefix`` as its users take it (trailing "/"
    stripped: "/gpud/cluster//" names the keys of "/gpud/cluster"), or "": "/" alone mixes
    gpud's keys with every other etcd user's (and a role granted readwrite on it, on all of
    theirs); an empty, "." or ".." part names a prefix other than it seems (etcd takes keys
    as bytes: "/gpud/../x" is not "/x"), and space is a typing slip. Taken all the same, as
    gpud always took them (a prefix a node ran with must not stop it at its next start),
    but said at start and by ``gpud --check-config``."""
    if etcd_prefix_error(prefix):
        return ""  # refused
    path = prefix.rstrip("/")
    if not path:
        return (
            "is the whole of etcd's key space: gpud's keys mix with every other etcd"
            " user's; give gpud a prefix of its own, like /gpud/cluster"
        )
    if any(ch.isspace() or not ch.isprintable() for ch in path):
        return "holds a space or a control character: a path like /gpud/cluster?"
    if any(part in ("", ".", "..") for part in path.split("/")[1:]):
        return (
            'has an empty, "." or ".." part: etcd takes a key as it is written, so this is'
            " not the prefix it looks like; write it as /a/b, like /gpud/cluster"
        )
    return ""


LOOPBACK = (
    "'lo' is the loopback: shaping it slows this node's local gRPC and etcd traffic, never"
    " GPU traffic between nodes"
)
# what listing the loopback does, per key that takes netdevs: no GPU traffic between nodes
# crosses it, nor any RDMA (no NIC, so no DSCP -> priority map to own)
_LOOPBACK_WHY = {
    "traffic.interfaces": LOOPBACK,
    "traffic.rdma_interfaces": (
        "'lo' is the loopback: it has no NIC, so no DSCP -> priority map, and carries no"
        " RDMA traffic"
    ),
}


def loopback_listed(t: TrafficConfig) -> list[tuple[str, str]]:
    """``(key, why)`` for each of ``traffic.interfaces`` and ``traffic.rdma_interfaces``
    that lists ``lo``: refused with traffic on (:func:`validate`), warned about with it off
    (:func:`config_warnings`). By name only: the file is checked where the netdevs may not
    be (``gpud --check-config`` on another host), so a loopback under another name is
    found by the first pass on it (the kernel's ``ARPHRD_LOOPBACK``, see
    :mod:`netshaper.tc_netlink` and :class:`netshaper.dcb.NicMap`)."""
    listed = (("traffic.interfaces", t.interfaces), ("traffic.rdma_interfaces", t.rdma_interfaces))
    return [(key, _LOOPBACK_WHY[key]) for key, names in listed if "lo" in names]


def config_warnings(cfg: Config, *, path: str = "") -> list[str]:
    """What the config file takes but an operator should hear of, outside the traffic
    settings (:func:`gpud.net.wiring.config_warnings`): an odd ``cluster.etcd_prefix``;
    ``lo`` in ``traffic.interfaces`` or ``traffic.rdma_interfaces`` with traffic off
    (refused with it on, :func:`loopback_listed`). Said at start
    and by ``gpud --check-config``, naming ``FILE:KEY`` as an error would."""
    out = []
    odd = etcd_prefix_warning(cfg.cluster.etcd_prefix)
    if odd:
        where = f"{path}:cluster.etcd_prefix" if path else "cluster.etcd_prefix"
        out.append(f"{where}: {cfg.cluster.etcd_prefix!r} {odd}")
    for key, why in loopback_listed(cfg.traffic) if not cfg.traffic.enabled else ():
        where = f"{path}:{key}" if path else key
        out.append(f"{where}: {why}: refused once traffic.enabled = true")
    return out


def _validate_etcd_auth(c: ClusterConfig, *, path: str) -> None:
    # etcd's user/password login needs both: a name alone logs in with an empty password
    # (refused on every call), a password file alone is never read
    if c.etcd_password_file is not None and not c.etcd_username:
        raise ConfigError(
            "needs cluster.etcd_username: without it the password is never sent",
            path=path,
            key="cluster.etcd_password_file",
        )
    if c.etcd_username and c.etcd_password_file is None:
        raise ConfigError(
            "needs cluster.etcd_password_file (the user's password); leave both out for "
            "client certificate authentication (cluster.etcd_cert_file)",
            path=path,
            key="cluster.etcd_username",
        )


def _validate_etcd_endpoints(value: str, *, path: str) -> None:
    key = "cluster.etcd_endpoints"
    endpoints = [e.strip() for e in value.split(",")]
    if not any(endpoints):
        raise ConfigError("no endpoint", path=path, key=key)
    if "" in endpoints:  # a list cut short, or an endpoint lost in an edit
        raise ConfigError(f"{value!r}: an empty endpoint between commas", path=path, key=key)
    for endpoint in endpoints:
        scheme, sep, rest = endpoint.partition("://")
        if scheme not in ("http", "https") or not sep:
            raise ConfigError(f"{endpoint!r} is not http(s)://HOST:PORT", path=path, key=key)
        # said here: parse_address would take these for a bad host or an IPv6 address
        if any(ch.isspace() for ch in endpoint):
            raise ConfigError(f"{endpoint!r}: separate endpoints with commas", path=path, key=key)
        if "@" in rest:
            raise ConfigError(
                f"{scheme}://...@{rest.rpartition('@')[2]}: no credentials in the URL: set "
                "cluster.etcd_username and cluster.etcd_password_file",
                path=path,
                key=key,
            )
        address = rest.rstrip("/")
        if "/" in address:
            raise ConfigError(
                f"{endpoint!r}: no path: the client finds etcd's API path itself "
                "(http(s)://HOST:PORT)",
                path=path,
                key=key,
            )
        _, port = parse_address(address, path=path, key=key)
        if address.startswith(":") or port == 0:
            raise ConfigError(
                f"{endpoint!r}: etcd's client address needs its host and port (no port 0)",
                path=path,
                key=key,
            )


def _validate_traffic(t: TrafficConfig, *, path: str) -> None:
    if t.min_share * t.levels + t.default_share > 1:
        raise ConfigError(
            f"{t.levels} levels x {t.min_share} + default_share {t.default_share} exceed 1",
            path=path,
            key="traffic.min_share",
        )
    if t.min_share * t.levels + t.default_share + t.top_share > 1 + 1e-9:
        raise ConfigError(
            f"top_share {t.top_share} + {t.levels} levels x {t.min_share} + default_share "
            f"{t.default_share} exceed 1: the levels' guarantees need that room",
            path=path,
            key="traffic.top_share",
        )
    from netshaper.tcplan import LINK_BPS_MAX, LINK_BPS_MIN, interface_name_error, link_rate_range

    for key, names in (
        ("traffic.interfaces", t.interfaces),
        ("traffic.rdma_interfaces", t.rdma_interfaces),
    ):
        for name in names:
            why = interface_name_error(name)
            if why:
                raise ConfigError(f"{name!r} is not an interface name: {why}", path=path, key=key)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"{', '.join(twice)} listed twice", path=path, key=key)
    for key, why in loopback_listed(t) if t.enabled else ():
        # HTB on the loopback shapes this node's own gRPC, etcd and metrics traffic, and
        # no GPU traffic between nodes ever crosses it. With traffic off nothing is shaped:
        # refusing there would stop a gpud upgraded under an old file, all of it, for a
        # setting it does not use (config_warnings says it instead)
        raise ConfigError(f"{why}; list the NICs that carry GPU traffic", path=path, key=key)

    rated: set[str] = set()
    for entry in t.link_rates:
        if any(c.isspace() for c in entry):
            # as in traffic.interfaces, where the kernel refuses a space in a name
            raise ConfigError(
                f"{entry!r}: IF=RATE without spaces, like eth0=100gbit",
                path=path,
                key="traffic.link_rates",
            )
        name, sep, rate = entry.partition("=")
        if not sep or name not in t.interfaces:
            raise ConfigError(
                f"{entry!r}: need IF=RATE for an interface in traffic.interfaces",
                path=path,
                key="traffic.link_rates",
            )
        if name in rated:
            raise ConfigError(
                f"{entry!r}: {name} has a rate already", path=path, key="traffic.link_rates"
            )
        rated.add(name)
        try:
            bps = parse_rate(rate)
        except ValueError as err:
            raise ConfigError(f"{entry!r}: {err}", path=path, key="traffic.link_rates") from err
        if not LINK_BPS_MIN <= bps <= LINK_BPS_MAX:
            raise ConfigError(
                f"{entry!r}: {link_rate_range(bps)}", path=path, key="traffic.link_rates"
            )
    if t.level_priorities and len(t.level_priorities) != t.levels:
        raise ConfigError(
            f"{len(t.level_priorities)} priorities for {t.levels} levels",
            path=path,
            key="traffic.level_priorities",
        )
    if not t.cgroup_parent or t.cgroup_parent.startswith("/") or ".." in t.cgroup_parent:
        raise ConfigError(
            f"{t.cgroup_parent!r}: a relative directory under the cgroup2 mount",
            path=path,
            key="traffic.cgroup_parent",
        )
    from netshaper.nftables import usable_path

    if not usable_path(t.cgroup_parent):
        # nft's rule names the job's cgroup by path, in a quoted string
        raise ConfigError(
            f"{t.cgroup_parent!r}: nftables cannot name a cgroup path with a double quote,"
            " a backslash or a line break",
            path=path,
            key="traffic.cgroup_parent",
        )
    from gpud.net.tagstore import parse_pool

    try:
        pool = parse_pool(t.dscp_pool, {*t.reserved_dscp, t.cnp_dscp})
    except ValueError as err:
        raise ConfigError(str(err), path=path, key="traffic.dscp_pool") from err
    if 0 in pool:
        # the default class takes every packet left at DSCP 0, so a job tagged 0 cannot be
        # told apart from untagged traffic: tc refuses the plan, and no interface is enforced
        raise ConfigError(
            "DSCP 0 is untagged traffic's (the default class), never a job's tag:"
            " keep 0 in traffic.reserved_dscp",
            path=path,
            key="traffic.reserved_dscp",
        )


_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(text: str) -> int:
    """tc's rate notation ("400mbit", "100gbit", "25000000") in bit/s. Space around it is
    dropped; space inside it ("100 mbit") tc refuses, and so does this."""
    raw = text.strip().lower()
    if any(c.isspace() for c in raw):
        raise ValueError(f"{text!r}: no space inside a rate, like 400mbit or 100gbit")
    for unit in sorted(_RATE_UNITS, key=len, reverse=True):
        if raw.endswith(unit):
            number, scale = raw[: -len(unit)], _RATE_UNITS[unit]
            break
    else:
        number, scale = raw, 1
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a rate like 400mbit or 100gbit") from None
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r}: a rate must be positive")
    return int(value * scale)
