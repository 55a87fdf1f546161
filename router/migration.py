"""Request migration: when a request moves to another worker, and where. Pure, no I/O.

An attempt (one try at a request on one decode worker, with one prefill worker or none) is
*lost* when a worker fails it in a way another worker can make good:

    DECODE_LOST          D's call failed: the process died or its engine stopped
    DECODE_UNRESPONSIVE  D stopped answering its heartbeats mid-request
    DECODE_ENDED         D ended the request on its side (its KV hand-off failed, an engine
                         error, a stream that ended without a finish)
    PREFILL_LOST         P failed or stopped answering before D had the prompt's KV
    WORKER_DRAINING      D or P refused the attempt because it drains (nothing ran there:
                         the attempt is placed again; counted apart, not as a migration)

The router then starts a new attempt with the tokens the client already has (`decide`):
another decode worker (`prefer_others`) computes prompt + those tokens, pulling the prompt's
KV from whoever still holds it, and continues at the next token index, so the client's
stream goes on with no duplicate and no gap. Lost before any token, it is simply a retry
(another prefill worker, or the decode worker prefilling itself). Every request gets at most
`limit` migrations, and none once its deadline is (nearly) gone.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

T = TypeVar("T")


class LostCause(enum.StrEnum):
    DECODE_LOST = "decode_lost"
    DECODE_UNRESPONSIVE = "decode_unresponsive"
    DECODE_ENDED = "decode_ended"
    PREFILL_LOST = "prefill_lost"
    WORKER_DRAINING = "worker_draining"


def cause_of_decode_error(code: grpc.StatusCode) -> LostCause | None:
    """The cause an error status of D's stream stands for; None: not migratable (the
    client's own deadline or cancellation, a bad request, no capacity)."""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN):
        return LostCause.DECODE_LOST
    if code in (grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL,
                grpc.StatusCode.CANCELLED):
        return LostCause.DECODE_ENDED
    return None


def prefill_lost(code: grpc.StatusCode) -> bool:
    """Whether a failed Prefill call is the prefill worker's fault (retry elsewhere)."""
    return code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN,
                    grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED,
                    grpc.StatusCode.INTERNAL)


@dataclass(frozen=True)
class Decision:
    migrate: bool
    status: grpc.StatusCode | None = None
    """The status the request fails with, when it does not migrate."""
    reason: str = ""


@dataclass(frozen=True)
class MigrationPolicy:
    limit: int = 3
    """Most migrations of one request (`--migration-limit`)."""
    min_time_left_s: float = 0.05
    """A request with less time than this before its deadline is not moved."""

    def decide(self, cause: LostCause, migrations: int, time_left_s: float) -> Decision:
        """After `migrations` earlier moves, a request's attempt was lost to `cause`."""
        if time_left_s <= self.min_time_left_s:
            return Decision(False, grpc.StatusCode.DEADLINE_EXCEEDED,
                            "no time left to move the request")
        if migrations >= self.limit:
            return Decision(False, grpc.StatusCode.UNAVAILABLE,
                            f"gave up after {migrations} migration(s) "
                            f"(--migration-limit {self.limit})")
        return Decision(True, reason=str(cause))


def prefer_others(candidates: Sequence[T], address_of, excluded: set[str]) -> list[T]:
    """The candidates a moved request may go to: those that did not already fail it, or
    all of them if every one did (a worker that ended a request may still be healthy)."""
    others = [c for c in candidates if address_of(c) not in excluded]
    return others or list(candidates)
