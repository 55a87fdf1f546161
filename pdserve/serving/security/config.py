"""What one process needs to serve and to call securely, as typed values built at start-up.

    ClientSecurity     how to call another pdserve process: TLS (CA, own certificate), and
                       the cluster secret for internal RPCs; opens gRPC channels
    InternalSecurity   a worker's whole internal plane: its server TLS, the interceptors that
                       authenticate callers, and the `ClientSecurity` of its own calls to
                       other workers (PushKV)
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.serving.security import rpc_auth
from pdserve.serving.security.secret import (
    KV_PURPOSE,
    RPC_PURPOSE,
    ClusterSecret,
    load_cluster_secret,
)
from pdserve.serving.security.tls import ClientTLS, TLSConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClientSecurity:
    tls: ClientTLS | None = None
    """None = plaintext."""
    secret: ClusterSecret | None = None
    """Sent as a per-call credential (`rpc_auth`); None = none."""

    def credentials(self) -> grpc.ChannelCredentials | None:
        return self.tls.grpc_credentials() if self.tls is not None else None

    def _options(self, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        return [*options, *(self.tls.grpc_options() if self.tls is not None else [])]

    def aio_channel(self, target: str, options: Sequence[tuple[str, Any]] = ()
                    ) -> grpc.aio.Channel:
        """A grpc.aio channel to `target` (inside the event loop that will use it)."""
        interceptors = (rpc_auth.aio_client_interceptors(self.secret.key(RPC_PURPOSE))
                        if self.secret is not None else None)
        opts, creds = self._options(options), self.credentials()
        if creds is None:
            return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)
        return grpc.aio.secure_channel(target, creds, options=opts, interceptors=interceptors)

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel to `target`."""
        opts, creds = self._options(options), self.credentials()
        ch = (grpc.insecure_channel(target, options=opts) if creds is None
              else grpc.secure_channel(target, creds, options=opts))
        if self.secret is None:
            return ch
        return grpc.intercept_channel(
            ch, rpc_auth.sync_client_interceptor(self.secret.key(RPC_PURPOSE)))


@dataclass(frozen=True)
class InternalSecurity:
    """A worker's internal plane (the defaults: plaintext, open — warned about at start)."""

    tls: TLSConfig | None = None
    """The worker's server certificate; `client_ca` set = callers need a cluster certificate."""
    client: ClientSecurity = field(default_factory=ClientSecurity)
    """How this worker calls other workers."""
    secret: ClusterSecret | None = None
    metrics_tokens: tuple[str, ...] = field(default=(), repr=False)
    """Bearer tokens a `/metrics` scrape must carry (empty = none)."""

    @property
    def authenticated(self) -> bool:
        return self.secret is not None or (self.tls is not None and self.tls.mutual)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """Authentication of callers: nothing to add under mTLS (the handshake already
        refused every caller without a cluster certificate), the secret check otherwise."""
        if self.tls is not None and self.tls.mutual:
            return []
        if self.secret is not None:
            return [rpc_auth.ClusterAuthInterceptor(self.secret.key(RPC_PURPOSE))]
        return []

    def kv_key(self) -> bytes | None:
        """Key of the MACs on KV transfer frames (None without a secret)."""
        return self.secret.key(KV_PURPOSE) if self.secret is not None else None

    def warn_if_open(self, what: str) -> None:
        if not self.authenticated:
            log.warning("%s: internal API is unauthenticated (no cluster secret, no mTLS): "
                        "any process that reaches it can call it", what)


def kv_auth_key(env: Mapping[str, str] = os.environ) -> bytes | None:
    """The KV transfer key of a process that has no flags of its own (a tensor-parallel
    follower): from the cluster secret its worker handed down in the environment."""
    secret = load_cluster_secret(env)
    return secret.key(KV_PURPOSE) if secret is not None else None
