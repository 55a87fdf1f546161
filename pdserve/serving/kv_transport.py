"""A worker's KV transport (`--kv-transport`): what carries KV payloads between workers.

    nixl (default)  NIXL (UCX: CMA on one host, RDMA/TCP across), into each receiving rank's
                    landing pool; falls back to gloo/NCCL, with one log line, where NIXL does
                    not load — and per receiver, for one that offers no landing pool
    nccl            NCCL for CUDA KV (the worker's KV caches must be on CUDA)
    gloo            gloo (CUDA KV staged through host memory)

Whatever the choice, control frames (headers, DONE, aborts, slot grants) travel on the same
authenticated gloo pairs and every transfer has the same lease, ticket and state machine
(`kv_store.transfer`). The choice reaches a worker's tensor-parallel followers through
`$PDSERVE_KV_TRANSPORT`, which is also the flag's default.

With NIXL, a sender whose receiver is on its own host offers its staging slots for the
receiver to READ into its cache (one copy; `kv_store.transfer.nixl_read`) unless
`--no-kv-nixl-reads` (`$PDSERVE_KV_NIXL_READS=0`, likewise passed to followers): then every
pair writes into the receiver's landing pool, as pairs across hosts always do.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kv_store.transfer.nixl_agent import NixlAgent

log = logging.getLogger(__name__)

KV_TRANSPORTS = ("nixl", "nccl", "gloo")
KV_TRANSPORT_ENV = "PDSERVE_KV_TRANSPORT"
DEFAULT_KV_TRANSPORT = "nixl"
NIXL_READS_ENV = "PDSERVE_KV_NIXL_READS"


def default_kv_transport() -> str:
    """The flag's default: `$PDSERVE_KV_TRANSPORT`, else nixl."""
    return os.environ.get(KV_TRANSPORT_ENV, "") or DEFAULT_KV_TRANSPORT


def default_nixl_reads() -> bool:
    """`--kv-nixl-reads`' default: `$PDSERVE_KV_NIXL_READS` (1 or 0), else on."""
    value = os.environ.get(NIXL_READS_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"${NIXL_READS_ENV} must be 1 or 0, got {value!r}")
    return value != "0"


def check_kv_transport(name: str) -> str:
    """`ValueError` naming the flag unless `name` is a transport this machine can use."""
    if name not in KV_TRANSPORTS:
        raise ValueError(f"--kv-transport must be one of {', '.join(KV_TRANSPORTS)}, got "
                         f"{name!r}")
    if name == "nccl" and not _cuda_available():
        raise ValueError("--kv-transport nccl needs CUDA KV caches: no CUDA device here "
                         "(use nixl or gloo)")
    return name


def _cuda_available() -> bool:
    import torch  # only for nccl: the flag is checked by processes that never load torch

    return torch.cuda.is_available()


@dataclass(frozen=True)
class KVTransport:
    """What one worker process moves KV with (`open_kv_transport`)."""

    requested: str
    backend: str
    """`TransferConfig.backend` for what does not go through NIXL."""
    nixl: NixlAgent | None = field(default=None, compare=False)
    """The process's NIXL agent (None: no NIXL here)."""

    @property
    def name(self) -> str:
        """The transport in effect (announced at start-up)."""
        if self.nixl is not None:
            return "nixl"
        return "gloo" if self.backend == "auto" else self.backend

    def close(self) -> None:
        if self.nixl is not None:
            self.nixl.close()


def open_kv_transport(requested: str, host: str) -> KVTransport:
    """The transport for `--kv-transport requested` in this process; `host`: the worker's
    bind address (NIXL listens only there)."""
    check_kv_transport(requested)
    if requested != "nixl":
        return KVTransport(requested, requested)
    from kv_store.transfer.nixl_agent import NixlAgent, NixlUnavailable

    try:
        return KVTransport(requested, "auto", NixlAgent(host))
    except NixlUnavailable as exc:
        log.warning("--kv-transport nixl: %s; KV moves over gloo (NCCL for CUDA KV)", exc)
        return KVTransport(requested, "auto")
