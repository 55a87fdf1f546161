"""When and how long the client waits before retrying a failed call; pure policy, no I/O.

UNAVAILABLE is retried: it means no server or worker could take the request, so nothing ran
and trying again is safe. RESOURCE_EXHAUSTED is retried only when the server said when to come
back (`retry-after-ms`): the wait is that hint (plus up to 10% jitter), never shorter, so an
overloaded server is not hammered. Every other status is final (a bad request stays bad; a
deadline is the caller's limit). A `stream` is not
retried once a chunk reached the caller, since a restart would repeat output already seen.
Backoff is exponential with "equal jitter" (half fixed, half random) so clients that failed
together do not come back together, and it always fits inside the call's deadline.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import grpc

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE})
RETRYABLE_WITH_HINT = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True)
class RetryPolicy:
    """Retry limits and backoff shape."""

    max_retries: int = 3
    """Retries after the first attempt (0 disables retrying)."""
    initial_backoff_s: float = 0.1
    """Upper bound of the wait before the first retry."""
    max_backoff_s: float = 2.0
    """Upper bound of any single wait."""
    multiplier: float = 2.0
    """Growth of the bound from one retry to the next."""

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError(f"max_retries: must be >= 0, got {self.max_retries}")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError("backoff: need 0 <= initial_backoff_s <= max_backoff_s")
        if self.multiplier < 1:
            raise ValueError(f"multiplier: must be >= 1, got {self.multiplier}")

    def should_retry(self, code: grpc.StatusCode, retries_done: int) -> bool:
        """Whether a call that failed with `code` after `retries_done` retries may go again."""
        return code in RETRYABLE and retries_done < self.max_retries

    def backoff_s(self, retries_done: int, rng: random.Random) -> float:
        """Seconds to wait before retry number `retries_done + 1`."""
        bound = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier**retries_done)
        return bound / 2 + rng.uniform(0, bound / 2)


@dataclass(frozen=True)
class Deadline:
    """An absolute deadline on the monotonic clock, shared by every attempt of one call."""

    expires_at: float | None
    """time.monotonic() value; None for no deadline."""

    @classmethod
    def after(cls, timeout_s: float | None) -> Deadline:
        return cls(None if timeout_s is None else time.monotonic() + timeout_s)

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None without a deadline: a gRPC `timeout=`."""
        if self.expires_at is None:
            return None
        return max(0.0, self.expires_at - time.monotonic())

    def leaves_time_after(self, wait_s: float) -> bool:
        """Whether there is still time for an attempt after waiting wait_s."""
        remaining = self.remaining()
        return remaining is None or remaining > wait_s


def next_wait(
    policy: RetryPolicy,
    code: grpc.StatusCode,
    retries_done: int,
    deadline: Deadline,
    rng: random.Random,
    retry_after_s: float | None = None,
) -> float | None:
    """Seconds to wait before retrying a call that failed with `code`, or None to give up.
    `retry_after_s`: the server's hint, if it sent one."""
    if retries_done >= policy.max_retries:
        return None
    if code in RETRYABLE_WITH_HINT and retry_after_s is not None:
        wait = retry_after_s * (1.0 + 0.1 * rng.random())
    elif policy.should_retry(code, retries_done):
        wait = max(policy.backoff_s(retries_done, rng), retry_after_s or 0.0)
    else:
        return None
    return wait if deadline.leaves_time_after(wait) else None
