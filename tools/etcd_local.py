"""A throw-away etcd server on loopback, for tests and benchmarks.

``with LocalEtcd() as etcd: etcd.endpoint`` starts ``etcd`` (Debian's etcd-server, or
``$ETCD_BIN``) on free loopback ports with a temporary data directory; on exit the process
is killed and the directory removed. :meth:`LocalEtcd.stop` / :meth:`LocalEtcd.start`
restart it on the same ports and data, as an etcd restart would.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def etcd_binary() -> str | None:
    return os.environ.get("ETCD_BIN") or shutil.which("etcd")


class LocalEtcd:
    """``args``: more etcd flags (``--quota-backend-bytes=...``, ``--cert-file=...``), kept
    across :meth:`stop` / :meth:`start`. ``client_tls``: for an etcd serving TLS (its flags in
    ``args``), how this process checks its health; the endpoint is then ``https``."""

    def __init__(
        self, args: tuple[str, ...] = (), *, client_tls: ssl.SSLContext | None = None
    ) -> None:
        binary = etcd_binary()
        if binary is None:
            raise FileNotFoundError("etcd is not installed (Debian: apt-get install etcd-server)")
        self.binary = binary
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir = Path(tempfile.mkdtemp(prefix=f"gpud-etcd-{os.getpid()}-"))
        self.proc: subprocess.Popen[bytes] | None = None
        self.args = args
        self.client_tls = client_tls

    @property
    def endpoint(self) -> str:
        scheme = "https" if self.client_tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 20.0) -> None:
        client = self.endpoint
        peer = f"http://127.0.0.1:{self.peer_port}"
        with open(self.data_dir / "etcd.log", "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--name=test",
                    f"--data-dir={self.data_dir / 'data'}",
                    f"--listen-client-urls={client}",
                    f"--advertise-client-urls={client}",
                    f"--listen-peer-urls={peer}",
                    f"--initial-advertise-peer-urls={peer}",
                    f"--initial-cluster=test={peer}",
                    "--log-outputs=stderr",
                    "--logger=zap",
                    "--log-level=error",
                    *self.args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"etcd exited: {(self.data_dir / 'etcd.log').read_text()[-2000:]}"
                )
            try:
                with urllib.request.urlopen(
                    f"{client}/health", timeout=1, context=self.client_tls
                ) as resp:
                    if b"true" in resp.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError("etcd did not become healthy")

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: etcd stops answering, connections hang (a partition, seen from clients)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalEtcd:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
