"""Where a pipeline's time goes, by stage: wall time spent inside chosen functions, per thread.

A bench wraps the functions it names (`"module:Class.method"`) for the length of a run; every
call's wall time is added to its stage, whatever thread made it. Nothing in the traced code
changes, and the wrappers cost about a microsecond per call. A stage that waits (a receive,
a wait for a slot) shows its waiting too: that is the point, since hand-offs are what is
measured.
"""

from __future__ import annotations

import functools
import importlib
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


class StageTrace:
    """Thread-safe call counts and wall time per stage."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._seconds: dict[str, float] = {}

    def add(self, stage: str, seconds: float) -> None:
        with self._lock:
            self._calls[stage] = self._calls.get(stage, 0) + 1
            self._seconds[stage] = self._seconds.get(stage, 0.0) + seconds

    def reset(self) -> None:
        with self._lock:
            self._calls.clear()
            self._seconds.clear()

    def snapshot(self) -> dict[str, dict[str, float]]:
        """{stage: {"calls": n, "seconds": total}}."""
        with self._lock:
            return {s: {"calls": self._calls[s], "seconds": self._seconds[s]}
                    for s in sorted(self._calls)}

    @contextmanager
    def wrapping(self, targets: Sequence[str]) -> Iterator[StageTrace]:
        """Wrap each `"module:Class.method"` (or `"module:function"`) while inside."""
        undo = [self._wrap(t) for t in targets]
        try:
            yield self
        finally:
            for owner, name, original in reversed(undo):
                setattr(owner, name, original)

    def _wrap(self, target: str) -> tuple[object, str, object]:
        module, _, path = target.partition(":")
        owner: object = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        original = getattr(owner, name)
        stage = path

        @functools.wraps(original)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.add(stage, time.perf_counter() - t0)

        setattr(owner, name, timed)
        return owner, name, original
