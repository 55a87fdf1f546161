"""The security flags of pdserve's processes, each with an environment variable of the same
name as its default (`--tls-cert` ↔ `PDSERVE_TLS_CERT`), parsed into `security.config` values.

    --tls-cert/--tls-key FILE      this process's certificate and key: its servers speak TLS
    --tls-ca FILE                  on a server: client certificates from this CA are required
                                   (mTLS); a worker also verifies the workers it calls with it
    --tls-server-name NAME         name expected in peers' certificates (default: their host)
    --internal-tls-*               the router's channels to workers (ca, cert, key, server-name)
    --cluster-secret-file FILE     the cluster secret (or $PDSERVE_CLUSTER_SECRET, never a flag)
    --metrics-host HOST            bind address of /metrics (default: --host)
    --metrics-token-file FILE      bearer tokens for /metrics, one a line (or
                                   $PDSERVE_METRICS_TOKENS, comma-separated)

Flags carry file paths only, never a key, a token or a secret.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from pdserve.serving.security.secret import (
    CLUSTER_SECRET_ENV,
    CLUSTER_SECRET_FILE_ENV,
    ClusterSecret,
    load_cluster_secret,
)
from pdserve.serving.security.tls import ClientTLS, TLSConfig, TLSError

METRICS_TOKENS_ENV = "PDSERVE_METRICS_TOKENS"
METRICS_TOKEN_FILE_ENV = "PDSERVE_METRICS_TOKEN_FILE"
TLS_ENV = ("PDSERVE_TLS_CERT", "PDSERVE_TLS_KEY", "PDSERVE_TLS_CA", "PDSERVE_TLS_SERVER_NAME",
           "PDSERVE_INTERNAL_TLS_CA", "PDSERVE_INTERNAL_TLS_CERT", "PDSERVE_INTERNAL_TLS_KEY",
           "PDSERVE_INTERNAL_TLS_SERVER_NAME")
"""Every TLS variable: a launcher clears them for its children and passes flags instead."""


def _env_name(flag: str) -> str:
    return "PDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def _add(p: argparse.ArgumentParser, flag: str, help_: str, metavar: str = "FILE") -> None:
    p.add_argument(flag, default=os.environ.get(_env_name(flag), ""), metavar=metavar,
                   help=f"{help_} (default: ${_env_name(flag)})")


def add_tls_args(p: argparse.ArgumentParser, server_name: bool = False) -> None:
    g = p.add_argument_group("TLS")
    _add(g, "--tls-cert", "PEM certificate chain of this process: its servers speak TLS")
    _add(g, "--tls-key", "PEM private key of --tls-cert")
    _add(g, "--tls-ca", "PEM CA: client certificates signed by it are required (mTLS)")
    if server_name:
        _add(g, "--tls-server-name", "name expected in other workers' certificates "
             "(default: the host of their address)", "NAME")


def add_internal_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("TLS to the workers")
    _add(g, "--internal-tls-ca", "PEM CA of the workers' certificates: TLS to the workers")
    _add(g, "--internal-tls-cert", "client certificate for the workers (default: --tls-cert)")
    _add(g, "--internal-tls-key", "its key (default: --tls-key)")
    _add(g, "--internal-tls-server-name", "name expected in the workers' certificates "
         "(default: the host of their address)", "NAME")


def add_secret_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cluster-secret-file", default=os.environ.get(CLUSTER_SECRET_FILE_ENV, ""),
                   metavar="FILE",
                   help="file holding the cluster secret that authenticates internal calls "
                        f"(default: ${CLUSTER_SECRET_FILE_ENV}, else ${CLUSTER_SECRET_ENV})")


def add_metrics_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics-host", default="", metavar="HOST",
                   help="bind address of /metrics (default: --host)")
    p.add_argument("--metrics-token-file", default=os.environ.get(METRICS_TOKEN_FILE_ENV, ""),
                   metavar="FILE",
                   help="bearer tokens a /metrics scrape must carry, one a line (default: "
                        f"${METRICS_TOKEN_FILE_ENV}, else ${METRICS_TOKENS_ENV}, comma-separated)")


def server_tls(a: argparse.Namespace) -> TLSConfig | None:
    """The process's server TLS from --tls-*, None when no certificate is given."""
    if not a.tls_cert and not a.tls_key:
        if a.tls_ca:
            raise TLSError("--tls-ca needs --tls-cert and --tls-key (a server without TLS "
                           "cannot ask for client certificates)")
        return None
    if not (a.tls_cert and a.tls_key):
        raise TLSError("--tls-cert and --tls-key go together")
    return TLSConfig.from_files(a.tls_cert, a.tls_key, a.tls_ca or None)


def worker_client_tls(a: argparse.Namespace) -> ClientTLS | None:
    """A worker's calls to other workers: TLS like its own server, with its certificate."""
    if not a.tls_cert:
        return None
    return ClientTLS.from_files(a.tls_ca or None, a.tls_cert, a.tls_key,
                                getattr(a, "tls_server_name", ""))


def internal_client_tls(a: argparse.Namespace) -> ClientTLS | None:
    """The router's channels to workers (--internal-tls-*), None without a CA."""
    if not a.internal_tls_ca:
        if a.internal_tls_cert or a.internal_tls_key:
            raise TLSError("--internal-tls-cert/--internal-tls-key need --internal-tls-ca")
        return None
    cert = a.internal_tls_cert or a.tls_cert or None
    key = a.internal_tls_key or (a.tls_key if not a.internal_tls_cert else "") or None
    return ClientTLS.from_files(a.internal_tls_ca, cert, key, a.internal_tls_server_name)


def cluster_secret(a: argparse.Namespace, env: Mapping[str, str] = os.environ
                   ) -> ClusterSecret | None:
    return load_cluster_secret(env, a.cluster_secret_file or None)


def metrics_tokens(a: argparse.Namespace, env: Mapping[str, str] = os.environ
                   ) -> tuple[str, ...]:
    if a.metrics_token_file:
        try:
            with open(a.metrics_token_file) as f:
                return tuple(line.strip() for line in f if line.strip())
        except OSError as exc:
            raise TLSError(f"cannot read the metrics token file {a.metrics_token_file}: "
                           f"{exc.strerror}") from None
    return tuple(t for t in env.get(METRICS_TOKENS_ENV, "").split(",") if t)


API_TOKEN_ENV = "PDSERVE_TOKEN"
API_TOKEN_FILE_ENV = "PDSERVE_TOKEN_FILE"


def add_client_args(p: argparse.ArgumentParser) -> None:
    """A client of the router (`pdserve generate`, `pdserve bench`): TLS roots, a client
    certificate for mTLS, and the bearer token (from a file or the environment, so it stays
    out of the process table; `--token` itself is kept for convenience)."""
    g = p.add_argument_group("TLS and auth")
    _add(g, "--tls-ca", "PEM roots that signed the router's certificate: connect over TLS")
    _add(g, "--tls-cert", "client certificate (mTLS)")
    _add(g, "--tls-key", "key of --tls-cert")
    g.add_argument("--token", default=None,
                   help=f"bearer token (visible in `ps`: prefer ${API_TOKEN_ENV} or --token-file)")
    g.add_argument("--token-file", default=os.environ.get(API_TOKEN_FILE_ENV, ""),
                   metavar="FILE", help=f"file holding the bearer token (default: "
                                        f"${API_TOKEN_FILE_ENV}, else ${API_TOKEN_ENV})")


def client_tls(a: argparse.Namespace) -> ClientTLS | None:
    """TLS to the router from --tls-ca (and the client certificate); None without a CA."""
    if not a.tls_ca:
        if a.tls_cert or a.tls_key:
            raise TLSError("--tls-cert/--tls-key need --tls-ca")
        return None
    return ClientTLS.from_files(a.tls_ca, a.tls_cert or None, a.tls_key or None)


def api_token(a: argparse.Namespace, env: Mapping[str, str] = os.environ) -> str | None:
    if a.token:
        return a.token
    if a.token_file:
        try:
            with open(a.token_file) as f:
                return f.read().strip() or None
        except OSError as exc:
            raise TLSError(f"cannot read the token file {a.token_file}: {exc.strerror}") from None
    return env.get(API_TOKEN_ENV) or None
