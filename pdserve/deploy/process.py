"""One pdserve process (router or worker) run as a child: start it, wait for its
`PDSERVE_READY {json}` line, keep its output, watch it, stop it. No Ray here: the Ray actor
that supervises a process (`deploy.actors`) holds one of these.

    STARTING ──READY line──► READY ──stop()──► STOPPED
        │                      │
        └──exit / timeout──────┴──exit──► EXITED  (reported, never restarted here: the
                                                   controller replaces the process)

The child dies with its supervisor: it is spawned with PR_SET_PDEATHSIG=SIGKILL from a thread
that lives exactly as long as the child, so a supervisor killed by any means (`kill -9`, a
lost node, `ray.kill`) leaves no orphan serving on a port. Its stdout (but the READY line)
and stderr go to `log_path` when given, and the last lines of stderr are kept: a failed start
says why (e.g. "address already in use"), not just "exited with code 1".
"""

from __future__ import annotations

import collections
import ctypes
import enum
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from pdserve.serving.ready import READY_PREFIX

TAIL_LINES = 40
"""Lines of stderr kept for error messages and `pdserve ray logs`."""
_PR_SET_PDEATHSIG = 1


class ProcessState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    EXITED = "exited"
    STOPPED = "stopped"


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the thread that forked it ends."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


try:
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not Linux: no parent-death signal, the stop path still kills the session
    _LIBC = None


class ManagedProcess:
    """A child in its own session (so a stop reaches the TP ranks it spawned)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], name: str = "",
                 log_path: str | os.PathLike | None = None) -> None:
        self.name = name or argv[0]
        self.info: dict = {}
        self.log_path = str(log_path) if log_path else ""
        self._tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._ready = threading.Event()
        self._stopped = False
        self._log: IO[str] | None = None
        if log_path:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            self._log = open(log_path, "a", buffering=1, errors="replace")
        self._lock = threading.Lock()
        handed: queue.Queue = queue.Queue()
        # The spawning thread reads stdout, then waits for the exit: it outlives the child, so
        # the parent-death signal fires only when the supervisor itself goes.
        threading.Thread(target=self._spawn_and_watch, args=(list(argv), dict(env), handed),
                         name=f"{self.name}-stdout", daemon=True).start()
        got = handed.get()
        if isinstance(got, BaseException):
            raise got
        self.proc: subprocess.Popen = got
        self._stderr_thread = threading.Thread(target=self._read_stderr,
                                               name=f"{self.name}-stderr", daemon=True)
        self._stderr_thread.start()

    def _spawn_and_watch(self, argv: list[str], env: dict, handed: queue.Queue) -> None:
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=env, start_new_session=True,
                                    preexec_fn=_die_with_parent if _LIBC else None)
        except BaseException as exc:  # noqa: BLE001 — handed to the constructor's caller
            handed.put(exc)
            return
        handed.put(proc)
        for raw in proc.stdout:  # keeps draining: a chatty child never blocks on a full pipe
            line = raw.decode(errors="replace").rstrip()
            if line.startswith(READY_PREFIX) and not self._ready.is_set():
                self.info = json.loads(line[len(READY_PREFIX):])
                self._ready.set()
            else:
                self._write(line)
        proc.wait()

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            with self._lock:
                self._tail.append(line)
            self._write(line)

    def _write(self, line: str) -> None:
        if self._log is not None:
            try:
                self._log.write(line + "\n")
            except (OSError, ValueError):  # a full disk or a closed file must not kill us
                pass

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def state(self) -> ProcessState:
        if self._stopped:
            return ProcessState.STOPPED
        if self.proc.poll() is not None:
            return ProcessState.EXITED
        return ProcessState.READY if self._ready.is_set() else ProcessState.STARTING

    def tail(self, lines: int = TAIL_LINES) -> list[str]:
        """The last `lines` lines of the child's stderr."""
        with self._lock:
            return list(self._tail)[-lines:] if lines > 0 else []

    def exit_summary(self) -> str:
        """"exited with code N" (or the signal), then the last lines of stderr."""
        code = self.proc.poll()
        how = (f"was killed by signal {-code}" if code is not None and code < 0
               else f"exited with code {code}")
        tail = self.tail(12)
        last = ("; last lines of its stderr:\n  " + "\n  ".join(tail)) if tail else \
            " (nothing on its stderr)"
        where = f" (full log: {self.log_path})" if self.log_path else ""
        return f"{self.name} {how}{where}{last}"

    def wait_ready(self, timeout_s: float) -> dict:
        """The READY line's fields; raises if the child exits first or takes too long (and
        then stops it, so a failed start leaves nothing behind)."""
        end = time.monotonic() + timeout_s
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None:
                self._drain_stderr()
                raise RuntimeError(self.exit_summary()) from None
            if time.monotonic() > end:
                self.stop(grace_s=5.0)
                raise TimeoutError(f"{self.name} was not ready after {timeout_s:.0f}s" +
                                   ("; last lines of its stderr:\n  " +
                                    "\n  ".join(self.tail(12)) if self.tail(1) else ""))
        return dict(self.info)

    def _drain_stderr(self, timeout_s: float = 2.0) -> None:
        """Let the stderr reader take the last lines of a child that exited (its TP ranks
        may hold the pipe open a little longer: bounded)."""
        self._stderr_thread.join(timeout_s)

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
        code = self.proc.wait()
        if self._log is not None:
            self._write(f"[pdserve] {self.name} stopped (exit code {code})")
        return code

    def _kill_session(self) -> None:
        """SIGKILL whatever is left in the child's session (its TP rank processes)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
