"""``gpud``: the composition root. Parses flags, loads the config, picks the backend once
(real NVML, or the simulated node) and runs the daemon until SIGTERM.

Nothing below this module reads gpud's own environment or chooses the GPU backend; the
traffic service's kernel backends are the daemon's to build (:mod:`gpud.net.wiring` looks
for the cgroup2 mount and ``nft``, both injectable).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Collection, Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gpud import __version__, config, files, logsetup
from gpud import build as build_id
from gpud.backend.products import PRODUCTS
from gpud.dirlock import DirLocks
from gpud.errors import ConfigError, DriverNotLoaded, GpudError, NoPermission, StateDamaged
from gpud.notify import Notifier
from gpud.threads import EXIT_GRACE_S, StartTellingExecutor

if TYPE_CHECKING:
    from gpud.backend.port import GpuBackend
    from gpud.backend.sim import SimNode
    from gpud.net.cgroups import JobCgroups

log = logging.getLogger(__name__)

# Masked from every file gpud creates whatever umask it was started with (the unit's is 0027):
# under umask 0 its socket would be srwxrwxrwx from the bind until it is set to 0660, time
# enough for any user to connect and keep the connection, and its state files world-writable.
UMASK_FLOOR = 0o022


def restrict_umask() -> int:
    """Add :data:`UMASK_FLOOR` to the process umask; the umask now."""
    mask = os.umask(UMASK_FLOOR) | UMASK_FLOOR
    os.umask(mask)
    return mask


# Descriptors gpud asks for at most, when its hard limit is unlimited.
MAX_OPEN_FILES = 1 << 20


def open_files_wanted(soft: int, hard: int) -> int:
    """The soft RLIMIT_NOFILE gpud runs with: its hard limit (MAX_OPEN_FILES when that is
    unlimited). systemd starts services at 1024 soft (524288 hard) and expects a daemon that
    needs more to raise it itself: at 1024, about a thousand idle connections to
    api.tcp_address, which any local user may open, left gpud no descriptor to accept
    ``gpuctl`` on its socket, open its state or answer /metrics."""
    if soft == resource.RLIM_INFINITY:
        return soft
    return max(soft, MAX_OPEN_FILES if hard == resource.RLIM_INFINITY else hard)


def raise_open_files() -> None:
    """Raise the soft RLIMIT_NOFILE to :func:`open_files_wanted` (``ulimit -Sn``)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = open_files_wanted(soft, hard)
    if wanted != soft:
        # above fs.nr_open the kernel refuses: gpud then runs with what it has
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def make_dirs(cfg: config.Config, said: list[str]) -> None:
    """Create the state and run directories, and the directory of the socket (``api.socket``
    may lie outside the run directory: no systemd ``RuntimeDirectory=`` makes it); a
    ConfigError naming the key when one cannot be (a missing parent under /proc, a file in
    the way, no permission). Adds to ``said`` a line for the log for each one created,
    naming it with its mode and owner (:func:`gpud.files.make_dir`), as it goes: those made
    before one that fails are said with the error. The start exits 1 on such an error,
    restarted under systemd: some are the host's of the moment (a filesystem not yet
    mounted read-write, a directory another user made and removes); ``gpud --check-config``
    refuses a file in the way of one (:func:`gpud.config.check_dirs`, exit 2)."""
    for key, path, mode in (
        ("daemon.state_dir", cfg.daemon.state_dir, files.STATE_DIR_MODE),
        ("daemon.run_dir", cfg.daemon.run_dir, files.RUN_DIR_MODE),
        ("api.socket", cfg.socket_path.parent, files.RUN_DIR_MODE),
    ):
        line = files.make_dir(path, key, mode)
        if line:
            said.append(line)


def lock_dirs(cfg: config.Config) -> DirLocks:
    """Hold ``gpud.lock`` in the state and run directories (:mod:`gpud.dirlock`) so that a
    second gpud on the same directories stops before it touches the GPUs, the state or the
    sockets; a ConfigError naming the key and the holder's pid when another process holds
    one."""
    dirs = {cfg.daemon.state_dir: ("daemon.state_dir", files.STATE_DIR_MODE)}
    dirs.setdefault(cfg.daemon.run_dir, ("daemon.run_dir", files.RUN_DIR_MODE))
    return DirLocks.take(dirs)


def open_backend(
    cfg: config.Config, *, nvml: Any = None, sim_sleep: Callable[[float], None] = time.sleep
) -> tuple[GpuBackend, SimNode | None]:
    """The GPU backend the config asks for: real NVML (over ``nvml``, a pynvml-shaped module;
    None: the installed ``pynvml``), or the simulated node, whose injected slow driver calls
    hang in ``sim_sleep``."""
    if cfg.backend.kind == "sim":
        from gpud.backend.nvml import NvmlBackend
        from gpud.backend.sim import SimNode, parse_simulate_spec

        sim_dir = cfg.daemon.run_dir / "sim"
        files.make_dir(sim_dir, "daemon.run_dir", files.ABOVE_MODE)
        node = SimNode(
            parse_simulate_spec(cfg.backend.simulate),
            state_file=sim_dir / "node.json",
            sleep=sim_sleep,
        )
        return NvmlBackend(node.nvml, reset=node.reset), node
    from gpud.backend.gpureset import nvidia_smi_reset
    from gpud.backend.nvml import open_real_backend

    return open_real_backend(reset=nvidia_smi_reset(), uid=os.geteuid(), nvml=nvml), None


# Exit statuses of a start that cannot use the GPUs (sysexits.h). systemd/gpud.service does
# not restart gpud for them (RestartPreventExitStatus): a restart every few seconds would not
# load the driver, mount the library or grant the device nodes.
EXIT_NO_DRIVER = 69  # EX_UNAVAILABLE: no NVML library, or one of another driver version
EXIT_NO_PERMISSION = 77  # EX_NOPERM: the driver refuses gpud's user
# A state database damaged or not gpud's (sysexits.h EX_DATAERR): not restarted either, as
# each start would refuse it again every few seconds; a full disk or another process's lock
# on it is exit 1, restarted, as either can pass
EXIT_STATE_DAMAGED = 65
NOT_RESTARTED = "(gpud is not restarted for this: start it again once mended)"
# NVML_ERROR_DRIVER_NOT_LOADED: the kernel module may be loaded after gpud starts (a module
# built at boot, nvidia-persistenced not installed), so that start is tried again
_DRIVER_NOT_LOADED = 9


def backend_failure(err: GpudError) -> tuple[str, int]:
    """What gpud prints, and the status it exits with, when the GPU backend cannot be opened."""
    if isinstance(err, DriverNotLoaded) and err.code == _DRIVER_NOT_LOADED:
        return (
            f"gpud: cannot use the GPUs: {err} (gpud exits 1: under systemd it is started"
            " again until the driver is loaded)",
            1,
        )
    if isinstance(err, DriverNotLoaded):
        return (
            f"gpud: cannot use the GPUs: {err} {NOT_RESTARTED}",
            EXIT_NO_DRIVER,
        )
    if isinstance(err, NoPermission):
        return (
            f"gpud: cannot use the GPUs: {err} {NOT_RESTARTED}",
            EXIT_NO_PERMISSION,
        )
    return f"gpud: cannot open the GPU backend: {err}", 1


def backend_warning(cfg: config.Config, *, nvml: Any = None) -> str:
    """Why the GPUs cannot be used, as a start would find (NVML initialised, then let go);
    "" when they can, or on a simulated node. For ``--check-config``."""
    if cfg.backend.kind == "sim":
        return ""
    try:
        backend, _ = open_backend(cfg, nvml=nvml)
    except GpudError as err:
        return f"a start would fail: {err}"
    backend.close()
    return ""


def mps_control_command(cfg: config.Config) -> list[str]:
    """The MPS control daemon to run: a simulated node gets the bundled fake
    ``nvidia-cuda-mps-control`` unless the config names another binary."""
    if cfg.backend.kind == "sim" and cfg.mps.control_binary == "nvidia-cuda-mps-control":
        from gpud.sim_tools import FAKE_MPS_CONTROL

        return [sys.executable, str(FAKE_MPS_CONTROL)]
    return [cfg.mps.control_binary]


def mps_binary_warning(
    cfg: config.Config, *, path: str, keys: Collection[str], uid: int | None = None
) -> str:
    """Why ``mps.control_binary`` cannot be run now, as ``FILE:mps.control_binary: ...``
    (the bare key when the file ``path`` does not set it: ``keys``, the keys it sets), or
    "" when it can (or MPS is off, or a simulated node runs its bundled fake daemon). A
    warning, not an error: on some images the driver's tools are installed after gpud
    starts, and gpud starts each device's daemon again (with back-off) until it runs. A name
    without a ``/`` is looked up in the PATH the control daemons are started with. Judged
    with this process's rights (``uid``: its real uid, as ``access(2)`` checks): a user
    other than root that gpud is not may be refused a binary that root may run, so the
    warning says which uid was checked."""
    if not cfg.mps.enabled or mps_control_command(cfg) != [cfg.mps.control_binary]:
        return ""
    from gpud.mps.daemon import DEFAULT_BASE_ENV, exec_failure

    binary = cfg.mps.control_binary
    why = exec_failure(binary, DEFAULT_BASE_ENV["PATH"])
    if not why:
        return ""
    uid = os.getuid() if uid is None else uid
    if uid != 0:
        why += f" (checked as uid {uid})"
    where = config.source("mps.control_binary", path=path, flags=(), keys=keys)
    return f"{config.where(where, 'mps.control_binary')}: {binary}: {why}"


def mps_cgroups(
    cfg: config.Config, mountinfo: Path = Path("/proc/self/mountinfo")
) -> tuple[JobCgroups | None, str]:
    """Where each MPS control daemon gets a cgroup of its own, or None and why not. A
    simulated node's fake daemons stay in gpud's: they are no jobs' servers, and a test
    run as root must not create cgroups on its host."""
    from gpud.mps.manager import CGROUP_PREFIX
    from gpud.net.cgroups import JobCgroups, find_cgroup2

    if cfg.backend.kind == "sim":
        return None, ""
    mount = find_cgroup2(mountinfo)
    if mount is None:
        return None, "cgroup v2 is not mounted"
    return JobCgroups(mount, parent=cfg.traffic.cgroup_parent, prefix=CGROUP_PREFIX), ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gpud",
        description="GPU sharing and traffic daemon: MIG/MPS partitions, co-location, "
        "training traffic priorities, telemetry.",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"config file (default {config.DEFAULT_PATH}; missing default file = defaults)",
    )
    p.add_argument(
        "--simulate",
        nargs="?",
        const=config.DEFAULT_SIMULATE,
        metavar="PRODUCT:COUNT,...",
        help="run a simulated node instead of real NVML "
        f"(default {config.DEFAULT_SIMULATE}; products: {', '.join(PRODUCTS)}, "
        "or their NVML names)",
    )
    # paths as given: the config makes them absolute and refuses "" (Path("") is ".")
    p.add_argument("--socket", help="gRPC unix socket (default <run-dir>/gpud.sock)")
    p.add_argument("--metrics-address", metavar="HOST:PORT", help="Prometheus /metrics address")
    p.add_argument("--state-dir", help="persistent state (default /var/lib/gpud)")
    p.add_argument("--run-dir", help="runtime files and sockets (default /run/gpud)")
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--check-config", action="store_true", help="load and check the config, then exit"
    )
    p.add_argument("--version", action=build_id.VersionAction, version=__version__)
    return p


# each flag that sets a config key over the file's: (argparse dest, flag, dotted key, the
# other keys it sets with their values)
FLAG_KEYS: tuple[tuple[str, str, str, dict[str, Any]], ...] = (
    ("simulate", "--simulate", "backend.simulate", {"backend.kind": "sim"}),
    ("socket", "--socket", "api.socket", {}),
    ("metrics_address", "--metrics-address", "metrics.address", {}),
    ("state_dir", "--state-dir", "daemon.state_dir", {}),
    ("run_dir", "--run-dir", "daemon.run_dir", {}),
    ("log_level", "--log-level", "daemon.log_level", {}),
)


def flag_settings(args: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """Dotted config key -> (the flag that set it, its value), for the flags given."""
    settings: dict[str, tuple[str, Any]] = {}
    for dest, flag, key, also in FLAG_KEYS:
        value = getattr(args, dest)
        if value is not None:
            settings |= {other: (flag, fixed) for other, fixed in also.items()}
            settings[key] = (flag, value)
    return settings


def flag_names(args: argparse.Namespace) -> dict[str, str]:
    """Dotted config key -> the flag that set it, for the flags given."""
    return {key: flag for key, (flag, _) in flag_settings(args).items()}


def flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted config keys set by flags; flags win over the file."""
    return {key: value for key, (_, value) in flag_settings(args).items()}


def load_layers(args: argparse.Namespace) -> config.Layers:
    """The config file's values and the config gpud runs, flags over them (checked as a
    whole: the socket's length, the cluster's files)."""
    path = args.config or config.DEFAULT_PATH
    loaded, keys = config.read(path, required=args.config is not None)
    flags = flag_overrides(args)
    final = loaded.with_overrides(flags, source=config.FLAGS_SOURCE)
    config.check_socket(final, path=str(path), flags=flags, keys=keys)
    check_cluster_files(final, path=str(path))
    return config.Layers(file=loaded, final=final, flags=flag_names(args), keys=keys)


def load_config(args: argparse.Namespace) -> config.Config:
    return load_layers(args).final


def check_cluster_files(cfg: config.Config, *, path: str) -> None:
    """The cluster's CA, certificate and key, checked as the peer API will use them (see
    ``PeerTls.load``), and the etcd client's files readable, so that ``--check-config``, a
    start and a reload all find a bad one as a config error naming the file."""
    c = cfg.cluster
    if c.election != "etcd":
        return
    # ssl and grpc: only for a node of a cluster
    from gpud.cluster.tls import PeerTls, check_etcd_client_files, read_cluster_file

    try:
        PeerTls.load(c.ca_file, c.cert_file, c.key_file, node=c.node or socket.gethostname())
    except ConfigError as err:
        raise err.in_file(path) from None
    for key, file in (
        ("etcd_ca_file", c.etcd_ca_file),
        ("etcd_cert_file", c.etcd_cert_file),
        ("etcd_key_file", c.etcd_key_file),
        ("etcd_password_file", c.etcd_password_file),
    ):
        if file is None:
            continue
        try:
            read_cluster_file(file, f"cluster.{key}")
        except ConfigError as err:
            raise err.in_file(path) from None
    try:
        check_etcd_client_files(c.etcd_ca_file, c.etcd_cert_file, c.etcd_key_file)
    except ConfigError as err:
        raise err.in_file(path) from None


def readable_secrets(cfg: config.Config) -> list[str]:
    """Warnings for the cluster's private key, etcd's client key and password file where
    users other than the file's owner and group may read or write them, as ``ssh`` warns of
    an unprotected private key: whoever reads one can speak as this node to its peers (or to
    etcd). Taken all the same: the file is the operator's. Said by ``--check-config`` and at
    start."""
    c = cfg.cluster
    if c.election != "etcd":
        return []
    said = []
    for key, file in (
        ("key_file", c.key_file),
        ("etcd_key_file", c.etcd_key_file),
        ("etcd_password_file", c.etcd_password_file),
    ):
        try:
            mode = stat.S_IMODE(file.stat().st_mode) if file is not None else 0
        except OSError:
            continue  # unreadable: said by check_cluster_files
        if mode & stat.S_IRWXO:
            said.append(
                f"cluster.{key}: {file} is open to every user (mode {mode:04o}): any local"
                f" user can read this node's secret: chmod o-rwx {file}"
            )
    return said


def check_mig_config_file(cfg: config.Config, *, path: str) -> None:
    """That ``admission.mig_config`` reads and parses as a mig-parted file. Only for
    ``--check-config``: the running gpud reads it on each use (it may appear later), and
    says in its log when it cannot."""
    named = cfg.admission.mig_config
    if named is None:
        return
    from gpud.mig.layout import load_config as load_mig_config

    try:
        load_mig_config(named)
    except GpudError as err:
        raise ConfigError(str(err), path=path, key="admission.mig_config") from None


def check_listen_hosts(
    cfg: config.Config, *, path: str, flags: Collection[str] = (), keys: Collection[str]
) -> None:
    """That the hosts of ``metrics.address``, ``api.tcp_address`` and (with etcd)
    ``cluster.listen`` resolve to addresses of this host, as the start will need: a socket bound to each on port 0 (any free port),
    so that a port the running gpud serves on is no error. Only for ``--check-config``; the
    start itself says the same when it binds. ``flags``: the keys set by flags, named as
    the command line's rather than the file's; ``keys``: those the file sets (others are
    named by the key alone: their defaults)."""
    for key, address, used in (
        ("metrics.address", cfg.metrics.address, cfg.metrics.enabled),
        ("api.tcp_address", cfg.api.tcp_address, bool(cfg.api.tcp_address)),
        ("cluster.listen", cfg.cluster.listen, cfg.cluster.election == "etcd"),
    ):
        if not used:
            continue
        where = config.source(key, path=path, flags=flags, keys=keys)
        host, _ = config.parse_address(address, path=where, key=key)
        try:
            infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, kind, proto, _, addr = infos[0]
            with socket.socket(family, kind, proto) as probe:
                probe.bind(addr)
        except OSError as err:
            raise ConfigError(
                f"{address!r}: cannot serve on {host}: {err.strerror or err}", path=where, key=key
            ) from None


def expiring_certificates(cfg: config.Config) -> list[str]:
    """The cluster's certificates that expire within a week or have expired (the earliest
    in each file: a chain's intermediate CA counts), as the start warns of them."""
    if cfg.cluster.election != "etcd":
        return []
    from gpud.cluster.certexpiry import CertWatch
    from gpud.cluster.runtime import cert_files

    return CertWatch(cert_files(cfg.cluster)).check(time.time())


def main(argv: list[str] | None = None, *, nvml: Any = None) -> int:
    """``gpud``; ``nvml``: the pynvml-shaped module for real GPUs (None: ``pynvml``)."""
    # gRPC's core writes a line to stderr (the journal) at INFO for each TLS handshake it
    # refuses: anyone who can reach cluster.listen (or a TLS api.tcp_address) with a
    # certificate of another CA, an expired one or none would add a line per connection.
    # Its errors (a port it cannot bind) still show; GRPC_VERBOSITY set by an operator wins.
    # gRPC reads it once, when grpc is first imported: nothing imported above loads grpc
    # (tests/unit/test_main_grpc_verbosity.py holds it), so this comes first.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    args = build_parser().parse_args(argv)
    stamp = config.file_stamp(args.config or config.DEFAULT_PATH)  # before the read
    path, flags = str(args.config or config.DEFAULT_PATH), flag_overrides(args)
    try:
        layers = load_layers(args)
        # at start only: while gpud runs, what is at the path is its own (rebound when removed)
        config.check_socket_file(layers.final, path=path, flags=flags, keys=layers.keys)
    except ConfigError as err:
        print(f"gpud: config error: {err}", file=sys.stderr)
        return 2
    cfg = layers.final
    if args.check_config:
        try:
            check_listen_hosts(cfg, path=path, flags=flags, keys=layers.keys)
            config.check_dirs(cfg, path=path, flags=flags, keys=layers.keys)
            check_mig_config_file(cfg, path=path)
        except ConfigError as err:
            print(f"gpud: config error: {err}", file=sys.stderr)
            return 2
        from gpud.api.access import tcp_warning
        from gpud.daemon import config_watchdog_warning
        from gpud.net.wiring import config_warnings

        warnings = [
            *config_warnings(cfg, path=path),
            *config.config_warnings(cfg, path=path),
            tcp_warning(cfg.api.tcp_address, cfg.api.tcp_access),
            *expiring_certificates(cfg),
            *readable_secrets(cfg),
            mps_binary_warning(cfg, path=path, keys=layers.keys),
            backend_warning(cfg, nvml=nvml),
            # run by systemd (ExecStartPre=), it knows the unit's WatchdogSec
            config_watchdog_warning(cfg, Notifier.from_environ(os.environ).watchdog_s),
        ]
        for warning in filter(None, warnings):  # taken, as at start, but said
            print(f"gpud: warning: {warning}", file=sys.stderr)
        print("config OK")
        return 0
    restrict_umask()
    raise_open_files()
    created: list[str] = []
    try:
        try:
            make_dirs(cfg, created)
        except ConfigError as err:
            # the key's value is the config's: named where it came from, as a config error
            # is (exit 1 all the same: see make_dirs)
            where = config.source(err.key or "", path=path, flags=flags, keys=layers.keys)
            raise err.in_file(where) from None
        locks = lock_dirs(cfg)  # held until the process ends
    except ConfigError as err:
        for line in created:  # logging is not set up yet: said as the error is
            print(f"gpud: {line}", file=sys.stderr)
        print(f"gpud: {err}", file=sys.stderr)
        return 1
    try:
        code = run(
            cfg,
            args,
            nvml=nvml,
            locks=locks,
            stamp=stamp,
            created=created,
            file_config=layers.file,
            file_keys=layers.keys,
        )
    finally:
        locks.close()
    exit_leaving_stuck_threads(code)
    return code


def run(
    cfg: config.Config,
    args: argparse.Namespace,
    *,
    nvml: Any = None,
    locks: DirLocks | None = None,
    stamp: config.FileStamp | None = None,
    created: Sequence[str] = (),
    file_config: config.Config | None = None,
    file_keys: Collection[str] = (),
) -> int:
    """Open the backend and run the daemon until it stops (holding ``locks`` in its
    directories; ``stamp``: the config file's, taken before ``cfg`` was read; ``created``:
    what :func:`make_dirs` made, said in the log; ``file_config``: the file's own values,
    flags not applied; ``file_keys``: the keys the file sets); its exit status."""
    logsetup.configure(cfg.daemon.log_level, journald="JOURNAL_STREAM" in os.environ)
    for line in created:
        log.info("%s", line)
    path = str(args.config or config.DEFAULT_PATH)
    warnings = (
        *config.config_warnings(cfg, path=path),
        *readable_secrets(cfg),
        mps_binary_warning(cfg, path=path, keys=file_keys),
    )
    for warning in filter(None, warnings):
        log.warning("%s", warning)

    from gpud.daemon import Daemon

    try:
        backend, sim = open_backend(cfg, nvml=nvml)
    except GpudError as err:
        message, code = backend_failure(err)
        print(message, file=sys.stderr)
        return code
    cgroups, no_cgroups = mps_cgroups(cfg)
    try:
        daemon = Daemon(
            cfg,
            backend=backend,
            sim=sim,
            mps_control_command=mps_control_command(cfg),
            mps_cgroups=cgroups,
            no_mps_cgroups=no_cgroups,
            notifier=Notifier.from_environ(os.environ),
            reload_config=lambda: load_layers(args),
            file_config=file_config,
            dir_locks=locks,
            config_path=str(args.config or config.DEFAULT_PATH),
            config_stamp=stamp,
        )
        return serve_until_stopped(daemon.run())
    except ConfigError as err:  # what the operator must change: no restart mends it
        print(f"gpud: config error: {err}", file=sys.stderr)
        return 2
    except StateDamaged as err:
        print(f"gpud: {err} {NOT_RESTARTED}", file=sys.stderr)
        return EXIT_STATE_DAMAGED
    except GpudError as err:
        print(f"gpud: {err}", file=sys.stderr)
        return 1


WORKER_PREFIX = "gpud-worker"  # the daemon loop's worker threads (asyncio.to_thread)


def serve_until_stopped(run: Coroutine[Any, Any, int]) -> int:
    """``asyncio.run(run)``, but the loop's close does not wait for its worker threads: one
    stuck in a driver call that never returns (a GPU that stopped answering mid-apply) is
    left behind, as the stopped daemon logged (its plan is finished at the next start)."""
    loop = asyncio.new_event_loop()
    loop.set_default_executor(StartTellingExecutor(thread_name_prefix=WORKER_PREFIX))
    try:
        return loop.run_until_complete(run)
    finally:
        try:
            # as asyncio.run: what is still pending is cancelled and let finish
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:  # gather() of nothing would belong to another loop
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()  # shuts the default executor down without waiting


def exit_leaving_stuck_threads(
    code: int, *, exit_now: Callable[[int], object] = os._exit, grace_s: float = EXIT_GRACE_S
) -> None:
    """Exit with ``code`` at once when a worker thread is still stuck ``grace_s`` after the
    loop closed (interpreter exit would join it, for as long as the driver call hangs);
    otherwise return, for the ordinary exit. Idle workers end within the grace: the closed
    loop told them to."""
    deadline = time.monotonic() + grace_s
    stuck = []
    for t in threading.enumerate():
        if t.name.startswith(WORKER_PREFIX):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                stuck.append(t)
    if not stuck:
        return
    print(
        f"gpud: exiting without {len(stuck)} thread(s) stuck in a call (a GPU that does not"
        " answer)",
        file=sys.stderr,
    )
    sys.stdout.flush()
    sys.stderr.flush()
    exit_now(code)


if __name__ == "__main__":
    sys.exit(main())
