"""A throwaway certificate authority for a local cluster (`pdserve up --tls auto`).

The CA's key lives only in this process's memory: once the cluster's certificates are
issued nothing can sign another one, and the files die with the directory. Each process gets
its own key and certificate (EC P-256, valid for `days`), usable both as a server and as a
client certificate, with subject alternative names for the host it binds, 127.0.0.1, ::1 and
localhost. Keys are written 0600 in a 0700 directory.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class IssuedCert:
    cert: str
    """Path of the PEM certificate."""
    key: str
    """Path of the PEM private key (0600)."""


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdserve"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: tuple[str, ...]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(h.strip("[]") for h in hosts if h):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


class ThrowawayCA:
    def __init__(self, directory: str | Path, name: str = "pdserve local CA",
                 days: int = 7) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._days = days
        self._key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        self._cert = (
            x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .sign(self._key, hashes.SHA256()))
        self.ca_path = str(self.dir / "ca.pem")
        _write(Path(self.ca_path), self._cert.public_bytes(serialization.Encoding.PEM), 0o644)

    def issue(self, name: str, hosts: tuple[str, ...] = ()) -> IssuedCert:
        """A key and certificate for the process `name` (a file-name-safe string), valid for
        `hosts` and loopback, as both server and client."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder().subject_name(_name(name))
            .issuer_name(self._cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=self._days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_san((*hosts, *_LOOPBACK)), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self._key, hashes.SHA256()))
        issued = IssuedCert(str(self.dir / f"{name}.pem"), str(self.dir / f"{name}.key"))
        _write(Path(issued.cert), cert.public_bytes(serialization.Encoding.PEM), 0o644)
        _write(Path(issued.key), key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()), 0o600)
        return issued
