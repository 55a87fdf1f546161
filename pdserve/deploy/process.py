"""One pdserve process (router or worker) run as a child: start it, wait for its
`PDSERVE_READY {json}` line, watch it, stop it. No Ray here: the Ray actor that supervises a
worker (`deploy.actors`) holds one of these.

    STARTING ──READY line──► READY ──stop()──► STOPPED
        │                      │
        └──exit / timeout──────┴──exit──► EXITED  (reported, never restarted here: the
                                                   cluster manager replaces the worker)
"""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

READY_PREFIX = "PDSERVE_READY "
"""`pdserve.serving.worker_base.READY_PREFIX`, spelled out: that module imports torch, which a
supervising actor has no use for (a test pins the two together)."""
REDIS_URL_ENV = "PDSERVE_REDIS_URL"
"""`pdserve.serving.worker_options.REDIS_URL_ENV` (same reason, same test)."""
CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
"""`pdserve.serving.security.CLUSTER_SECRET_ENV` (same reason, same test)."""


class ProcessState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    EXITED = "exited"
    STOPPED = "stopped"


class ManagedProcess:
    """A child in its own session (so a stop reaches the TP ranks it spawned)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], name: str = "") -> None:
        self.name = name or argv[0]
        self.info: dict = {}
        self._ready = threading.Event()
        self._stopped = False
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, env=dict(env),
                                     start_new_session=True)
        # Keeps draining stdout after READY, so a chatty child never blocks on a full pipe.
        threading.Thread(target=self._read, name=f"{self.name}-stdout", daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip()
            if line.startswith(READY_PREFIX) and not self._ready.is_set():
                self.info = json.loads(line[len(READY_PREFIX):])
                self._ready.set()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def state(self) -> ProcessState:
        if self._stopped:
            return ProcessState.STOPPED
        if self.proc.poll() is not None:
            return ProcessState.EXITED
        return ProcessState.READY if self._ready.is_set() else ProcessState.STARTING

    def wait_ready(self, timeout_s: float) -> dict:
        """The READY line's fields; raises if the child exits first or takes too long (and
        then stops it, so a failed start leaves nothing behind)."""
        end = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} "
                                   "before it was ready")
            if time.monotonic() > end:
                self.stop(grace_s=5.0)
                raise TimeoutError(f"{self.name} was not ready after {timeout_s:.0f}s")
        return dict(self.info)

    def stop(self, grace_s: float) -> int:
        """SIGTERM (a worker leaves the Redis registry and drains what it holds), then
        SIGKILL to the whole session after `grace_s`. Returns the exit code."""
        self._stopped = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._kill_session()
        return self.proc.wait()

    def _kill_session(self) -> None:
        """SIGKILL whatever is left in the child's session (its TP rank processes)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
