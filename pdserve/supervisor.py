"""Keeping a local cluster's processes up: respawn a child that exits, with backoff.

`pdserve up` runs a `Supervisor` over its `LocalCluster`: any child (a worker or the router)
that exits — crashed, killed, out of memory — is started again with the same command line and
ports, while the rest keep serving (the router takes a worker back when its polls succeed).
Only stopping the cluster (Ctrl-C / SIGTERM on `pdserve up`) ends it.

Per child:

    running ──exits──► waiting (backoff: RestartPolicy.delay(failures)) ──► starting
       ▲                                                                       │
       └──────────────── announces READY ◄─────────────────────────────────────┘
    A child that exits again soon after (before `stable_after_s`) waits longer next time;
    one that ran that long starts from the shortest wait again.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.launcher import Child, LocalCluster

log = logging.getLogger(__name__)

_TAIL_LINES = 20  # of a log, printed when its process exits


@dataclass(frozen=True)
class RestartPolicy:
    """How long to wait before starting a child that exited again."""

    initial_backoff_s: float = 0.5
    """Wait before the first restart."""
    max_backoff_s: float = 30.0
    multiplier: float = 2.0
    stable_after_s: float = 60.0
    """A child that ran this long counts as healthy: its next restart waits the least."""

    def delay(self, failures: int) -> float:
        """Wait before restart number `failures + 1` of a child that keeps failing."""
        return min(self.initial_backoff_s * self.multiplier ** failures, self.max_backoff_s)


@dataclass
class _Track:
    """What the supervisor remembers about one child."""

    failures: int = 0  # exits in a row that came soon after a start
    started_at: float = 0.0
    due: float | None = None  # when a child that exited is started again
    announced: bool = True  # the latest start has been seen ready (logged)


class Supervisor:
    def __init__(self, cluster: LocalCluster, policy: RestartPolicy = RestartPolicy(),
                 period_s: float = 0.2) -> None:
        self.cluster = cluster
        self.policy = policy
        self.period_s = period_s
        self._tracks: dict[str, _Track] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.check(time.monotonic())
            except Exception:  # noqa: BLE001 - a failed respawn is retried next period
                log.exception("supervisor: check failed")

    def check(self, now: float) -> None:
        """One pass: notice exits, start what is due, note who is back."""
        c = self.cluster
        for child in [*([c.router] if c.router is not None else []), *c.children]:
            if self._stop.is_set():
                return
            self._check(child, self._tracks.setdefault(child.name, _Track(started_at=now)),
                        now)

    def _check(self, child: Child, t: _Track, now: float) -> None:
        if child.proc.poll() is None:
            if not t.announced and child.ready.is_set():
                t.announced = True
                print(f"pdserve: {child.name} is back ({child.info.get('address')})",
                      flush=True)
            if now - t.started_at >= self.policy.stable_after_s:
                t.failures = 0
            return
        if t.due is None:  # just exited
            wait = self.policy.delay(t.failures)
            t.failures += 1
            t.due = now + wait
            print(f"pdserve: {child.name} exited with code {child.proc.returncode}; "
                  f"restarting in {wait:.1f}s", flush=True)
            tail = self.cluster.log_tail(child).rstrip()
            if tail:  # why it exited: its stderr goes to a file, not to this terminal
                lines = tail.splitlines()[-_TAIL_LINES:]
                print(f"pdserve: the end of {self.cluster.log_path(child)}:", flush=True)
                print("\n".join(f"  | {line}" for line in lines), flush=True)
            return
        if now >= t.due:
            t.due, t.started_at, t.announced = None, now, False
            self.cluster.respawn(child)
