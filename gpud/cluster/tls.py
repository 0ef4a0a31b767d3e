"""Mutual TLS between nodes: every node holds a certificate signed by the cluster CA.

The peer server (``cluster.listen``) requires a client certificate signed by the CA in
``cluster.ca_file`` and presents ``cluster.cert_file``; clients verify the leader's
certificate against the same CA *and* against the leader's node name (the name it
published in etcd must be in its certificate's subjectAltName), so a node cannot pose as
another. ``tools/certs.py`` makes a CA and node certificates; ``openssl x509 -in node.pem
-noout -text`` shows what a certificate carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpud.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PeerTls:
    ca: bytes
    cert: bytes
    key: bytes

    @classmethod
    def load(cls, ca_file: Path | None, cert_file: Path | None, key_file: Path | None) -> PeerTls:
        """Read the three PEM files; a missing or unreadable one is a ConfigError naming it."""
        values: dict[str, bytes] = {}
        for key, path in (("ca_file", ca_file), ("cert_file", cert_file), ("key_file", key_file)):
            if path is None:
                raise ConfigError(
                    "needed for the peer API (mutual TLS between nodes); "
                    "tools/certs.py makes a CA and node certificates",
                    key=f"cluster.{key}",
                )
            try:
                values[key] = path.read_bytes()
            except OSError as err:
                raise ConfigError(
                    f"cannot read {path}: {err.strerror}", key=f"cluster.{key}"
                ) from err
        return cls(values["ca_file"], values["cert_file"], values["key_file"])

    def server_credentials(self) -> Any:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> Any:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )
