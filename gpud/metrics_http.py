"""The ``/metrics`` HTTP listener: prometheus_client's WSGI app on a bounded threading server.

Each connection is served on a thread of its own, as prometheus_client's own server does,
with two bounds it lacks: a connection is given ``connection_timeout_s`` in all to send its
request (one that sends nothing, a port scanner or a half-open peer, and one that sends a
byte now and then, never its whole request, are closed alike once it is spent) and as long
again, from the reply's first byte, to take its reply (one that stops reading is closed, and
logged at debug level only); and at most ``max_connections`` are served at once.
One more is answered ``503 Service Unavailable`` (``Retry-After: 1``) and closed at once, so a
flood of connections (queued by the kernel up to ``net.core.somaxconn``, not dropped) costs a
few bytes each instead of a thread and its stack for the whole
timeout, and a scrape gets through as soon as one of them ends. Prometheus scrapes over one
connection per target; :data:`MAX_CONNECTIONS` leaves room for several Prometheus servers,
``curl`` and a dashboard's probes.

Only ``/metrics`` serves the exposition (``GET``, and ``HEAD`` for its headers alone); ``/``
answers a line naming it, and any other path ``404 Not Found``, so a scrape job with a
mistyped ``metrics_path`` fails instead of scraping the metrics under a wrong name.
"""

from __future__ import annotations

import io
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any, cast
from urllib.parse import parse_qs, urlencode
from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger(__name__)

CONNECTION_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 32
_BUSY = b"HTTP/1.0 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n"
_WARN_EVERY_S = 60.0
METRICS_PATH = "/metrics"
# seconds between the serving thread's looks at a shutdown: the most stopping it waits
METRICS_POLL_S = 0.5
_ALLOW = "GET, HEAD, OPTIONS"
# the samples of a histogram: docs/metrics.md names one by its base name, while
# prometheus_client's ``name[]`` filter matches sample names alone
_HISTOGRAM_SAMPLES = ("_bucket", "_count", "_sum")

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def metrics_app(registry: CollectorRegistry) -> WsgiApp:
    """prometheus_client's WSGI app for ``registry`` (``Accept`` for OpenMetrics, gzip,
    ``?name[]=``, a histogram named by its base name too) on :data:`METRICS_PATH` only,
    with ``HEAD`` answered as ``GET`` without the body (``Content-Length`` as ``GET`` would send)."""
    exposition: WsgiApp = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        method = environ.get("REQUEST_METHOD", "GET")
        if path != METRICS_PATH:
            if path == "/":
                status, text = "200 OK", f"gpud: metrics are at {METRICS_PATH}\n"
            else:
                status, text = "404 Not Found", f"404 Not Found: metrics are at {METRICS_PATH}\n"
            return _reply(start_response, status, text, method)
        if method == "OPTIONS":
            start_response("200 OK", [("Allow", _ALLOW), ("Content-Length", "0")])
            return [b""]
        if method not in ("GET", "HEAD"):
            text = f"405 Method Not Allowed: {method}; use {_ALLOW}\n"
            return _reply(start_response, "405 Method Not Allowed", text, method)
        environ = {**environ, "QUERY_STRING": _histograms_named(environ.get("QUERY_STRING", ""))}
        if method == "GET":
            return exposition(environ, start_response)
        reply: list[Any] = []
        body = b"".join(
            exposition({**environ, "REQUEST_METHOD": "GET"}, lambda *a: reply.extend(a))
        )
        status, headers = reply[0], list(reply[1])
        start_response(status, [*headers, ("Content-Length", str(len(body)))])
        return [b""]

    return app


def _histograms_named(query: str) -> str:
    """``query`` with each ``name[]`` also as a histogram's samples, so that
    ``?name[]=gpud_loop_duration_seconds`` scrapes its buckets, count and sum rather than
    nothing (a name of another family gains names no sample has)."""
    params = parse_qs(query, keep_blank_values=True)
    names = params.get("name[]")
    if not names:
        return query
    params["name[]"] = [*names, *(n + s for n in names for s in _HISTOGRAM_SAMPLES)]
    return urlencode(params, doseq=True)


def _reply(start_response: Callable[..., Any], status: str, text: str, method: str) -> list[bytes]:
    body = text.encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(body)))]
    if status.startswith("405"):
        headers.append(("Allow", _ALLOW))
    start_response(status, headers)
    return [b""] if method == "HEAD" else [body]


class _Budget:
    """``limit_s`` seconds (on ``clock``) in all for one direction of ``sock``, counted from
    :meth:`start`: a socket timeout alone restarts at every byte that moves, so a peer that
    trickles its request, or reads its reply a byte at a time, would hold its thread, and its
    slot, for as long as it likes."""

    def __init__(
        self, sock: socket.socket, limit_s: float, clock: Callable[[], float], what: str
    ) -> None:
        self._sock = sock
        self._limit_s = limit_s
        self._clock = clock
        self._what = what
        self._deadline: float | None = None

    def start(self) -> float:
        if self._deadline is None:
            self._deadline = self._clock() + self._limit_s
        return self._deadline

    def spent(self) -> TimeoutError:
        return TimeoutError(f"{self._what} within {self._limit_s:g} s")

    def arm(self) -> None:
        """Give the socket's next call what is left (the socket's one timeout serves reads
        and writes alike, so each sets its own before it waits)."""
        left = self.start() - self._clock()
        if left <= 0:
            raise self.spent()
        self._sock.settimeout(left)


class _DeadlineReader(io.RawIOBase):
    """The bytes of the request, all within ``budget`` of the connection's start."""

    def __init__(self, sock: socket.socket, budget: _Budget) -> None:
        super().__init__()
        self._sock = sock
        self._budget = budget
        budget.start()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._budget.arm()
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError as e:  # the socket's own says only "timed out"
            raise self._budget.spent() from e


class _DeadlineWriter(io.BufferedIOBase):
    """The reply, all sent within ``budget`` of its first byte: a request that took most of
    its own time to arrive still gets the whole of this for its reply."""

    def __init__(self, sock: socket.socket, budget: _Budget) -> None:
        super().__init__()
        self._sock = sock
        self._budget = budget

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._budget.arm()
        try:
            self._sock.sendall(data)  # its timeout bounds the whole call, not each send
        except TimeoutError as e:
            raise self._budget.spent() from e
        with memoryview(data) as view:
            return view.nbytes


class _QuietServerHandler(ServerHandler):
    """A reply its peer stopped taking (timed out, reset) logged at debug level, not as a
    traceback on stderr (the journal), and no error page written to a peer that does not
    read; any other error of the app is wsgiref's to report."""

    request_handler: WSGIRequestHandler

    def handle_error(self) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, (TimeoutError, ConnectionError)):
            super().handle_error()
            return
        log.debug("/metrics: reply to %s cut: %s", self.request_handler.client_address[0], exc)


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape on stderr (the journal); the whole request read within
    ``timeout`` seconds of the connection's start (:class:`_DeadlineReader`), the whole reply
    sent within as long from its first byte (:class:`_DeadlineWriter`)."""

    def setup(self) -> None:
        super().setup()
        clock: Callable[[], float] = getattr(self.server, "clock", time.monotonic)
        if self.timeout is not None:
            sock = self.connection
            request = _Budget(sock, self.timeout, clock, "/metrics: request not received")
            self.rfile = io.BufferedReader(_DeadlineReader(sock, request))
            self.wfile = _DeadlineWriter(sock, _Budget(sock, self.timeout, clock, "reply not sent"))

    def handle(self) -> None:
        # WSGIRequestHandler.handle, but with a ServerHandler of our own: its ServerHandler
        # prints a traceback to stderr for a reply that timed out
        self.raw_requestline = self.rfile.readline(65537)
        if len(self.raw_requestline) > 65536:
            self.requestline = ""
            self.request_version = ""
            self.command = ""
            self.send_error(414)
            return
        if not self.parse_request():
            return
        # wsgiref passes the handler's wfile as it is: it only writes and flushes it
        wfile = cast(IO[bytes], self.wfile)
        handler = _QuietServerHandler(
            self.rfile, wfile, self.get_stderr(), self.get_environ(), multithread=False
        )
        handler.request_handler = self
        handler.run(self.server.get_app())  # type: ignore[attr-defined]

    def log_message(self, format: str, *args: Any) -> None:
        pass


class MetricsServer(ThreadingWSGIServer):
    """A thread per connection, at most ``max_connections`` of them (:attr:`busy_refusals`
    counts the connections answered 503 for want of one)."""

    max_connections = MAX_CONNECTIONS
    clock = staticmethod(time.monotonic)
    # the kernel's queue of connections not yet accepted (listen(2)'s backlog, capped by
    # net.core.somaxconn): socketserver's 5 drops the rest of a burst, whose clients resend
    # their SYN after 1 s, 3 s, 7 s... (a scrape among them past its timeout); queued, each is
    # served or answered 503 at once. start_metrics_server asks for net.core.somaxconn itself
    request_queue_size = socket.SOMAXCONN

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self.busy_refusals = 0
        self._warned_at: float | None = None

    def process_request(self, request: Any, client_address: Any) -> None:
        if self._slots.acquire(blocking=False):
            try:
                super().process_request(request, client_address)
            except BaseException:  # no thread started: nothing else gives the slot back
                self._slots.release()
                raise
            return
        self.busy_refusals += 1
        now = self.clock()
        if self._warned_at is None or now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                "/metrics: already serving %d connections, the most at once: answered %s 503"
                " (%d connections refused since start; logged at most once a minute)",
                self.max_connections,
                client_address[0] if client_address else "a client",
                self.busy_refusals,
            )
        try:
            request.setblocking(False)
            request.send(_BUSY)  # best effort: never wait on a peer that does not read
        except OSError:
            pass
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver prints a traceback to stderr (the journal) for each connection that
        # timed out or reset: a port scan would fill the journal with them
        log.debug("/metrics: connection from %s ended", client_address, exc_info=True)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def listen_backlog(proc_root: Path = Path("/proc")) -> int:
    """``net.core.somaxconn`` as ``<proc_root>/sys/net/core/somaxconn`` says it: the longest
    accept queue the kernel gives a listening socket (an operator may have raised it past
    ``socket.SOMAXCONN``, the 4096 Python was built with, which stands in where it is
    unreadable)."""
    try:
        return int((proc_root / "sys/net/core/somaxconn").read_text())
    except (OSError, ValueError):
        return socket.SOMAXCONN


def start_metrics_server(
    registry: CollectorRegistry,
    host: str,
    port: int,
    *,
    connection_timeout_s: float = CONNECTION_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
    clock: Callable[[], float] = time.monotonic,
    proc_root: Path = Path("/proc"),
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``registry`` as Prometheus text on ``http://host:port/metrics`` (:func:`metrics_app`)
    from a thread
    (``ss -ltnp`` shows gpud listening there).

    ``port=0`` picks a free port (``server.server_port`` says which); an IPv6 ``host`` binds
    an IPv6 socket. Stop it with :func:`stop_metrics_server`. ``clock`` (monotonic) times
    each connection's ``connection_timeout_s``, for its request and again for its reply; the
    kernel queues up to ``net.core.somaxconn`` connections not yet accepted
    (:func:`listen_backlog` reads it under ``proc_root``).
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type(
        "MetricsServer",
        (MetricsServer,),
        {
            "address_family": family,
            "max_connections": max_connections,
            "clock": staticmethod(clock),
            "request_queue_size": listen_backlog(proc_root),
        },
    )
    handler = type("MetricsHandler", (_QuietHandler,), {"timeout": connection_timeout_s})
    server: WSGIServer = make_server(
        host, port, metrics_app(registry), server_class, handler_class=handler
    )
    thread = threading.Thread(
        target=server.serve_forever,
        kwargs={"poll_interval": METRICS_POLL_S},
        name="gpud-metrics",
        daemon=True,
    )
    thread.start()
    return server, thread


def stop_metrics_server(
    server: WSGIServer, thread: threading.Thread, timeout_s: float = 5.0
) -> None:
    """Stop serving (within :data:`METRICS_POLL_S`), close the listening socket, and wait
    for the serving thread (connections being served are left to their daemon threads)."""
    server.shutdown()
    server.server_close()
    thread.join(timeout_s)
