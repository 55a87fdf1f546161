"""Counters of one sender or receiver: bytes moved, transfers done/failed and their latency."""

from __future__ import annotations

import statistics
import threading
from collections import deque
from typing import Any

_LATENCY_WINDOW = 1024  # recent transfers kept for the latency summary


class TransferStats:
    """Thread-safe counters; `snapshot()` returns the plain dict that `stats()` exposes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes_sent = 0
        self._bytes_received = 0
        self._bytes_received_nixl = 0
        self._bytes_read_nixl = 0
        self._done = 0
        self._failed = 0
        self._refused = 0
        self._frames_refused = 0
        self._messages = 0
        self._parts = 0
        self._latencies: deque[float] = deque(maxlen=_LATENCY_WINDOW)

    def add_sent(self, nbytes: int) -> None:
        with self._lock:
            self._bytes_sent += nbytes

    def add_received(self, nbytes: int, nixl: bool = False, read: bool = False) -> None:
        """`nixl`: the bytes came through NIXL; `read`: by a READ of the sender's staging
        slot (one host), not written into a landing slot."""
        with self._lock:
            self._bytes_received += nbytes
            if nixl:
                self._bytes_received_nixl += nbytes
            if read:
                self._bytes_read_nixl += nbytes

    def record_message(self, parts: int) -> None:
        """A message carrying `parts` LAYER parts arrived (more than one: coalesced)."""
        with self._lock:
            self._messages += 1
            self._parts += parts

    def record_done(self, latency_s: float) -> None:
        with self._lock:
            self._done += 1
            self._latencies.append(latency_s)

    def record_failed(self) -> None:
        with self._lock:
            self._failed += 1

    def record_refused(self) -> None:
        """A pair offer turned down (bad signature, foreign version, no capacity)."""
        with self._lock:
            self._refused += 1

    def record_frame_refused(self) -> None:
        """A frame whose ticket tag did not match its request's ticket."""
        with self._lock:
            self._frames_refused += 1

    def snapshot(self, **extra: Any) -> dict[str, Any]:
        with self._lock:
            lat = sorted(self._latencies)
            out: dict[str, Any] = {
                "bytes_sent": self._bytes_sent,
                "bytes_received": self._bytes_received,
                "bytes_received_nixl": self._bytes_received_nixl,
                "bytes_read_nixl": self._bytes_read_nixl,
                "transfers_done": self._done,
                "transfers_failed": self._failed,
                "pairs_refused": self._refused,
                "frames_refused": self._frames_refused,
                "layer_messages": self._messages,
                "layer_parts": self._parts,
                "latency_s": _summary(lat),
            }
        out.update(extra)
        return out


def _summary(lat: list[float]) -> dict[str, float | int]:
    if not lat:
        return {"count": 0}
    return {
        "count": len(lat),
        "mean": statistics.fmean(lat),
        "p50": lat[len(lat) // 2],
        "p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "max": lat[-1],
    }
