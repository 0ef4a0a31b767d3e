"""Fuzz every RPC of a running ``gpud --simulate`` and watch its memory.

::

    .venv/bin/python -m tools.fuzz_api [--requests 3000] [--big 300] [--seed 1]

Starts a simulated node (MPS on), then sends ``--requests`` requests to random methods of
every service on its socket (a server stream is read for its first message, then
cancelled, a WatchEvents, which may match nothing for hours, only until gpud has set it up;
ClusterPeer, served only on the peer port, is left out unless ``--peer``): messages filled field
by field from the descriptors with random values (odd unicode, empty and long strings, extreme and negative integers, NaN and infinite doubles,
long repeated fields, unknown enum numbers), ``--big`` of them carrying a 1 MB string in a
random string field, and one in twenty raw bytes that are no valid message at all. Half
the GetEntry calls ask for a real entry that stays queued (the node's GPUs are reserved
first), so that their ``wait_s`` (NaN, infinite, negative, huge, 0, a fraction) is taken
and waited out, not cut short by an unknown id.

Prints the outcome codes, then those of the requests with 1 MB in them (every one over
gpud's MAX_REQUEST_BYTES, so RESOURCE_EXHAUSTED from gRPC itself, before gpud decodes it;
each other outcome named with its method and the field that held the 1 MB, ``request`` for
raw bytes), and the daemon's resident set: after start, after a warm-up that
calls every method three times with an empty request, and after the fuzzing. Exits 1 if the
daemon died, answered INTERNAL or UNKNOWN, answered a 1 MB request otherwise than
RESOURCE_EXHAUSTED, or grew more than ``--max-growth-mb`` (default 20) from the warm state. A SIGTERM
or SIGINT stops it cleanly: the daemon stopped, with its MPS control daemons, its directory
removed, what was measured so far printed, "cut short by SIGNAL", dying by it (128 + its number).

gpud runs as the shipped unit runs it: with the variables of ``systemd/gpud.service``'s
``Environment=`` added to the caller's environment (glibc's malloc tunables: its RSS is then
the installed daemon's), a variable the caller sets itself winning (``GLIBC_TUNABLES=``: glibc's
defaults). The first line names them: ``gpud pid PID, run dir DIR, env NAME=VALUE``.

``--peer`` fuzzes ``gpud.v1.ClusterPeer`` instead, as a certified but buggy or hostile
node would: the simulated node leads a cluster of its own (a throw-away etcd,
:mod:`tools.etcd_local`; a CA and certificates, :mod:`tools.certs`), and the requests go to
its peer port over mutual TLS with a certificate of that CA for node ``fuzz-peer``, half the
Report and GetOrder ones naming that node (so that they pass the identity check and reach
the report's own bounds), once it answers as leader. The peer port takes messages up to
16 MiB, so a request with 1 MB in it is refused by gpud (INVALID_ARGUMENT, naming the field)
rather than by gRPC: any other outcome of one is the failure there.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psutil

from gpud.shared import WATCHING_KEY
from gpud.v1 import (
    cluster_pb2,
    cluster_pb2_grpc,
    colo_pb2,
    jobs_pb2,
    mig_pb2,
    mps_pb2,
    net_pb2,
    node_pb2,
    node_pb2_grpc,
    queue_pb2,
)
from tools.certs import make_ca, make_node
from tools.etcd_local import LocalEtcd, free_port
from tools.simdaemon import (
    SimDaemon,
    as_installed,
    cut_short,
    exit_as,
    restores_signals,
    simulated_gpud,
    stopped_by_signal,
    unit_environment,
)

MB = 1_000_000
SPEC = "A100-SXM4-40GB:2,H100-SXM5-80GB:2"
CONFIG = "[mps]\nenabled = true\n"
MODULES = (node_pb2, mig_pb2, mps_pb2, jobs_pb2, queue_pb2, colo_pb2, net_pb2, cluster_pb2)
# Served on the peer port under mutual TLS, not on the local socket.
PEER_ONLY = ("gpud.v1.ClusterPeer",)
_ODD = "\x00\u202e\ud7ff\U0001f600é\n\t'\"%s{}$(;|)../"
_INTS = (0, 1, -1, 2, 7, 100, 101, 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1)
_FLOATS = (0.0, -0.0, 1e-300, -1.0, 1e308, float("nan"), float("inf"), float("-inf"), 0.5)
_INT_RANGE = {
    "TYPE_INT32": (-(2**31), 2**31 - 1),
    "TYPE_SINT32": (-(2**31), 2**31 - 1),
    "TYPE_SFIXED32": (-(2**31), 2**31 - 1),
    "TYPE_UINT32": (0, 2**32 - 1),
    "TYPE_FIXED32": (0, 2**32 - 1),
    "TYPE_INT64": (-(2**63), 2**63 - 1),
    "TYPE_SINT64": (-(2**63), 2**63 - 1),
    "TYPE_SFIXED64": (-(2**63), 2**63 - 1),
    "TYPE_UINT64": (0, 2**64 - 1),
    "TYPE_FIXED64": (0, 2**64 - 1),
}


def _type_name(fd: Any) -> str:
    from google.protobuf.descriptor import FieldDescriptor

    for name in dir(FieldDescriptor):
        if name.startswith("TYPE_") and getattr(FieldDescriptor, name) == fd.type:
            return name
    raise ValueError(fd.type)


class Fuzzer:
    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def string(self) -> str:
        r = self.rng
        pick = r.random()
        if pick < 0.15:
            return ""
        if pick < 0.3:
            return r.choice(["0", "1", "0:1", "3g.40gb", "all", "GPU-0", "train", "-1", "1e9"])
        if pick < 0.4:
            return r.choice("ab") * r.randint(200, 5000)
        return "".join(r.choice(_ODD + "abcxyz0123456789") for _ in range(r.randint(1, 40)))

    def scalar(self, fd: Any) -> Any:
        r = self.rng
        kind = _type_name(fd)
        if kind == "TYPE_STRING":
            return self.string()
        if kind == "TYPE_BYTES":
            return r.randbytes(r.randint(0, 64))
        if kind == "TYPE_BOOL":
            return r.random() < 0.5
        if kind in ("TYPE_DOUBLE", "TYPE_FLOAT"):
            return r.choice(_FLOATS) if r.random() < 0.6 else r.uniform(-1e6, 1e6)
        if kind == "TYPE_ENUM":
            numbers = [v.number for v in fd.enum_type.values]
            return r.choice([*numbers, 99, -5]) if fd.enum_type else 0
        low, high = _INT_RANGE[kind]
        value = r.choice(_INTS) if r.random() < 0.6 else r.randint(-1000, 1000)
        return min(max(value, low), high)

    def fill(self, message: Any, depth: int = 0) -> Any:
        r = self.rng
        for fd in message.DESCRIPTOR.fields:
            if r.random() < 0.3:
                continue  # leave unset
            is_map = fd.message_type is not None and fd.message_type.GetOptions().map_entry
            if is_map:
                container = getattr(message, fd.name)
                for _ in range(r.randint(0, 3)):
                    container[self.string()] = self.string()
            elif fd.is_repeated:
                n = r.choice([0, 1, 2, 5, 300]) if depth < 2 else r.randint(0, 2)
                container = getattr(message, fd.name)
                for _ in range(n):
                    if fd.message_type is not None:
                        self.fill(container.add(), depth + 1)
                    else:
                        container.append(self.scalar(fd))
            elif fd.message_type is not None:
                if depth < 3:
                    self.fill(getattr(message, fd.name), depth + 1)
            else:
                setattr(message, fd.name, self.scalar(fd))
        return message

    def plant_big(self, message: Any, prefix: str = "") -> str:
        """Set one string field, at any depth, to 1 MB; its path (``job.name``), or "" if
        the message has none."""
        fields = [fd for fd in message.DESCRIPTOR.fields if _type_name(fd) == "TYPE_STRING"]
        nested = [
            fd
            for fd in message.DESCRIPTOR.fields
            if fd.message_type is not None and not fd.is_repeated
        ]
        if fields and (not nested or self.rng.random() < 0.6):
            fd = self.rng.choice(fields)
            big = self.rng.choice("xyz") * MB
            if fd.is_repeated:
                getattr(message, fd.name).append(big)
            else:
                setattr(message, fd.name, big)
            return f"{prefix}{fd.name}"
        for fd in self.rng.sample(nested, len(nested)):
            if planted := self.plant_big(getattr(message, fd.name), f"{prefix}{fd.name}."):
                return planted
        return ""


def methods(*, peer: bool = False) -> list[tuple[str, Any, Any, bool]]:
    """(path, request class, response class, whether it answers with a stream) of every RPC
    served on the local socket, or (``peer``) on the cluster peer port."""
    found = []
    for module in MODULES:
        for service in module.DESCRIPTOR.services_by_name.values():
            if (service.full_name in PEER_ONLY) != peer:
                continue
            for m in service.methods:
                request = getattr(module, m.input_type.name)
                response = getattr(module, m.output_type.name)
                path = f"/{service.full_name}/{m.name}"
                found.append((path, request, response, bool(m.server_streaming)))
    return found


def _queued_entry(calls: dict[str, Any]) -> str:
    """The id of an entry that stays queued: 39 GiB of every GPU reserved, then 60 GiB of one
    asked (an H100's: the A100s can never give it)."""
    hog = jobs_pb2.ReserveRequest(job="fuzz-hog", gpu_count=4, memory_limit_bytes=39 * 2**30)
    calls["/gpud.v1.Jobs/Reserve"](hog, timeout=30)
    ask = jobs_pb2.ReserveRequest(job="fuzz-waits", gpu_count=1, memory_limit_bytes=60 * 2**30)
    entry = calls["/gpud.v1.Queue/Enqueue"](queue_pb2.EnqueueRequest(request=ask), timeout=30)
    return str(entry.id)


PEER_NODE = "fuzz-peer"  # the node the peer certificate names
PEER_LEADER = "fuzz-leader"  # the simulated node's cluster.node


@dataclass(frozen=True)
class PeerTarget:
    """The simulated node's peer port and a certificate of its cluster CA for
    :data:`PEER_NODE`."""

    address: str
    credentials: grpc.ChannelCredentials

    def channel(self) -> grpc.Channel:
        return grpc.secure_channel(
            self.address,
            self.credentials,
            options=[
                ("grpc.ssl_target_name_override", PEER_LEADER),
                # past the peer port's 16 MiB: gpud refuses what is too long, not this client
                ("grpc.max_send_message_length", 64 * MB),
            ],
        )


@contextlib.contextmanager
def leading_gpud(
    root: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[SimDaemon, PeerTarget]]:
    """A simulated node that leads a cluster of its own (etcd election on a throw-away
    etcd, certificates under ``root``; gpud's environment ``env``), and how to reach its peer
    port as another node."""
    make_ca(root)
    for name in (PEER_LEADER, PEER_NODE):
        make_node(root, name, root)
    port = free_port()
    with LocalEtcd() as etcd:
        cluster = f"""
[cluster]
election = "etcd"
node = "{PEER_LEADER}"
listen = "127.0.0.1:{port}"
ca_file = "{root / "ca.pem"}"
cert_file = "{root / f"{PEER_LEADER}.pem"}"
key_file = "{root / f"{PEER_LEADER}-key.pem"}"
etcd_endpoints = "{etcd.endpoint}"
"""
        with simulated_gpud(SPEC, config_text=CONFIG + cluster, env=env) as daemon:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=(root / "ca.pem").read_bytes(),
                private_key=(root / f"{PEER_NODE}-key.pem").read_bytes(),
                certificate_chain=(root / f"{PEER_NODE}.pem").read_bytes(),
            )
            yield daemon, PeerTarget(f"127.0.0.1:{port}", credentials)


def _until_leading(channel: grpc.Channel, timeout_s: float = 60.0) -> None:
    """Wait until the simulated node answers a report as the leader (elected, its first
    round run), so that the fuzzed reports are not all refused as "does not lead"."""
    report = cluster_pb2_grpc.ClusterPeerStub(channel).Report
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            report(cluster_pb2.ReportRequest(node=PEER_NODE), timeout=5)
            return
        except grpc.RpcError as err:
            if err.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


@dataclass
class Run:
    """What a run measured so far: all of it at its end, a part when cut short."""

    requests: int
    big: int
    seed: int
    methods: int
    sent: int = 0
    big_sent: int = 0  # of them with a 1 MB string (or 1 MB of raw bytes)
    outcomes: Counter[str] = field(default_factory=Counter)
    # each big request's outcome: its code, its method and the field with 1 MB ("request":
    # raw bytes), and the start of what gpud said
    big_outcomes: Counter[str] = field(default_factory=Counter)
    big_other: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    held: list[float] = field(default_factory=list)  # each answered GetEntry of the queued one
    rss_start: float | None = None
    rss_warm: float | None = None
    rss_end: float | None = None
    alive: bool | None = None  # None: not asked (cut short)
    cut_by: str = ""  # the signal that cut it short, e.g. "SIGTERM"


# Streams that may send nothing for hours (a WatchEvents no event matches yet): set up
# once gpud has sent their initial metadata, (WATCHING_KEY, "1"). A refusal ends one
# without it, gRPC's own (a request over MAX_REQUEST_BYTES) included: its empty initial
# metadata can come before the status, the call not yet done.
QUIET_STREAMS = frozenset({"/gpud.v1.Node/WatchEvents"})


def first_of(stream: Any, path: str) -> Any:
    """The first message of ``stream``, a call of method ``path``, or None where it ended
    without one; then the call is cancelled. A quiet stream (:data:`QUIET_STREAMS`) that
    gpud set up, its initial metadata saying so, answers None, rather than wait out its
    deadline for an event that may never come; one without that metadata is read to its
    end (a refusal, raised here)."""
    try:
        if path in QUIET_STREAMS and dict(stream.initial_metadata() or ()).get(WATCHING_KEY) == "1":
            return None
        return next(stream, None)
    finally:
        stream.cancel()


def first_of_stream(
    channel: grpc.Channel, path: str, response: Any, serialize: Callable[[Any], bytes]
) -> Callable[..., Any]:
    """A call of server-streaming method ``path`` on ``channel`` that answers its first
    message (:func:`first_of`)."""
    call = channel.unary_stream(
        path, request_serializer=serialize, response_deserializer=response.FromString
    )

    def first(request: Any, timeout: float) -> Any:
        return first_of(call(request, timeout=timeout), path)

    return first


def fuzz(daemon: SimDaemon, rng: random.Random, run: Run, peer: PeerTarget | None = None) -> None:
    """Warm ``daemon`` up, then send it ``run.requests`` fuzzed requests (to its peer port
    with ``peer``), recording into ``run`` as it goes."""
    rpcs = methods(peer=peer is not None)
    # drawn first, before any request: a seed's requests are the same as they were
    big_at = set(rng.sample(range(run.requests), run.big))
    local = grpc.insecure_channel(
        f"unix:{daemon.socket}", options=[("grpc.max_send_message_length", 8 * MB)]
    )
    channel = local if peer is None else peer.channel()

    def serialize(m: Any) -> bytes:
        return m if isinstance(m, bytes) else bytes(m.SerializeToString())

    def unary(path: str, response: Any) -> Any:
        return channel.unary_unary(
            path, request_serializer=serialize, response_deserializer=response.FromString
        )

    try:
        calls = {
            path: (
                first_of_stream(channel, path, response, serialize)
                if stream
                else unary(path, response)
            )
            for path, _, response, stream in rpcs
        }
        run.rss_start = rss_mb(daemon.pid)
        if peer is not None:
            _until_leading(channel)
        for path, empty, _, _ in rpcs * 3:  # warm-up: every method, empty and valid-shaped
            with contextlib.suppress(grpc.RpcError):
                calls[path](empty(), timeout=30)
        queued = _queued_entry(calls) if peer is None else ""
        run.rss_warm = rss_mb(daemon.pid)
        print(f"fuzzing: {run.requests} requests", flush=True)
        send_fuzzed(
            calls,
            rpcs,
            rng,
            run,
            big_at=big_at,
            queued=queued,
            node=PEER_NODE if peer is not None else "",
        )
        try:
            node_pb2_grpc.NodeStub(local).GetStatus(node_pb2.GetStatusRequest(), timeout=30)
            run.alive = True
        except grpc.RpcError:
            run.alive = False
        run.rss_end = rss_mb(daemon.pid)
    finally:
        if channel is not local:
            channel.close()
        local.close()


def send_fuzzed(
    calls: dict[str, Callable[..., Any]],
    rpcs: list[tuple[str, Any, Any, bool]],
    rng: random.Random,
    run: Run,
    *,
    big_at: set[int],
    queued: str,
    node: str = "",
) -> None:
    """Send ``run.requests`` fuzzed requests through ``calls`` (by method path), the
    ``big_at``-th of them with 1 MB in them, half the GetEntry ones asking for ``queued``,
    and with ``node`` (the peer's), half those with a ``node`` field naming it: a big one
    is then expected refused by gpud (INVALID_ARGUMENT), not by gRPC for its size.
    A request is counted in ``run.sent`` (and ``run.big_sent``) once its call returned, so
    that one a signal cuts short is in neither."""
    fuzzer = Fuzzer(rng)
    for i in range(run.requests):
        path, request_cls, _, _ = rng.choice(rpcs)
        big = i in big_at
        planted = ""
        if big:
            request: Any = fuzzer.fill(request_cls())
            planted = fuzzer.plant_big(request)
            if not planted:
                request = fuzzer.string().encode() + b"x" * MB  # no string field: raw bytes
                planted = "request"
        elif rng.random() < 0.05:
            request = rng.randbytes(rng.randint(1, 300))
        else:
            request = fuzzer.fill(request_cls())
            if path == "/gpud.v1.Queue/GetEntry" and rng.random() < 0.5:
                request.id = queued
            elif node and hasattr(request, "node") and rng.random() < 0.5:
                request.node = node
        asked = time.monotonic()
        said = ""
        try:
            calls[path](request, timeout=30)
            outcome = "OK"
            if not isinstance(request, bytes) and getattr(request, "id", None) == queued:
                run.held.append(time.monotonic() - asked)
        except grpc.RpcError as err:
            code = err.code()
            outcome, said = code.name, str(err.details())
            if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                run.failures.append(f"{path}: {code.name}: {said}")
        run.outcomes[outcome] += 1
        run.sent = i + 1
        if big:
            run.big_sent += 1
            run.big_outcomes[outcome] += 1
            if outcome not in _big_refusals(node, request_cls, planted):
                run.big_other[f"{path} {planted}: {outcome}: {said[:120]}"] += 1


def _big_refusals(node: str, request_cls: Any, planted: str) -> tuple[str, ...]:
    """How a request with 1 MB in it may end: on the local socket, refused by gRPC for its
    size; on the peer port (``node``), by gpud naming the field, or by gRPC past 16 MiB (a
    long repeated field of 1 MB strings), and taken where it is raw bytes to a method whose
    request has no field (its bytes kept as unknown fields, as protobuf does)."""
    if not node:
        return ("RESOURCE_EXHAUSTED",)
    if planted == "request" and not request_cls.DESCRIPTOR.fields:
        return ("OK", "INVALID_ARGUMENT")  # INVALID_ARGUMENT: bytes that do not parse
    return ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} MiB"


def report(run: Run, max_growth_mb: float) -> int:
    """Print what ``run`` measured; the exit status: 0 if it passed, 1 if it failed, 128 +
    the signal's number if it was cut short."""
    sent = f"{run.sent} of {run.requests}" if run.cut_by else str(run.requests)
    big = f"{run.big_sent} of {run.big}" if run.cut_by else str(run.big)
    print(f"{sent} fuzzed requests ({big} with a 1 MB string) to {run.methods} "
          f"methods of gpud --simulate {SPEC}, seed {run.seed}")  # fmt: skip
    print("outcomes: " + (", ".join(f"{k} {v}" for k, v in run.outcomes.most_common()) or "-"))
    print("of them with 1 MB: "
          + (", ".join(f"{k} {v}" for k, v in run.big_outcomes.most_common()) or "-"))  # fmt: skip
    for line, n in run.big_other.most_common(10):
        print(f"  {n} x {line}")
    print(f"GetEntry of the queued entry: {len(run.held)} answered, "
          f"{len([h for h in run.held if h >= 0.1])} after waiting, "
          f"longest {max(run.held, default=0.0):.1f} s")  # fmt: skip
    growth = None if run.rss_end is None or run.rss_warm is None else run.rss_end - run.rss_warm
    print(f"RSS: {_mib(run.rss_start)} at start, {_mib(run.rss_warm)} after the warm-up, "
          f"{_mib(run.rss_end)} after fuzzing: "
          + ("-" if growth is None else f"{growth:+.1f} MiB")
          + f" (target within {max_growth_mb:g} MiB)")  # fmt: skip
    for line in run.failures[:10]:
        print("  " + line[:300])
    if run.cut_by:
        return cut_short(run.cut_by, f"{run.sent} of {run.requests} requests")
    ok = (
        bool(run.alive)
        and not run.failures
        and not run.big_other
        and growth is not None
        and growth <= max_growth_mb
    )
    print(
        "daemon "
        + ("still serving" if run.alive else "NOT SERVING")
        + ("; ok" if ok else "; FAILED")
    )
    return 0 if ok else 1


@restores_signals
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--big", type=int, default=300, help="requests with a 1 MB string")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-growth-mb", type=float, default=20.0)
    parser.add_argument(
        "--peer", action="store_true", help="fuzz gpud.v1.ClusterPeer on the peer port instead"
    )
    args = parser.parse_args(argv)
    run = Run(args.requests, args.big, args.seed, len(methods(peer=args.peer)))
    # a signal: its daemon stopped and its directory removed as the with unwinds
    with contextlib.ExitStack() as stack:
        stopped = stack.enter_context(stopped_by_signal())
        peer = None
        # as the shipped unit runs it: its RSS is then the installed daemon's
        env = as_installed(os.environ)
        if args.peer:
            pki = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fuzz-pki-")))
            daemon, peer = stack.enter_context(leading_gpud(pki, env))
        else:
            daemon = stack.enter_context(simulated_gpud(SPEC, config_text=CONFIG, env=env))
        taken = " ".join(f"{name}={env[name]}" for name in unit_environment())
        print(
            f"gpud pid {daemon.pid}, run dir {daemon.socket.parent}, env {taken or '-'}", flush=True
        )
        fuzz(daemon, random.Random(args.seed), run, peer)
    run.cut_by = stopped.by
    return report(run, args.max_growth_mb)


if __name__ == "__main__":
    exit_as(main())
