"""Make a cluster CA and node certificates for gpud's peer API (mutual TLS).

::

    python -m tools.certs ca --out /etc/gpud/pki                 # ca.pem, ca-key.pem (0600)
    python -m tools.certs node gpu-node-07 --ca /etc/gpud/pki --out /etc/gpud/pki \\
        [--ip 10.0.0.7] [--dns gpu-node-07.example]               # gpu-node-07.pem, -key.pem

Every node certificate carries its node name (``cluster.node``) as a DNS subjectAltName,
plus 127.0.0.1 and any ``--ip`` / ``--dns``, and is good for both TLS server and client
authentication. Keys are ECDSA P-256. For tests and small clusters; a site with its own PKI
issues the same kind of certificates from it (``openssl x509 -noout -text -in NODE.pem``).
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_DAYS = 825


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)  # one written before keeps its mode otherwise
        f.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_ca(out: Path, name: str = "gpud cluster CA") -> tuple[Path, Path]:
    """A self-signed CA: (ca.pem, ca-key.pem) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = out / "ca.pem", out / "ca-key.pem"
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    return cert_path, key_path


def make_node(
    ca_dir: Path,
    node: str,
    out: Path,
    *,
    ips: tuple[str, ...] = (),
    dns: tuple[str, ...] = (),
    not_before: datetime.datetime | None = None,
    not_after: datetime.datetime | None = None,
) -> tuple[Path, Path]:
    """A node certificate signed by the CA in ``ca_dir``: (NODE.pem, NODE-key.pem), valid
    from ``not_before`` (default: five minutes ago) to ``not_after`` (default: in
    VALID_DAYS days)."""
    ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    ca_key = serialization.load_pem_private_key((ca_dir / "ca-key.pem").read_bytes(), None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{ca_dir / 'ca-key.pem'}: not an EC key")
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName(node)]
    names += [x509.DNSName(d) for d in dns if d != node]
    names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", *ips)]
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before or now - datetime.timedelta(minutes=5))
        .not_valid_after(not_after or now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = out / f"{node}.pem", out / f"{node}-key.pem"
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    return cert_path, key_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.certs", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    ca = sub.add_parser("ca", help="make ca.pem and ca-key.pem")
    ca.add_argument("--out", type=Path, required=True)
    ca.add_argument("--name", default="gpud cluster CA")
    node = sub.add_parser("node", help="make NODE.pem and NODE-key.pem, signed by the CA")
    node.add_argument("name")
    node.add_argument("--ca", type=Path, required=True, help="folder with ca.pem and ca-key.pem")
    node.add_argument("--out", type=Path, required=True)
    node.add_argument("--ip", action="append", default=[])
    node.add_argument("--dns", action="append", default=[])
    args = parser.parse_args(argv)
    if args.command == "ca":
        paths = make_ca(args.out, args.name)
    else:
        paths = make_node(args.ca, args.name, args.out, ips=tuple(args.ip), dns=tuple(args.dns))
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
