"""TLS material of one process, loaded once: its certificate and key, and the CA it trusts.

    TLSConfig   a server's side: certificate chain, key, and (mTLS) the CA whose client
                certificates it requires; gRPC server credentials or an `ssl.SSLContext`
    ClientTLS   a client's side: the CA it verifies servers against, and (mTLS) its own
                certificate and key; gRPC channel credentials or an `ssl.SSLContext`

Files are read at start-up, so a wrong path fails the process at once with the path named.
"""

from __future__ import annotations

import os
import ssl
import tempfile
from dataclasses import dataclass, field

import grpc


class TLSError(ValueError):
    """TLS settings that cannot work (a missing file, a key without a certificate)."""


def read_pem(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise TLSError(f"cannot read the {what} file {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise TLSError(f"the {what} file {path} is not PEM")
    return data


@dataclass(frozen=True)
class TLSConfig:
    """Server-side TLS; with `client_ca` set, clients must present a certificate (mTLS)."""

    cert_chain: bytes
    private_key: bytes = field(repr=False)
    client_ca: bytes | None = None

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str | None = None) -> TLSConfig:
        return cls(read_pem(cert, "TLS certificate"), read_pem(key, "TLS key"),
                   read_pem(ca, "TLS CA") if ca else None)

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
            require_client_auth=self.mutual)

    def ssl_context(self) -> ssl.SSLContext:
        """For HTTP servers (aiohttp, the metrics server): TLS 1.2+, client certificates
        required when `client_ca` is set."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_chain(ctx, self.cert_chain, self.private_key)
        if self.client_ca is not None:
            ctx.load_verify_locations(cadata=self.client_ca.decode())
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


@dataclass(frozen=True)
class ClientTLS:
    """Client-side TLS: verify servers against `ca`; present `cert_chain` (mTLS) if given."""

    ca: bytes | None = None
    """PEM roots; None = the system's."""
    cert_chain: bytes | None = None
    private_key: bytes | None = field(default=None, repr=False)
    server_name: str = ""
    """Name expected in the servers' certificates ("" = the host of the address dialled)."""

    def __post_init__(self) -> None:
        if (self.cert_chain is None) != (self.private_key is None):
            raise TLSError("a client certificate needs its key, and a key its certificate")

    @classmethod
    def from_files(cls, ca: str | None, cert: str | None = None, key: str | None = None,
                   server_name: str = "") -> ClientTLS:
        return cls(read_pem(ca, "TLS CA") if ca else None,
                   read_pem(cert, "TLS certificate") if cert else None,
                   read_pem(key, "TLS key") if key else None, server_name)

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.private_key, self.cert_chain)

    def grpc_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    def ssl_context(self) -> ssl.SSLContext:
        """For HTTP clients (scrapes, the OpenAI load generator)."""
        ctx = ssl.create_default_context(cadata=self.ca.decode() if self.ca else None)
        if self.cert_chain is not None:
            _load_chain(ctx, self.cert_chain, self.private_key)
        return ctx


def _load_chain(ctx: ssl.SSLContext, chain: bytes, key: bytes | None) -> None:
    """`ssl` loads certificates only from files: write both to a private temporary directory
    that is gone again before this returns."""
    with tempfile.TemporaryDirectory(prefix="pdserve-tls-") as tmp:
        cert_path, key_path = os.path.join(tmp, "cert.pem"), os.path.join(tmp, "key.pem")
        for path, data in ((cert_path, chain), (key_path, key or b"")):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        ctx.load_cert_chain(cert_path, key_path if key else None)
