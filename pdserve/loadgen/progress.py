"""Progress display on stderr: tqdm when it is installed, else a plain one-line bar."""

from __future__ import annotations

import sys
import time
from typing import Protocol, TextIO


class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


class NoProgress:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


class SimpleBar:
    """`label [#####.....] 12/40` redrawn in place, at most a few times a second."""

    def __init__(self, total: int, label: str, stream: TextIO, width: int = 30) -> None:
        self._total, self._label, self._stream, self._width = total, label, stream, width
        self._done = 0
        self._drawn_at = 0.0
        self._draw()

    def update(self, n: int = 1) -> None:
        self._done += n
        now = time.monotonic()
        if now - self._drawn_at >= 0.2 or self._done >= self._total:
            self._draw()

    def close(self) -> None:
        self._draw()
        self._stream.write("\n")
        self._stream.flush()

    def _draw(self) -> None:
        self._drawn_at = time.monotonic()
        filled = self._width * self._done // max(self._total, 1)
        bar = "#" * filled + "." * (self._width - filled)
        self._stream.write(f"\r{self._label} [{bar}] {self._done}/{self._total}")
        self._stream.flush()


def make_progress(total: int, label: str, enabled: bool = True,
                  stream: TextIO | None = None) -> Progress:
    """A progress bar over total items on stderr (or stream); a no-op when not enabled."""
    if not enabled:
        return NoProgress()
    stream = stream or sys.stderr
    try:
        from tqdm import tqdm
    except ImportError:
        return SimpleBar(total, label, stream)
    return tqdm(total=total, desc=label, file=stream, unit="req")
