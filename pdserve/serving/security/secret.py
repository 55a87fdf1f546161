"""The cluster secret: one random string every process of a cluster shares, from which each
use derives its own key (so a key for one purpose never works for another).

    PDSERVE_CLUSTER_SECRET=...            the secret itself, in the environment
    --cluster-secret-file PATH            or a file holding it (`PDSERVE_CLUSTER_SECRET_FILE`)

Never on a command line: every local user can read the process table.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
CLUSTER_SECRET_FILE_ENV = "PDSERVE_CLUSTER_SECRET_FILE"
MIN_SECRET_CHARS = 16

RPC_PURPOSE = "internal-rpc/v1"
"""Key of the per-call credential of internal RPCs (`rpc_auth`)."""
KV_PURPOSE = "kv-transfer/v1"
"""Key of the MACs on KV transfer frames (`kv_store.transfer.auth`)."""


class SecretError(ValueError):
    """A cluster secret that cannot be used (missing file, too short)."""


@dataclass(frozen=True)
class ClusterSecret:
    value: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.value) < MIN_SECRET_CHARS:
            raise SecretError(f"the cluster secret must be at least {MIN_SECRET_CHARS} "
                              f"characters long, got {len(self.value)}")

    def key(self, purpose: str) -> bytes:
        """A 32-byte key for one purpose (HMAC-SHA256 of the purpose under the secret)."""
        return hmac.new(self.value, b"pdserve/" + purpose.encode(), hashlib.sha256).digest()

    def __repr__(self) -> str:
        return "ClusterSecret(***)"


def generate_secret() -> str:
    """A fresh secret (256 bits), for a cluster started without one."""
    return secrets.token_urlsafe(32)


def load_cluster_secret(env: Mapping[str, str] = os.environ, path: str | None = None
                        ) -> ClusterSecret | None:
    """The secret from `path` (else `$PDSERVE_CLUSTER_SECRET_FILE`), else
    `$PDSERVE_CLUSTER_SECRET`; None when neither is set."""
    path = path or env.get(CLUSTER_SECRET_FILE_ENV) or None
    if path:
        try:
            with open(path, "rb") as f:
                value = f.read().strip()
        except OSError as exc:
            raise SecretError(f"cannot read the cluster secret file {path}: "
                              f"{exc.strerror}") from None
        return ClusterSecret(value)
    value = env.get(CLUSTER_SECRET_ENV, "").strip()
    return ClusterSecret(value.encode()) if value else None
