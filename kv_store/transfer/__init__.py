"""KV transfer engine: streams a prompt's KV cache, layer by layer, from a prefill worker into
the paged cache of a decode worker over torch.distributed point-to-point.

One 2-rank process group per (sender process, receiver process) pair, opened on demand through
the receiver's TCPStore, capped in number and closed when idle. Gloo moves CPU tensors and all
control messages; NCCL moves CUDA payloads. Control messages are versioned msgpack (`wire`),
tensors move as tensors. Per-request state machines are described in `state`.

    sender side (prefill):  KVSender.send_layer(...) × layers → KVSender.finish(...) → Future
    receiver side (decode): KVReceiver(host, port, sink).start(); sink.on_layer/on_done/on_failed

Layers stream one by one; layers that are ready together (a prefill chunk's end, a pull, a
backlog behind a slow receiver) share one message (`coalesce`, wire `BATCH`).

Modules: `config` (TransferConfig), `state` (lifecycle, results, errors), `wire` (framing and
version), `rendezvous` (pair opening), `channel` (process groups of one pair), `sender_pair` /
`receiver_pair` (one pair's threads), `payload` (how a pair moves payloads: inline) and
`nixl_path` / `nixl_agent` (NIXL landing pools), `coalesce` (how many ready layers one message
carries), `sender` / `receiver` (the two engines), `checks` (argument validation), `stats`,
`auth` (authenticated pairs, and the tickets that bind a transfer to the hand-off that
announced it: `new_ticket`).
"""

from typing import TYPE_CHECKING

from kv_store.transfer.auth import new_ticket
from kv_store.transfer.config import TransferConfig
from kv_store.transfer.state import TransferError, TransferResult, TransferState
from kv_store.transfer.wire import VERSION

if TYPE_CHECKING:
    from kv_store.transfer.receiver import KVReceiver, ReceiveSink
    from kv_store.transfer.sender import KVSender

# The engines (torch, torch.distributed) load on first use: a process that only configures
# transfers (the router, `pdserve` commands) reads `TransferConfig` without them.
_LAZY = {"KVReceiver": "receiver", "ReceiveSink": "receiver", "KVSender": "sender"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "VERSION",
    "KVReceiver",
    "KVSender",
    "ReceiveSink",
    "TransferConfig",
    "TransferError",
    "TransferResult",
    "TransferState",
    "new_ticket",
]
