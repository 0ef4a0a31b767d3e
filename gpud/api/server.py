"""The daemon's gRPC server: grpc.aio on a unix socket (and optionally TCP).

::

    server = ApiServer(run_dir / "gpud.sock", socket_group="gpud",
                       servicers=[NodeServicer(...).register])
    await server.start()      # socket ready: 0660, group "gpud"; health SERVING
    ...
    await server.stop(grace=5) # health NOT_SERVING, calls drain, socket removed

Access control is the socket's file mode: ``srw-rw---- root:gpud``, so members of the group
may use ``gpuctl`` without root (``ss -xlp | grep gpud.sock`` shows the listener). Every
service gets the standard health service (``grpc.health.v1.Health``) and the error mapping
of :mod:`gpud.api.interceptors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import stat
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gpud import files
from gpud.api import validate
from gpud.api.access import TcpAccess, guard, tcp_warning
from gpud.api.gate import CallGate
from gpud.api.interceptors import ErrorMappingInterceptor
from gpud.config import MAX_UNIX_PATH, file_kind, socket_gid
from gpud.errors import ConfigError, FailedPrecondition, GpudError

log = logging.getLogger(__name__)

Registrar = Callable[[Any], None]
"""Adds one service to a ``grpc.aio.Server`` (e.g. ``NodeServicer.register``)."""

SOCKET_MODE = 0o660
# A bounded request size keeps a garbage client from costing memory: gRPC refuses a larger
# message (RESOURCE_EXHAUSTED) before decoding it. Responses (every GPU's MIG table) are larger.
_MAX_SEND_BYTES = 16 * 1024 * 1024
# Connections that hold a descriptor and do nothing (a port scan, a client that stopped
# half-way, or thousands opened on purpose on api.tcp_address until gpud runs out of
# descriptors and stops answering on its socket too) are closed: one that has not finished
# its HTTP/2 (and TLS) handshake after HANDSHAKE_TIMEOUT_S, one without a call for
# IDLE_TIMEOUT_S (GOAWAY; a gRPC client reconnects at its next call by itself).
HANDSHAKE_TIMEOUT_S = 10.0
IDLE_TIMEOUT_S = 60.0
# Calls api.tcp_address serves at once (a stream counts while open); more are refused with
# RESOURCE_EXHAUSTED. It has a gRPC server of its own, so that thousands of streams held
# open there (WatchAttributes, GetEntry waits: about 20 KiB each, a request up to
# MAX_REQUEST_BYTES) bound gpud's memory and never take a call from the unix socket.
TCP_MAX_CALLS = 1024
# api.tcp_address pings a connection with an open call after this long without traffic, and
# closes it unless the ping is answered within TCP_KEEPALIVE_TIMEOUT_S: the calls of a client
# gone without a word (its host down, a cable pulled) end, and free what they held (a
# WatchEvents watcher's place). The unix socket's callers are local: their end closes.
# Pings go on however long a call stays quiet (an idle WatchEvents): no cap on the pings
# sent without data (grpc.http2.max_pings_without_data 0, said outright: gRPC core's default
# stops pinging after 2 on a client's side). The server's min_recv_ping_interval applies to
# the pings it receives, not to its own; a client answers pings whatever their rate.
TCP_KEEPALIVE_S = 60.0
TCP_KEEPALIVE_TIMEOUT_S = 20.0
# A server whose socket file was removed keeps the connections it has (ApiServer.keep_socket)
# until its socket is removed once more: then it stops, its calls given this long to end.
RETIRED_GRACE_S = 60.0


def connection_options(
    handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, idle_timeout_s: float = IDLE_TIMEOUT_S
) -> list[tuple[str, int]]:
    """gRPC server options that close connections left doing nothing (every gpud server's)."""
    return [
        ("grpc.server_handshake_timeout_ms", round(handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", round(idle_timeout_s * 1000)),
    ]


class ApiServer:
    """gRPC server on ``socket_path`` (mode 0660, group ``socket_group``) and ``tcp_address``.

    ``servicers`` are registrars, each called once with the ``grpc.aio.Server`` at
    :meth:`start`. ``tcp_address`` (``"host:port"``, port 0 picks one: see
    :attr:`tcp_port`) is served with ``tcp_credentials``, or without TLS when None; what it
    serves is ``tcp_access`` (:mod:`gpud.api.access`: reads and jobs' reports, or every
    method), at most ``tcp_max_calls`` calls at once. A connection that has not finished its
    handshake after ``handshake_timeout_s``, or has made no call for ``idle_timeout_s``, is
    closed (:func:`connection_options`). ``gate`` counts the calls that change the node,
    for a stop to answer them first (:mod:`gpud.api.gate`).
    """

    def __init__(
        self,
        socket_path: Path,
        *,
        socket_group: str | None = None,
        tcp_address: str | None = None,
        tcp_credentials: Any = None,
        tcp_access: TcpAccess = "read",
        servicers: Sequence[Registrar] = (),
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        tcp_max_calls: int = TCP_MAX_CALLS,
        gate: CallGate | None = None,
    ) -> None:
        self.socket_path = socket_path
        self._gate = gate
        self.socket_group = socket_group
        self.tcp_address = tcp_address
        self._tcp_credentials = tcp_credentials
        self.tcp_access: TcpAccess = tcp_access
        self._registrars = list(servicers)
        self._connection_options = connection_options(handshake_timeout_s, idle_timeout_s)
        self.tcp_max_calls = tcp_max_calls
        self._server: Any = None
        self._tcp_server: Any = None
        self._health: Any = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the file bound
        # servers bound at the socket path itself (no room for a temporary name: _bind),
        # kept until the stop (gRPC would remove the path, their successor's file, as they
        # stop)
        self._kept: list[Any] = []
        self._at_path = True  # the serving one is bound at the path itself
        self._retired: Any = None  # the one that served until the file was removed last
        self._dir_said = ""  # why keep_socket cannot make the socket's directory, said once
        # what took the socket's path (st_dev, st_ino, S_IFMT), said
        self._taken_said: tuple[int, int, int] | None = None
        # servers on files removed before, stopping (RETIRED_GRACE_S), and their tasks
        self._stopping: dict[asyncio.Task[None], Any] = {}
        self.tcp_port: int | None = None

    @property
    def running(self) -> bool:
        return self._server is not None

    def _group_id(self) -> int | None:
        if self.socket_group is None:
            return None
        return socket_gid(self.socket_group)

    def _clear_stale_socket(self) -> None:
        """Remove a socket file left by a daemon that died; refuse if one still listens."""
        path = self.socket_path
        try:
            st = path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise FailedPrecondition(f"{path} exists and is not a socket: refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(str(path))
        except OSError:
            log.info("removing stale socket %s", path)
            path.unlink(missing_ok=True)
            return
        finally:
            probe.close()
        raise FailedPrecondition(f"another process is serving on {path}: is gpud already running?")

    async def start(self) -> None:
        """Bind, register every service, start serving; health becomes SERVING."""
        if self._server is not None:
            raise RuntimeError("ApiServer already started")
        path = self.socket_path
        if len(os.fsencode(path)) > MAX_UNIX_PATH:
            raise ConfigError(
                f"unix socket path is longer than {MAX_UNIX_PATH} bytes: {path}", key="api.socket"
            )
        gid = self._group_id()  # before binding: a bad group leaves nothing behind
        # gpud's main made it (and said so); 0711 here too, whatever the umask, and refused
        # where another user could plant links, as keep_socket does
        files.make_dir(path.parent, "api.socket", files.RUN_DIR_MODE)
        self._clear_stale_socket()
        _clear_stale_temps(path)

        self._health = health.aio.HealthServicer()
        server = self._new_server(None)
        tcp = None
        if self.tcp_address is not None:
            keepalive = [
                ("grpc.keepalive_time_ms", round(TCP_KEEPALIVE_S * 1000)),
                ("grpc.keepalive_timeout_ms", round(TCP_KEEPALIVE_TIMEOUT_S * 1000)),
                ("grpc.http2.max_pings_without_data", 0),
            ]
            tcp = self._new_server(self.tcp_max_calls, keepalive)
        try:
            at_path = await self._bind(server)
        except FileExistsError:  # another gpud bound it since the check above
            await _stop_all((server, tcp), None)
            raise FailedPrecondition(
                f"another process is serving on {path}: is gpud already running?"
            ) from None
        except OSError as err:
            await _stop_all((server, tcp), None)
            raise GpudError(f"gRPC server cannot listen on {path}: {err}") from err
        except GpudError:
            await _stop_all((server, tcp), None)
            raise
        try:
            if tcp is not None and self.tcp_address is not None:
                if self._tcp_credentials is not None:
                    port = tcp.add_secure_port(self.tcp_address, self._tcp_credentials)
                else:
                    port = tcp.add_insecure_port(self.tcp_address)
                if port == 0:
                    raise RuntimeError(f"cannot bind {self.tcp_address}")
                self.tcp_port = port
                warning = tcp_warning(self.tcp_address, self.tcp_access)
                if warning:
                    log.warning("%s", warning)
        except RuntimeError as err:
            await _stop_all((server, tcp), None)
            self._remove_own_socket()
            raise GpudError(
                f"gRPC server cannot listen on {path} / {self.tcp_address}: {err}"
            ) from err
        if tcp is not None:
            await tcp.start()
        try:
            self._own_socket(gid)
        except OSError as err:
            await _stop_all((server, tcp), None)
            self._remove_own_socket()
            raise GpudError(f"cannot set mode/group of {path}: {err}") from err
        self._server, self._tcp_server, self._at_path = server, tcp, at_path
        await self.set_serving(True)
        log.info(
            "gRPC API on %s (mode %o, group %s)%s",
            path,
            SOCKET_MODE,
            self.socket_group or "unchanged",
            f" and {self.tcp_address}" if self.tcp_address else "",
        )

    def _own_socket(self, gid: int | None) -> None:
        """Give the socket just bound its mode and group. gRPC creates
        it with the process umask (0027 under systemd, at least 0022 from gpud's main: no
        one but root may connect until then, so group members cannot yet); the mode and
        group are set right after the bind. Never through a symbolic link planted in its
        place (os.chmod cannot be told not to follow one on every platform): only the file
        bound."""
        st = self.socket_path.lstat()
        if (st.st_dev, st.st_ino) != self._socket_id:
            raise OSError(f"{self.socket_path} is no longer the socket gpud bound")
        try:
            os.chmod(self.socket_path, SOCKET_MODE, follow_symlinks=False)
        except NotImplementedError:  # not without following: the check above holds
            os.chmod(self.socket_path, SOCKET_MODE)
        if gid is not None:
            os.chown(self.socket_path, -1, gid, follow_symlinks=False)  # never a planted link

    def _remove_own_socket(self) -> None:
        """Remove the socket file if it is still the one this server bound: another gpud
        may have bound its own there since (the run directory removed and made again)."""
        with contextlib.suppress(FileNotFoundError):
            st = self.socket_path.lstat()
            if (st.st_dev, st.st_ino) == self._socket_id:
                self.socket_path.unlink()

    async def _bind(self, server: Any) -> bool:
        """Bind ``server`` to the socket path and start it; True when it is bound at the
        path itself (no room for a temporary name), False when at a temporary name.

        gRPC removes the file of a unix listener as it closes it, by its path: a server
        bound at the socket path itself would remove whatever is there as it stops (a
        newer gpud's socket, or the one bound again by :meth:`keep_socket`). So it binds a
        temporary name beside it (``.gpud.sock.PID.N~``: the process's own, as two gpuds
        whose ``api.socket`` is the same file may bind at once, and a new one each time,
        as a server stopping removes its name), which is then linked to the path (never
        over a file put there meanwhile: FileExistsError) and removed, and is the name
        gRPC removes later."""
        path = self.socket_path
        temp = path.with_name(f"{_temp_prefix(path)}{os.getpid()}.{next(_BINDS)}~")
        at_path = len(os.fsencode(temp)) > MAX_UNIX_PATH
        bind = path if at_path else temp
        if not at_path:  # one of a process with this pid that died before its link
            with contextlib.suppress(OSError):  # else the bind says why it cannot
                temp.unlink(missing_ok=True)
        try:
            port = server.add_insecure_port(f"unix:{bind}")
        except RuntimeError:  # grpcio's "Failed to bind to address", with no reason
            port = 0
        if port == 0:
            await server.stop(None)
            if not at_path:
                with contextlib.suppress(OSError):
                    temp.unlink(missing_ok=True)
            raise GpudError(
                f"gRPC server cannot listen on {path}: cannot bind a unix socket"
                + ("" if at_path else f" at {temp.name}")
                + f" in {path.parent}"
            )
        await server.start()
        # the file bound, before it is linked: at the path, another's may replace it since
        st = bind.lstat()
        if not at_path:
            try:
                os.link(temp, path)
            except OSError:
                await server.stop(None)
                raise
            finally:
                temp.unlink(missing_ok=True)
        self._socket_id = (st.st_dev, st.st_ino)
        return at_path

    async def keep_socket(self) -> bool:
        """Bind the unix socket again when its file is gone (``rm`` of it or of the run
        directory, a cleaner of ``/run``): the server still listens on the removed file,
        but no new ``gpuctl`` can reach it, and ``systemctl start gpud`` does nothing for a
        gpud that runs. A new server takes the path (its directory made again, 0711); the
        one before keeps serving the connections it has (a ``gpuctl run`` waiting in the
        queue) until gpud stops or the file is removed again: then it stops, in the
        background, with ``RETIRED_GRACE_S`` for its calls to end, so that a cleaner
        removing the file over and over keeps at most one such server (one bound at the
        path itself, see :meth:`_bind`, is kept until gpud stops). Something else in the
        socket's place (a file, a directory, another process's socket) is left alone, said
        once in the log (``gpuctl`` then says gpud is not running), and so is a
        directory another user could plant files in (:func:`gpud.files.make_dir`: said in
        the log once, False). True when it bound again; OSError or GpudError when it cannot
        (said by the caller, tried again at its next call)."""
        if self._server is None:
            return False
        path = self.socket_path
        try:
            st = path.lstat()
        except FileNotFoundError:
            pass
        else:
            self._say_taken(path, st)
            return False  # ours, or another's to leave alone
        try:
            # made again as at the start: refused where another user could plant links
            files.make_dir(path.parent, "api.socket", files.RUN_DIR_MODE)
        except ConfigError as err:
            if str(err) != self._dir_said:
                self._dir_said = str(err)
                log.error("the socket %s was removed and cannot be bound again: %s", path, err)
            return False
        self._dir_said = ""
        gid = self._group_id()
        server = self._new_server(None)
        at_path = await self._bind(server)
        try:
            self._own_socket(gid)
        except OSError:
            await server.stop(None)
            self._remove_own_socket()
            raise
        previous, self._server = self._server, server
        self._taken_said = None
        if self._at_path:
            self._kept.append(previous)
        else:
            older, self._retired = self._retired, previous
            if older is not None:
                task = asyncio.get_running_loop().create_task(older.stop(RETIRED_GRACE_S))
                self._stopping[task] = older
                task.add_done_callback(self._stopped)
        self._at_path = at_path
        log.warning(
            "the socket %s was removed while gpud ran: listening on it again (mode %o, group %s)",
            path,
            SOCKET_MODE,
            self.socket_group or "unchanged",
        )
        return True

    def _say_taken(self, path: Path, st: os.stat_result) -> None:
        """Say once in the log what took the socket's path while gpud ran (a directory, a
        file, another socket): gpud leaves it alone, and ``gpuctl`` reaches no gpud there,
        so the journal is where an operator learns why. Known by its inode and its kind:
        ext4 gives a freed inode to the next file made, so a directory removed and a file
        made in its place can share the inode, and each is said."""
        if stat.S_ISSOCK(st.st_mode) and (st.st_dev, st.st_ino) == self._socket_id:
            # gpud's own socket put back (moved away and back): what takes its place
            # later is said again, on whatever inode
            self._taken_said = None
            return
        found = (st.st_dev, st.st_ino, stat.S_IFMT(st.st_mode))
        if found == self._taken_said:
            return
        self._taken_said = found
        if stat.S_ISSOCK(st.st_mode):
            log.warning(
                "the socket %s was replaced by a socket gpud did not bind while gpud ran: "
                "gpuctl reaches whatever listens on that one, not this gpud (with nothing "
                "listening, it says gpud is not running), until that is removed; gpud then "
                "listens there again",
                path,
            )
            return
        log.warning(
            "the socket %s was replaced by %s while gpud ran: gpuctl cannot reach gpud (it "
            "says gpud is not running) until that is removed; gpud then listens there again",
            path,
            file_kind(st.st_mode),
        )

    def _stopped(self, task: asyncio.Task[None]) -> None:
        self._stopping.pop(task, None)
        if not task.cancelled() and task.exception() is not None:
            log.warning("stopping a retired gRPC server failed: %s", task.exception())

    def _new_server(self, max_calls: int | None, options: Sequence[tuple[str, int]] = ()) -> Any:
        """A gRPC server with every service, the health service and the error mapping."""
        server = grpc.aio.server(
            interceptors=[
                ErrorMappingInterceptor(
                    allowed=guard(self.tcp_access, str(self.socket_path)), gate=self._gate
                )
            ],
            options=[
                ("grpc.max_receive_message_length", validate.MAX_REQUEST_BYTES),
                ("grpc.max_send_message_length", _MAX_SEND_BYTES),
                *self._connection_options,
                *options,
            ],
            maximum_concurrent_rpcs=max_calls,
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        for register in self._registrars:
            register(server)
        return server

    async def set_serving(self, serving: bool, service: str = "") -> None:
        """Set the health status of ``service`` ("" is the whole daemon)."""
        if self._health is None:
            raise RuntimeError("ApiServer not started")
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._health.set(service, status)

    async def stop(self, grace: float | None = 5.0) -> None:
        """Stop accepting calls, let running ones finish for ``grace`` seconds, remove the socket.

        Safe to call twice, or without :meth:`start`.
        """
        server, self._server = self._server, None
        tcp, self._tcp_server = self._tcp_server, None
        retired, self._retired = self._retired, None
        kept, self._kept = self._kept, []
        stopping, self._stopping = self._stopping, {}
        if server is None:
            return
        if self._health is not None:
            # every service reports NOT_SERVING to health watchers before the listeners close
            await self._health.enter_graceful_shutdown()
        # those stopping already: stopped again with ``grace``, the more pressing of the two
        await _stop_all((server, tcp, retired, *kept, *stopping.values()), grace)
        await asyncio.gather(*stopping, return_exceptions=True)
        self._remove_own_socket()  # only our own: a newer gpud may have bound its own there
        log.info("gRPC API stopped")

    async def wait_for_termination(self) -> None:
        """Until the server stops (for a daemon that has nothing else to wait on)."""
        if self._server is not None:
            await self._server.wait_for_termination()


_BINDS = itertools.count(1)  # numbers the temporary names of the process's binds


def _temp_prefix(path: Path) -> str:
    return f".{path.name}."


def _clear_stale_temps(path: Path, *, euid: int | None = None) -> None:
    """Remove the temporary socket names (:meth:`ApiServer._bind`) beside ``path`` of
    processes that are gone: killed between their bind and link. A name of a process that
    runs is left alone (another gpud whose ``api.socket`` is the same file, binding now).

    Older gpuds named theirs ``.gpud.sock.N~``, without their pid: one is removed only when
    it is a socket of gpud's user (``euid``; None: this process's) that nothing listens on
    (a connect is refused, as ``ss -xl`` would not list it); a name still bound, a file of
    another kind or another user's is left alone."""
    prefix = _temp_prefix(path)
    owner = os.geteuid() if euid is None else euid
    with contextlib.suppress(OSError):
        for entry in path.parent.iterdir():
            if not (entry.name.startswith(prefix) and entry.name.endswith("~")):
                continue
            pid, dot, n = entry.name.removeprefix(prefix).removesuffix("~").partition(".")
            if dot and pid.isdigit() and n.isdigit():
                stale = not _alive(int(pid))
            else:
                stale = not dot and pid.isdigit() and _unserved(entry, owner)
            if stale:
                with contextlib.suppress(OSError):
                    if stat.S_ISSOCK(entry.lstat().st_mode):
                        entry.unlink()
                        log.info("removing stale socket %s", entry)


def _unserved(entry: Path, owner: int) -> bool:
    """Whether ``entry`` is a unix socket of uid ``owner`` that nothing listens on: a
    connect to it is refused (ECONNREFUSED), not answered, nor failed for another reason."""
    try:
        st = entry.lstat()
    except OSError:
        return False
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != owner:
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(entry))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (this one does)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's
        return True
    return True


async def _stop_all(servers: Sequence[Any], grace: float | None) -> None:
    """Stop the servers that are there (None: not made) together."""
    await asyncio.gather(*(s.stop(grace) for s in servers if s is not None))
