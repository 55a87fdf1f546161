"""SSD tier: append-only segment files of fixed-size, checksummed block records.

A record (`record`: versioned header, int32 token ids, opaque block bytes, one checksum over
tokens + bytes) is written at the end of the open segment. A segment holds
`records_per_segment` records and is only appended to; an in-memory index maps
hash → (segment, offset, token ids). When a new segment would exceed the capacity, the oldest
segment is deleted with every block in it (FIFO of segments: cheap, no compaction, no
fragmentation). Each read checks magic, version, hash, length and the checksum: a record
that fails is dropped from the index and reported as a miss (the engine recomputes it); it is
never served. No pickle anywhere: raw bytes behind a struct header.

Reads come in runs (`read_many`: the blocks of one request's prefix). A run's blocks were
usually demoted together, so their records lie next to each other: records adjacent on disk
are read by one `preadv` of up to `MAX_READ_BYTES` into one uninitialised buffer, and every
such range is advised to the kernel (`POSIX_FADV_WILLNEED`) when the run is submitted, so the
disk reads ahead of the I/O threads. Reads and writes run on a small thread pool and return
futures. A segment's file descriptor is closed only when no read or write on it is in flight,
so a descriptor number is never reused under a pending operation.

Without `persist`, leftover segment files are deleted at start-up and every segment at
`close`. With `persist` (a worker with a stable id restarting), `close` keeps the files and
start-up rebuilds the index from them: each record's header and token ids are read back
(records of another layout or version are skipped and counted in `num_refused`; a torn or
corrupted record still fails its checksum when read, so it is recomputed, never served), and
the oldest segments beyond the capacity are dropped.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kv_store.tiers import record

log = logging.getLogger(__name__)
SEGMENT_GLOB = "seg-*.pdkv"
DEFAULT_SEGMENT_BYTES = 64 << 20
MAX_READ_BYTES = 8 << 20  # one preadv of adjacent records: a plain sequential reader's chunk

NotifyFn = Callable[[str, bytes], None]
"""("stored" | "removed", hash): called from I/O threads too."""


@dataclass
class _Segment:
    seg_id: int
    path: Path
    fd: int
    num_records: int = 0
    inflight: int = 0
    dead: bool = False
    hashes: dict[bytes, None] = field(default_factory=dict)  # in write order


@dataclass(frozen=True)
class _Loc:
    segment: _Segment
    offset: int
    tokens: tuple[int, ...]


class SSDStore:
    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, block_bytes: int,
                 block_size: int, io_threads: int = 2,
                 segment_bytes: int = DEFAULT_SEGMENT_BYTES,
                 notify: NotifyFn | None = None, persist: bool = False) -> None:
        self.dir = Path(directory)
        self.block_bytes = block_bytes
        self.block_size = block_size
        self.record_bytes = record.record_bytes(block_size, block_bytes)
        if capacity_bytes < self.record_bytes:
            raise ValueError(f"kv_ssd capacity {capacity_bytes} B holds no block record of "
                             f"{self.record_bytes} B")
        self.records_per_segment = max(1, min(segment_bytes, capacity_bytes)
                                       // self.record_bytes)
        self.max_segments = max(1, capacity_bytes
                                // (self.records_per_segment * self.record_bytes))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.persist = persist
        if not persist:
            for old in self.dir.glob(SEGMENT_GLOB):
                old.unlink()
        self._notify = notify
        self._lock = threading.Lock()
        self._index: dict[bytes, _Loc] = {}
        self._pending: dict[bytes, Future] = {}  # hash → its write still in flight
        self._writes: set[Future] = set()
        self._segments: list[_Segment] = []  # oldest first
        self._next_id = 0
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kv-ssd")
        self.num_corrupted = 0
        self.num_evicted = 0
        self.num_recovered = 0
        self.num_refused = 0  # persisted records of another layout or record version
        if persist:
            self._recover()

    # -- queries -------------------------------------------------------------------------
    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return block_hash in self._index

    def has(self, block_hash: bytes, token_ids: Sequence[int]) -> bool:
        with self._lock:
            loc = self._index.get(block_hash)
            return loc is not None and loc.tokens == tuple(token_ids)

    def tokens_of(self, block_hash: bytes) -> tuple[int, ...] | None:
        with self._lock:
            loc = self._index.get(block_hash)
            return None if loc is None else loc.tokens

    @property
    def bytes_used(self) -> int:
        with self._lock:
            return sum(s.num_records for s in self._segments) * self.record_bytes

    def location(self, block_hash: bytes) -> tuple[Path, int] | None:
        """(segment file, record offset) of a block: for tools and tests."""
        with self._lock:
            loc = self._index.get(block_hash)
            return None if loc is None else (loc.segment.path, loc.offset)

    # -- writes --------------------------------------------------------------------------
    def write(self, block_hash: bytes, token_ids: Sequence[int], data: bytes) -> Future[bool]:
        """Append one block in the background; the future says whether it was stored (False
        when already held or being written)."""
        if len(data) != self.block_bytes or len(token_ids) != self.block_size:
            raise ValueError(f"SSD record needs {self.block_bytes} bytes and "
                             f"{self.block_size} tokens, got {len(data)} and {len(token_ids)}")
        tokens = tuple(int(t) for t in token_ids)
        with self._lock:
            if block_hash in self._index or block_hash in self._pending:
                return _done(False)
            seg, offset = self._reserve()
            parts = record.encode(block_hash, tokens, data)
            fut = self._pool.submit(self._write_record, seg, offset, block_hash, tokens, parts)
            self._pending[block_hash] = fut
            self._writes.add(fut)
        fut.add_done_callback(self._write_done)
        return fut

    def _write_done(self, fut: Future) -> None:
        with self._lock:
            self._writes.discard(fut)

    def flush(self) -> None:
        """Wait until every write issued so far has landed (or failed)."""
        with self._lock:
            writes = list(self._writes)
        for fut in writes:
            fut.exception()

    def _reserve(self) -> tuple[_Segment, int]:
        """A record slot at the end of the open segment (lock held)."""
        if not self._segments or self._segments[-1].num_records >= self.records_per_segment:
            if len(self._segments) >= self.max_segments:
                self._drop_segment(self._segments[0])
            path = self.dir / f"seg-{self._next_id:08d}.pdkv"
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            self._segments.append(_Segment(self._next_id, path, fd))
            self._next_id += 1
        seg = self._segments[-1]
        offset = seg.num_records * self.record_bytes
        seg.num_records += 1
        seg.inflight += 1
        return seg, offset

    def _write_record(self, seg: _Segment, offset: int, block_hash: bytes,
                      tokens: tuple[int, ...], parts: list[bytes]) -> bool:
        ok = False
        try:
            if not seg.dead:
                ok = os.pwritev(seg.fd, parts, offset) == self.record_bytes
        except OSError:
            ok = False
        finally:
            with self._lock:
                self._pending.pop(block_hash, None)
                ok = ok and not seg.dead
                if ok:
                    self._index[block_hash] = _Loc(seg, offset, tokens)
                    seg.hashes[block_hash] = None
                self._release(seg)
        if ok and self._notify:
            self._notify("stored", block_hash)
        return ok

    # -- reads ---------------------------------------------------------------------------
    def read(self, block_hash: bytes, token_ids: Sequence[int]) -> Future[memoryview | None]:
        """One block (see `read_many`)."""
        return self.read_many([(block_hash, token_ids)])[0]

    def read_many(self, blocks: Sequence[tuple[bytes, Sequence[int]]]
                  ) -> list[Future[memoryview | None]]:
        """Futures of the blocks' bytes, in order: None on a miss, a token mismatch or a
        failed checksum. Blocks whose writes are still in flight are read once they land.
        Records adjacent on disk are read together (see the module docstring)."""
        with self._lock:
            writing = [self._pending[h] for h, _ in blocks if h in self._pending]
        for w in writing:
            w.exception()  # wait; a block just demoted is often the one asked for
        futs: list[Future] = []
        wanted: list[tuple[_Loc, bytes, Future]] = []
        with self._lock:
            for h, t in blocks:
                loc = self._index.get(h)
                if loc is None or loc.tokens != tuple(t):
                    futs.append(_done(None))
                    continue
                futs.append(Future())
                wanted.append((loc, h, futs[-1]))
            runs = _adjacent_runs(wanted, self.record_bytes,
                                  max(1, MAX_READ_BYTES // self.record_bytes))
            for run in runs:
                run[0][0].segment.inflight += 1
        for run in runs:
            self._advise(run)
            self._pool.submit(self._read_run, run)
        return futs

    def _advise(self, run: list[tuple[_Loc, bytes, Future]]) -> None:
        """Tell the kernel this range is wanted soon, so it reads ahead of the I/O threads."""
        loc = run[0][0]
        try:
            os.posix_fadvise(loc.segment.fd, loc.offset, len(run) * self.record_bytes,
                             os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):  # advice only: a platform without it reads anyway
            pass

    def _read_run(self, run: list[tuple[_Loc, bytes, Future]]) -> None:
        """I/O thread: one read of adjacent records, then each is checked and resolved
        (whatever happens, every future of the run is resolved)."""
        found: list[memoryview | None] = [None] * len(run)
        try:
            view = memoryview(self._read_range(run[0][0], len(run) * self.record_bytes))
            for i, (loc, h, _) in enumerate(run):
                rec = view[i * self.record_bytes:(i + 1) * self.record_bytes]
                found[i] = record.decode(rec, h, loc.tokens, self.block_bytes)
                if found[i] is None:
                    self._corrupted(h, loc)
        finally:
            for (_, _, fut), data in zip(run, found, strict=True):
                if fut.set_running_or_notify_cancel():  # False: the caller cancelled it
                    fut.set_result(data)

    def _read_range(self, loc: _Loc, nbytes: int) -> np.ndarray:
        """`nbytes` from `loc` into an uninitialised buffer (shorter on a short read or an
        error); releases the segment taken in `read_many`."""
        buf = np.empty(nbytes, dtype=np.uint8)  # no zero fill: every byte is read over
        try:
            got = os.preadv(loc.segment.fd, [buf], loc.offset)
        except OSError:
            got = 0
        finally:
            with self._lock:
                self._release(loc.segment)
        return buf[:got]

    def _corrupted(self, block_hash: bytes, loc: _Loc) -> None:
        with self._lock:
            self.num_corrupted += 1
            dropped = self._index.get(block_hash) is loc
            if dropped:
                del self._index[block_hash]
                loc.segment.hashes.pop(block_hash, None)
        if dropped and self._notify:
            self._notify("removed", block_hash)

    # -- recovery (persist) --------------------------------------------------------------
    def _recover(self) -> None:
        """Rebuild the index from the segment files a previous process left (start-up)."""
        paths = sorted((p for p in self.dir.glob(SEGMENT_GLOB) if _segment_id(p) >= 0),
                       key=_segment_id)
        for path in paths:
            seg = _Segment(_segment_id(path), path, os.open(path, os.O_RDWR))
            seg.num_records = min(os.fstat(seg.fd).st_size // self.record_bytes,
                                  self.records_per_segment)
            for i in range(seg.num_records):
                found = self._read_header(seg.fd, i * self.record_bytes)
                if found is not None and found[0] not in self._index:
                    self._index[found[0]] = _Loc(seg, i * self.record_bytes, found[1])
                    seg.hashes[found[0]] = None
            self._segments.append(seg)
            self._next_id = seg.seg_id + 1
        with self._lock:
            for seg in [s for s in self._segments if not s.hashes]:
                self._drop_segment(seg)  # nothing usable: another layout, or empty
            while len(self._segments) > self.max_segments:
                self._drop_segment(self._segments[0])
        self.num_recovered = len(self._index)
        if self.num_refused:
            log.warning("SSD tier %s: %d persisted records of another layout or record version "
                        "(this one writes version %d) were skipped; their blocks will be "
                        "recomputed", self.dir, self.num_refused, record.VERSION)
        if self._notify:
            for h in list(self._index):
                self._notify("stored", h)

    def _read_header(self, fd: int, offset: int) -> tuple[bytes, tuple[int, ...]] | None:
        """(hash, token ids) of the record at `offset` if its header fits this layout."""
        raw = os.pread(fd, record.HEADER.size + 4 * self.block_size, offset)
        found = record.parse_header(raw, self.block_size, self.block_bytes)
        if found is None:
            self.num_refused += 1
            return None
        return found.block_hash, found.tokens

    # -- eviction and shutdown -----------------------------------------------------------
    def _drop_segment(self, seg: _Segment) -> None:
        """Delete the oldest segment and forget its blocks (lock held)."""
        self._segments.remove(seg)
        seg.dead = True
        for h in seg.hashes:
            self._index.pop(h, None)
            self.num_evicted += 1
            if self._notify:
                self._notify("removed", h)
        seg.hashes.clear()
        seg.path.unlink(missing_ok=True)
        if seg.inflight == 0:
            os.close(seg.fd)

    def _release(self, seg: _Segment) -> None:
        seg.inflight -= 1
        if seg.dead and seg.inflight == 0:
            os.close(seg.fd)

    def close(self) -> None:
        """Wait for pending I/O, then delete every segment (with `persist`: close the files
        and keep them for the next start)."""
        self._pool.shutdown(wait=True)
        with self._lock:
            for seg in list(self._segments):
                if not self.persist:
                    self._drop_segment(seg)
                elif not seg.dead:
                    seg.dead = True
                    os.close(seg.fd)
            self._segments.clear()


def _segment_id(path: Path) -> int:
    """The number in `seg-<n>.pdkv`; -1 for a name this store never writes."""
    tail = path.stem.split("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def _adjacent_runs(wanted: list[tuple[_Loc, bytes, Future]], record_bytes: int,
                   max_records: int) -> list[list[tuple[_Loc, bytes, Future]]]:
    """Group reads into runs of records that follow each other in one segment."""
    runs: list[list[tuple[_Loc, bytes, Future]]] = []
    for item in sorted(wanted, key=lambda w: (w[0].segment.seg_id, w[0].offset)):
        last = runs[-1][-1][0] if runs else None
        if (last is not None and last.segment is item[0].segment and len(runs[-1]) < max_records
                and item[0].offset == last.offset + record_bytes):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def _done(value):
    f: Future = Future()
    f.set_result(value)
    return f
