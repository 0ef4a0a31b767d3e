"""When the certificates gpud uses in the cluster expire (``openssl x509 -noout -enddate
-in FILE`` shows the same date).

Two kinds of files, with different lifetimes in gpud:

* the peer API's (``cluster.ca_file``, ``cluster.cert_file``) are read once at start
  (:class:`~gpud.cluster.tls.PeerTls`): a renewed file counts only after a restart, so
  the dates are those of the bytes in memory;
* etcd's (``cluster.etcd_ca_file``, ``cluster.etcd_cert_file``) are read by the HTTP
  client at every new connection, so a file renewed on disk is used without a restart,
  and :class:`CertWatch` reads them again every ``recheck_s``.

A file whose earliest certificate expires within ``warn_s`` (14 days) is warned about once
(and once more when it has expired); a CA bundle counts by its earliest certificate.

The dates come from a small DER reader (:func:`not_after`): the standard library has no
public call for them but through a trust store, which holds CA certificates only
(``SSLContext.get_ca_certs`` skips a client certificate), and ``cryptography`` is not a
dependency of the daemon.
"""

from __future__ import annotations

import base64
import binascii
import calendar
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

WARN_S = 14 * 86400.0
RECHECK_S = 3600.0

_PEM = re.compile(rb"-----BEGIN CERTIFICATE-----(.+?)-----END CERTIFICATE-----", re.DOTALL)
_SEQUENCE, _EXPLICIT_0, _UTC_TIME, _GENERALIZED_TIME = 0x30, 0xA0, 0x17, 0x18

# what stops working when each file expires (the warning says it)
_CONSEQUENCE = {
    "cluster.ca_file": "this node then refuses every peer's certificate",
    "cluster.cert_file": "the other nodes then refuse this node",
    "cluster.etcd_ca_file": "gpud then cannot verify etcd and loses it",
    "cluster.etcd_cert_file": "etcd then refuses gpud's connections",
}


def _tlv(data: bytes, pos: int) -> tuple[int, int, int]:
    """(tag, where the value starts, where it ends) of the DER element at ``pos``."""
    if pos + 2 > len(data):
        raise ValueError("truncated DER")
    tag, length = data[pos], data[pos + 1]
    pos += 2
    if length & 0x80:
        size = length & 0x7F
        if not 0 < size <= 4 or pos + size > len(data):
            raise ValueError("bad DER length")
        length = int.from_bytes(data[pos : pos + size], "big")
        pos += size
    if pos + length > len(data):
        raise ValueError("truncated DER")
    return tag, pos, pos + length


def _time(tag: int, raw: bytes) -> float:
    text = raw.decode("ascii")
    if tag == _UTC_TIME:  # YYMMDDHHMMSSZ; RFC 5280: YY < 50 is 20YY
        year = int(text[:2])
        text = f"{2000 + year if year < 50 else 1900 + year}{text[2:]}"
    elif tag != _GENERALIZED_TIME:
        raise ValueError(f"not a time (DER tag {tag:#x})")
    if len(text) != 15 or not text.endswith("Z"):
        raise ValueError(f"unexpected time {raw!r}")
    parsed = time.strptime(text, "%Y%m%d%H%M%SZ")
    return float(calendar.timegm(parsed))


def _validity(der: bytes) -> tuple[float, float]:
    """(notBefore, notAfter) of one DER certificate (RFC 5280 4.1)."""
    tag, start, _ = _tlv(der, 0)  # Certificate
    if tag != _SEQUENCE:
        raise ValueError("not a certificate")
    tag, pos, _ = _tlv(der, start)  # tbsCertificate
    if tag != _SEQUENCE:
        raise ValueError("not a certificate")
    tag, _, end = _tlv(der, pos)
    if tag == _EXPLICIT_0:  # version
        pos = end
    for _ in range(3):  # serialNumber, signature, issuer
        _, _, pos = _tlv(der, pos)
    tag, pos, _ = _tlv(der, pos)  # validity
    if tag != _SEQUENCE:
        raise ValueError("no validity in the certificate")
    tag, start, end = _tlv(der, pos)
    before = _time(tag, der[start:end])
    tag, start, end = _tlv(der, end)
    return before, _time(tag, der[start:end])


def certificates_der(pem: bytes) -> list[bytes]:
    """The DER of each certificate in ``pem``; ValueError on bad base64."""
    out = []
    for block in _PEM.findall(pem):
        try:
            out.append(base64.b64decode(b"".join(block.split()), validate=True))
        except binascii.Error as err:
            raise ValueError(f"bad base64 in a certificate: {err}") from err
    return out


def not_after(pem: bytes) -> float:
    """The earliest notAfter (Unix time) of the certificates in ``pem``; ValueError when
    it holds none that can be read."""
    ends = [_validity(der)[1] for der in certificates_der(pem)]
    if not ends:
        raise ValueError("no PEM certificate in it")
    return min(ends)


def when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))


@dataclass(frozen=True, slots=True)
class CertExpiry:
    """``key``: the config key naming the file; ``not_after``: the earliest expiry in it
    (None when it could not be read: ``error`` says why); ``expires_in_s`` from the time
    asked (negative once expired)."""

    key: str
    path: str
    not_after: float | None
    expires_in_s: float | None = None
    error: str = ""


class CertWatch:
    """See the module docstring. ``files``: config key -> (path, the PEM bytes gpud holds
    in memory, or None for a file read from disk again every ``recheck_s``)."""

    def __init__(
        self,
        files: Mapping[str, tuple[Path, bytes | None]],
        *,
        warn_s: float = WARN_S,
        recheck_s: float = RECHECK_S,
        read: Callable[[Path], bytes] = Path.read_bytes,
    ) -> None:
        self._files = dict(files)
        self.warn_s = warn_s
        self._recheck_s = recheck_s
        self._read = read
        self._read_at: float | None = None
        self._known: dict[str, tuple[float | None, str]] = {}
        self._warned: set[tuple[str, float, bool]] = set()  # (key, notAfter, expired)

    def _load(self) -> None:
        for key, (path, held) in self._files.items():
            try:
                self._known[key] = (not_after(held if held is not None else self._read(path)), "")
            except OSError as err:
                self._known[key] = (None, f"cannot read it: {err.strerror}")
            except ValueError as err:
                self._known[key] = (None, str(err))

    def check(self, now: float) -> list[str]:
        """Read the files when due; the warnings not given before, for the log and events."""
        if self._read_at is None or now - self._read_at >= self._recheck_s:
            self._read_at = now
            self._load()
        out = []
        for key, (end, _) in self._known.items():
            if end is None or now < end - self.warn_s:
                continue
            expired = now >= end
            if (key, end, expired) in self._warned:
                continue
            self._warned.add((key, end, expired))
            path, held = self._files[key]
            consequence = _CONSEQUENCE.get(key, "")
            # a file held in memory counts only once gpud has read it again
            renew = "renew it and restart gpud" if held is not None else "renew it"
            if expired:
                out.append(f"{key} {path} expired at {when(end)}: {consequence}; {renew}")
            else:
                out.append(
                    f"{key} {path} expires at {when(end)}, in {(end - now) / 86400:.1f} days: "
                    f"{consequence}; {renew}"
                )
        return out

    def expiries(self, now: float) -> tuple[CertExpiry, ...]:
        """What :meth:`check` last read, with the time left from ``now``."""
        return tuple(
            CertExpiry(
                key,
                str(self._files[key][0]),
                end,
                None if end is None else end - now,
                error,
            )
            for key, (end, error) in self._known.items()
        )
