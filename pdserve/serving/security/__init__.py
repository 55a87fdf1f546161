"""The security plane every pdserve server and client shares.

    tls        TLS material (server: certificate, key, client CA for mTLS; client: CA, own
               certificate), as gRPC credentials or `ssl` contexts
    secret     the cluster secret and the keys derived from it (one per purpose)
    rpc_auth   per-call credentials for internal RPCs and the interceptors on both ends
    config     `ClientSecurity` (how to call) and `InternalSecurity` (a worker's plane)
    args       the flags and environment variables that configure all of it
    certs      a throwaway CA and per-process certificates (`pdserve up --tls auto`)
    http_auth  bearer tokens on HTTP endpoints (/metrics)

See docs/architecture.md, "Security", for what is protected and what is not.
"""

from pdserve.serving.security.config import ClientSecurity, InternalSecurity
from pdserve.serving.security.secret import (
    CLUSTER_SECRET_ENV,
    ClusterSecret,
    SecretError,
    generate_secret,
    load_cluster_secret,
)
from pdserve.serving.security.tls import ClientTLS, TLSConfig, TLSError

__all__ = [
    "CLUSTER_SECRET_ENV",
    "ClientSecurity",
    "ClientTLS",
    "ClusterSecret",
    "InternalSecurity",
    "SecretError",
    "TLSConfig",
    "TLSError",
    "generate_secret",
    "load_cluster_secret",
]
