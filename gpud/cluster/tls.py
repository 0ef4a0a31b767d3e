"""Mutual TLS between nodes: every node holds a certificate signed by the cluster CA.

The peer server (``cluster.listen``) requires a client certificate signed by the CA in
``cluster.ca_file`` and presents ``cluster.cert_file``; clients verify the leader's
certificate against the same CA *and* against the leader's node name (the name it
published in etcd must be in its certificate's subjectAltName), so a node cannot pose as
another. ``tools/certs.py`` makes a CA and node certificates; ``openssl x509 -in node.pem
-noout -text`` shows what a certificate carries.

:meth:`PeerTls.load` checks the three files before gRPC ever sees them: gRPC only says
that the port "cannot listen" for a bad key, and nothing at all for a certificate the
other nodes will refuse (expired, of another CA), which then shows up as closed sockets
on every node. The check is a TLS handshake of the node with itself in memory
(:class:`ssl.MemoryBIO`): the certificate and key as server and as client, each side
trusting only the CA, so it tests what a peer would test.
"""

from __future__ import annotations

import logging
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpud.errors import ConfigError
from gpud.shared import read_regular

log = logging.getLogger(__name__)

EXPIRY_WARNING_S = 7 * 86400  # a certificate expiring sooner is warned about at start

# the most a CA, certificate, key or password file may hold: a PEM certificate takes 1 to
# 2 KiB, a bundle of every public CA about 200 KiB; a bigger file is the wrong one
MAX_CLUSTER_FILE_BYTES = 256 << 10

# OpenSSL X509_V_ERR_* codes (ssl.SSLCertVerificationError.verify_code) a peer would hit
_NOT_YET_VALID, _EXPIRED = 9, 10
_OTHER_CA = {
    2,  # unable to get issuer certificate
    7,  # certificate signature failure (a CA of the same name, another key)
    18,  # self-signed certificate
    19,  # self-signed certificate in the chain
    20,  # unable to get local issuer certificate
    21,  # unable to verify the first certificate
}
_INVALID_PURPOSE, _HOSTNAME_MISMATCH = 26, 62


class _Encrypted(Exception):
    """The key file asks for a passphrase (OpenSSL would prompt on the terminal)."""


def _no_passphrase() -> str:
    raise _Encrypted


def _when(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))


def _pem_text(data: bytes) -> str:
    # OpenSSL reads PEM as ASCII; anything else in the file is not PEM anyway
    return data.decode("ascii", errors="ignore")


@dataclass(frozen=True, slots=True)
class PeerTls:
    """This node's CA, certificate and key (PEM), as gRPC credentials.

    ``cert_file`` and ``not_after`` (Unix time; None when not known) let a running node
    say that its certificate has expired since it started (:meth:`expiry_problem`).
    """

    ca: bytes
    cert: bytes
    key: bytes
    cert_file: str = ""
    not_after: float | None = None
    # the node's name as the certificate spells it (loaded with ``node``; "" otherwise)
    node_as_named: str = ""

    @classmethod
    def load(
        cls,
        ca_file: Path | None,
        cert_file: Path | None,
        key_file: Path | None,
        *,
        node: str | None = None,
        now: float | None = None,
    ) -> PeerTls:
        """Read and check the three PEM files; each problem is a ConfigError naming the
        key and the file: unreadable, not PEM, a key that is not the certificate's, a
        certificate the CA did not sign, one expired or not yet valid, one that does not
        name ``node`` (when given). One that expires within :data:`EXPIRY_WARNING_S` of
        ``now`` (default: the time) is logged as a warning."""
        values: dict[str, bytes] = {}
        paths: dict[str, Path] = {}
        for key, path in (("ca_file", ca_file), ("cert_file", cert_file), ("key_file", key_file)):
            if path is None:
                raise ConfigError(
                    "needed for the peer API (mutual TLS between nodes); "
                    "tools/certs.py makes a CA and node certificates",
                    key=f"cluster.{key}",
                )
            values[key] = read_cluster_file(path, f"cluster.{key}")
            paths[key] = path
        not_after, node_as_named = _check(
            paths["ca_file"],
            paths["cert_file"],
            paths["key_file"],
            values,
            node=node,
            now=time.time() if now is None else now,
        )
        return cls(
            values["ca_file"],
            values["cert_file"],
            values["key_file"],
            cert_file=str(paths["cert_file"]),
            not_after=not_after,
            node_as_named=node_as_named,
        )

    def expiry_problem(self, now: float) -> str:
        """'' or why peers refuse this node's certificate by ``now`` (Unix time): it has
        expired since gpud started. Cheap enough for every round."""
        if self.not_after is None or now < self.not_after:
            return ""
        return (
            f"this node's certificate cluster.cert_file {self.cert_file} expired at "
            f"{_when(self.not_after)}: the other nodes refuse it; renew it and restart gpud"
        )

    def server_credentials(self) -> Any:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> Any:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def _context(purpose: int, ca_text: str, cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(purpose)
    ctx.load_verify_locations(cadata=ca_text)  # parsed before
    _load_chain(ctx, cert, key, "cluster.key_file")
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def _load_chain(ctx: ssl.SSLContext, cert: Path, key: Path, key_name: str) -> None:
    """``cert`` (parsed before) and ``key`` into ``ctx``; a ConfigError naming ``key_name``
    when the key is encrypted, unreadable or not the certificate's."""
    try:
        ctx.load_cert_chain(cert, key, password=_no_passphrase)
    except _Encrypted:
        raise ConfigError(
            f"{key}: the key is encrypted; gpud needs it unencrypted (mode 0600)",
            key=key_name,
        ) from None
    except ssl.SSLError as err:
        if err.reason == "KEY_VALUES_MISMATCH":
            raise ConfigError(
                f"{key} is not the key of the certificate {cert}", key=key_name
            ) from err
        # the certificate parsed (checked before), so it is the key that does not
        why = f" ({err.reason})" if err.reason and err.reason != "PEM_LIB" else ""
        raise ConfigError(
            f"{key}: no PEM private key can be read from it{why}", key=key_name
        ) from err
    except OSError as err:  # gone since it was read
        raise ConfigError(f"cannot read {cert} or {key}: {err.strerror}") from err


def _parse_certificates(path: Path, text: str, key_name: str) -> None:
    """That ``text`` (``path``'s) holds PEM certificates; a ConfigError naming ``key_name``."""
    probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        probe.load_verify_locations(cadata=text)
    except ssl.SSLError as err:
        why = f" ({err.reason})" if err.reason else ""
        raise ConfigError(
            f"{path}: no PEM certificate can be read from it{why}", key=key_name
        ) from err


def check_etcd_client_files(
    ca_file: Path | None, cert_file: Path | None, key_file: Path | None
) -> None:
    """etcd's CA, client certificate and key (``cluster.etcd_*``), checked as its HTTP
    client will load them: it silently drops a certificate without its key (or a key
    without its certificate), and a file it cannot use fails every call as "etcd
    unreachable", naming neither the key nor the file. Not verified against a CA: etcd
    checks the client certificate against its own ``--trusted-ca-file``, which gpud does
    not know, and ``etcd_ca_file`` verifies etcd's server certificate only."""
    for name, path, pair, pair_name in (
        ("cluster.etcd_cert_file", cert_file, key_file, "cluster.etcd_key_file"),
        ("cluster.etcd_key_file", key_file, cert_file, "cluster.etcd_cert_file"),
    ):
        if path is not None and pair is None:
            raise ConfigError(
                f"needed with {name} ({path}): etcd's client certificate authentication "
                "takes the certificate and its key",
                key=pair_name,
            )
    for name, path in (("cluster.etcd_ca_file", ca_file), ("cluster.etcd_cert_file", cert_file)):
        if path is not None:
            _parse_certificates(path, _pem_text(read_cluster_file(path, name)), name)
    if cert_file is not None and key_file is not None:
        read_cluster_file(key_file, "cluster.etcd_key_file")
        _load_chain(
            ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT), cert_file, key_file, "cluster.etcd_key_file"
        )


def read_cluster_file(path: Path, key_name: str) -> bytes:
    """The bytes of ``path``, a regular file of at most :data:`MAX_CLUSTER_FILE_BYTES`
    (read at start, by ``--check-config`` and on reload: a named pipe or a device would
    hang them); a ConfigError naming ``key_name`` and the file."""
    try:
        return read_regular(
            path, MAX_CLUSTER_FILE_BYTES, kind="a certificate, key or password file"
        )
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}", key=key_name) from err


def _check(
    ca: Path,
    cert: Path,
    key: Path,
    values: dict[str, bytes],
    *,
    node: str | None,
    now: float,
) -> tuple[float, str]:
    """See :meth:`PeerTls.load`; the certificate's notAfter (Unix time) and ``node`` as the
    certificate spells it ("" without ``node``)."""
    ca_text = _pem_text(values["ca_file"])
    for name, path, text in (("ca_file", ca, ca_text), ("cert_file", cert, None)):
        _parse_certificates(path, text or _pem_text(values[name]), f"cluster.{name}")
    server = _context(ssl.PROTOCOL_TLS_SERVER, ca_text, cert, key)
    client = _context(ssl.PROTOCOL_TLS_CLIENT, ca_text, cert, key)
    client.check_hostname = node is not None
    authorities = client.get_ca_certs()
    if not authorities:
        raise ConfigError(f"{ca}: no CA certificate in it", key="cluster.ca_file")
    s_in, s_out, c_in, c_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    s = server.wrap_bio(s_in, s_out, server_side=True)
    c = client.wrap_bio(c_in, c_out, server_hostname=node or None)
    done = {"client": False, "server": False}
    for _ in range(8):  # TLS 1.3 takes two round trips; more means something is wrong
        for side, obj, out, peer in (("client", c, c_out, s_in), ("server", s, s_out, c_in)):
            if not done[side]:
                try:
                    obj.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLCertVerificationError as err:
                    raise _verify_error(err, side, ca, cert, node, authorities, now) from err
                except ssl.SSLError as err:
                    raise ConfigError(
                        f"{cert} with {key}: a TLS handshake with the CA {ca} fails: "
                        f"{err.reason or err}",
                        key="cluster.cert_file",
                    ) from err
            data = out.read()
            if data:
                peer.write(data)
        if all(done.values()):
            break
    else:
        raise ConfigError(
            f"{cert}: a TLS handshake with itself does not finish", key="cluster.cert_file"
        )
    # the client verified the certificate, so its fields are there
    verified = c.getpeercert() or {}
    named = "" if node is None else _check_names_node(verified, cert, node)
    not_after = ssl.cert_time_to_seconds(str(verified["notAfter"]))
    _warn_expiring("cluster.cert_file", cert, not_after, now)
    for authority in authorities:
        end = ssl.cert_time_to_seconds(str(authority["notAfter"]))
        _warn_expiring("cluster.ca_file", ca, end, now)
    return float(not_after), named


def _check_names_node(verified: dict[str, Any], cert: Path, node: str) -> str:
    """That the certificate names ``node`` itself, as the leader checks a report (the
    names in ``api.peer_names``, without case): TLS also matches a wildcard, which would
    pass here and then have every report refused. Returns the name as the certificate
    spells it."""
    sans = verified.get("subjectAltName") or ()
    for _, value in sans:
        if str(value).lower() == node.lower():
            return str(value)
    dns = ", ".join(repr(str(value)) for kind, value in sans if kind == "DNS") or "nothing"
    raise ConfigError(
        f"{cert}: the certificate names {dns}, not node {node!r} (cluster.node) itself: "
        "the leader takes a report only from a certificate that names its node, so that "
        "no node can report as another; give the node a certificate of its own",
        key="cluster.cert_file",
    )


def _warn_expiring(key: str, path: Path, not_after: float, now: float) -> None:
    if now <= not_after < now + EXPIRY_WARNING_S:
        log.warning(
            "%s %s expires at %s, in %.1f days: the other nodes will refuse it then",
            key,
            path,
            _when(not_after),
            (not_after - now) / 86400,
        )


def _verify_error(  # noqa: PLR0917 (one call site, the handshake's)
    err: ssl.SSLCertVerificationError,
    side: str,
    ca: Path,
    cert: Path,
    node: str | None,
    authorities: list[Any],
    now: float,
) -> ConfigError:
    code = err.verify_code
    dates = f"(openssl x509 -noout -dates -in {cert})"
    if code in (_EXPIRED, _NOT_YET_VALID):
        # the CA's own dates are known here; the certificate's only once it verifies
        for authority in authorities:
            start = ssl.cert_time_to_seconds(authority["notBefore"])
            end = ssl.cert_time_to_seconds(authority["notAfter"])
            if now >= end:
                return ConfigError(
                    f"{ca}: the CA certificate expired at {_when(end)}", key="cluster.ca_file"
                )
            if now < start:
                return ConfigError(
                    f"{ca}: the CA certificate is not valid before {_when(start)}",
                    key="cluster.ca_file",
                )
        what = "has expired" if code == _EXPIRED else "is not valid yet"
        return ConfigError(f"{cert}: the certificate {what} {dates}", key="cluster.cert_file")
    if code in _OTHER_CA:
        return ConfigError(
            f"{cert}: the certificate is not signed by the CA in {ca} "
            f"(cluster.ca_file): {err.verify_message}",
            key="cluster.cert_file",
        )
    if code == _HOSTNAME_MISMATCH:
        return ConfigError(
            f"{cert}: the certificate does not name node {node!r} (cluster.node) in its "
            "subjectAltName, so the other nodes would refuse it",
            key="cluster.cert_file",
        )
    if code == _INVALID_PURPOSE:
        role = "server" if side == "client" else "client"
        return ConfigError(
            f"{cert}: the certificate is not for TLS {role} authentication "
            "(extendedKeyUsage); a node's certificate needs both serverAuth and clientAuth",
            key="cluster.cert_file",
        )
    return ConfigError(
        f"{cert}: a peer would refuse the certificate: {err.verify_message}",
        key="cluster.cert_file",
    )
