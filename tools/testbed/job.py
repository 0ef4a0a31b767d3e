"""One emulated training job: a sender and a receiver process.

Each iteration: a compute phase (``sleep``), then a communication phase -- the iteration's
bytes split over ``conns`` TCP connections, sent at once, then a one-byte ack from the
receiver once every connection's share has arrived (like an all-reduce step that cannot
finish before its slowest flow). The sender appends each iteration's completion time to
``--log`` (one float per line, flushed) and reports it through ``gpud.client.Progress``
when ``--report`` is given.

::

    python -m tools.testbed.job recv --port P --conns K --bytes B
    python -m tools.testbed.job send --host H --port P --conns K --bytes B --compute-ms C \\
        --seconds S --log FILE [--report --ideal T] [--cc cubic] [--tos TOS]
"""

from __future__ import annotations

import argparse
import selectors
import socket
import sys
import time

_CHUNK = 256 * 1024


def _shares(total: int, conns: int) -> list[int]:
    base, extra = divmod(total, conns)
    return [base + (1 if i < extra else 0) for i in range(conns)]


def receive(port: int, conns: int, nbytes: int) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(conns)
    socks = [listener.accept()[0] for _ in range(conns)]
    listener.close()
    shares = _shares(nbytes, conns)
    buf = bytearray(_CHUNK)
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
    while True:
        left = list(shares)
        pending = conns
        while pending:
            for key, _ in sel.select():
                i = key.data
                if left[i] == 0:
                    continue
                try:
                    n = key.fileobj.recv_into(buf, min(_CHUNK, left[i]))  # type: ignore[union-attr]
                except BlockingIOError:
                    continue
                if n == 0:
                    return  # the sender is done
                left[i] -= n
                if left[i] == 0:
                    pending -= 1
        socks[0].setblocking(True)
        socks[0].sendall(b"k")
        socks[0].setblocking(False)


def send(args: argparse.Namespace) -> None:
    socks = []
    for _ in range(args.conns):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if args.cc:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, args.cc.encode())
        if args.tos is not None:
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, args.tos)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for attempt in range(100):
            try:
                s.connect((args.host, args.port))
                break
            except ConnectionRefusedError:
                if attempt == 99:
                    raise
                time.sleep(0.05)
        socks.append(s)
    progress = None
    if args.report:
        from gpud.client import Progress

        progress = Progress(contention_free_iteration_s=args.ideal, flush_interval_s=0.1)
    payload = memoryview(bytes(_CHUNK))
    shares = _shares(args.bytes, args.conns)
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
    ack_sock = socks[0]
    log = open(args.log, "a", buffering=1)  # noqa: SIM115 - one line per iteration
    deadline = time.monotonic() + args.seconds
    try:
        while time.monotonic() < deadline:
            time.sleep(args.compute_ms / 1000.0)
            left = list(shares)
            pending = sum(1 for x in left if x)
            for i, s in enumerate(socks):
                if left[i]:
                    sel.register(s, selectors.EVENT_WRITE, i)
            while pending:
                for key, _ in sel.select():
                    i = key.data
                    if left[i] == 0:
                        continue
                    try:
                        n = key.fileobj.send(payload[: min(_CHUNK, left[i])])  # type: ignore[union-attr]
                    except BlockingIOError:
                        continue
                    left[i] -= n
                    if left[i] == 0:
                        pending -= 1
                        sel.unregister(key.fileobj)
            ack_sock.setblocking(True)
            if ack_sock.recv(1) != b"k":
                raise SystemExit("receiver went away")
            ack_sock.setblocking(False)
            log.write(f"{time.time():.6f}\n")
            if progress is not None:
                progress.step()
    finally:
        log.close()
        if progress is not None:
            progress.close()
        for s in socks:
            s.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.testbed.job")
    sub = parser.add_subparsers(dest="role", required=True)
    r = sub.add_parser("recv")
    s = sub.add_parser("send")
    for p in (r, s):
        p.add_argument("--port", type=int, required=True)
        p.add_argument("--conns", type=int, required=True)
        p.add_argument("--bytes", type=int, required=True)
    s.add_argument("--host", required=True)
    s.add_argument("--compute-ms", type=float, required=True)
    s.add_argument("--seconds", type=float, required=True)
    s.add_argument("--log", required=True)
    s.add_argument("--report", action="store_true")
    s.add_argument("--ideal", type=float)
    s.add_argument("--cc", default="")
    s.add_argument("--tos", type=int)
    args = parser.parse_args(argv)
    if args.role == "recv":
        receive(args.port, args.conns, args.bytes)
    else:
        send(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
