"""Per-request transfer state machine, results and errors, shared by sender and receiver.

Lifecycle of one request's KV transfer (each side keeps its own record)::

    PENDING ──first message on the wire──► TRANSFERRING ──DONE marker sent/received──► DONE
       │                                        │
       └──────── abort / lease / timeout / pair broken / closed ────────────────────► FAILED

Sender: a record is PENDING from the first `send_layer`/`finish` call until the pair thread puts
its first message on the wire; DONE once the DONE marker was sent. Receiver: a record is PENDING
only when announced by `expect()`; it is TRANSFERRING from the first message that arrives. DONE and
FAILED are terminal: a terminal record never changes again (late messages are dropped).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum


class TransferState(Enum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (TransferState.DONE, TransferState.FAILED)


_ALLOWED: dict[TransferState, frozenset[TransferState]] = {
    TransferState.PENDING: frozenset({TransferState.TRANSFERRING, TransferState.FAILED}),
    TransferState.TRANSFERRING: frozenset({TransferState.DONE, TransferState.FAILED}),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
}


def check_transition(old: TransferState, new: TransferState) -> None:
    """Raise `ValueError` unless `old -> new` is an edge of the lifecycle above."""
    if new not in _ALLOWED[old]:
        raise ValueError(f"illegal transfer state transition {old.name} -> {new.name}")


class TransferError(RuntimeError):
    """A transfer failed: timeout, lease expiry, abort, peer failure or protocol error."""


@dataclass(frozen=True)
class TransferResult:
    """What a completed send reports through the future returned by `KVSender.finish`."""

    request_id: str
    layers: int
    """Layer messages sent for the request."""
    bytes_sent: int
    """Payload bytes sent for the request (headers excluded)."""
    latency_s: float
    """From the request's first call on the sender to its DONE marker being sent."""


class History:
    """Bounded memory of finished requests and why they ended (oldest forgotten first).
    Not thread-safe: the owner holds its own lock around it."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._ended: OrderedDict[str, tuple[TransferState, str]] = OrderedDict()

    def add(self, request_id: str, state: TransferState, reason: str = "") -> None:
        self._ended[request_id] = (state, reason)
        self._ended.move_to_end(request_id)
        while len(self._ended) > self._size:
            self._ended.popitem(last=False)

    def get(self, request_id: str) -> TransferState | None:
        entry = self._ended.get(request_id)
        return None if entry is None else entry[0]

    def reason(self, request_id: str) -> str:
        entry = self._ended.get(request_id)
        return "" if entry is None else entry[1]
