"""A throwaway CA with server and client certificates for TLS tests (made with `cryptography`)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certs:
    dir: Path

    def __getattr__(self, name: str) -> Path:  # ca_pem, server_pem, server_key, client_pem, client_key, ...
        stem, _, ext = name.rpartition("_")
        return self.dir / f"{stem}.{ext}"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))


def make_certs(directory: Path) -> Certs:
    """ca.pem/ca.key; server.pem/key (SAN 127.0.0.1, localhost); client.pem/key; and from another CA
    (rogue_ca.pem), a client certificate rogue.pem/key and a server certificate rogue_server.pem/key."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=2))

    def ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(valid[0]).not_valid_after(valid[1])
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .sign(key, hashes.SHA256()))
        return key, cert

    def leaf(name: str, issuer: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], usage: x509.ObjectIdentifier
             ) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(issuer[1].subject)
                .public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(valid[0]).not_valid_after(valid[1])
                .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                                                            x509.DNSName("localhost")]), critical=False)
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
                .sign(issuer[0], hashes.SHA256()))
        (directory / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, directory / f"{name}.key")

    authority = ca("test-ca")
    (directory / "ca.pem").write_bytes(authority[1].public_bytes(serialization.Encoding.PEM))
    _write_key(authority[0], directory / "ca.key")
    leaf("server", authority, ExtendedKeyUsageOID.SERVER_AUTH)
    leaf("client", authority, ExtendedKeyUsageOID.CLIENT_AUTH)
    rogue = ca("rogue-ca")
    (directory / "rogue_ca.pem").write_bytes(rogue[1].public_bytes(serialization.Encoding.PEM))
    leaf("rogue", rogue, ExtendedKeyUsageOID.CLIENT_AUTH)
    leaf("rogue_server", rogue, ExtendedKeyUsageOID.SERVER_AUTH)
    return Certs(directory)
