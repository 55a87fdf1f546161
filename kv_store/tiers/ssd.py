"""SSD tier: append-only segment files of fixed-size, checksummed block records.

    record = header (struct `<4sBxH16sII`: magic, version, n_tokens, hash, crc32, data_len)
             + token ids (int32 x block_size) + block bytes (opaque)

A segment holds `records_per_segment` records and is only appended to; an in-memory index maps
hash → (segment, offset, token ids). When a new segment would exceed the capacity, the oldest
segment is deleted with every block in it (FIFO of segments: cheap, no compaction, no
fragmentation). Each read checks magic, hash, length and the crc32 of tokens + bytes: a record
that fails is dropped from the index and reported as a miss (the engine recomputes it); it is
never served. No pickle anywhere: raw bytes behind a struct header.

Reads and writes run on a small thread pool and return futures. A segment's file descriptor is
closed only when no read or write on it is in flight, so a descriptor number is never reused
under a pending operation.

Without `persist`, leftover segment files are deleted at start-up and every segment at
`close`. With `persist` (a worker with a stable id restarting), `close` keeps the files and
start-up rebuilds the index from them: each record's header and token ids are read back
(records of another layout are skipped; a torn or corrupted record still fails its checksum
when read, so it is recomputed, never served), and the oldest segments beyond the capacity
are dropped.
"""

from __future__ import annotations

import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MAGIC = b"PDKV"
VERSION = 1
# Record version history: 1 — first layout (header as above, int32 tokens, raw block bytes).
HEADER = struct.Struct("<4sBxH16sII")
SEGMENT_GLOB = "seg-*.pdkv"
DEFAULT_SEGMENT_BYTES = 64 << 20

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
        self.record_bytes = HEADER.size + 4 * block_size + block_bytes
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
            record = _encode(block_hash, tokens, data)
            fut = self._pool.submit(self._write_record, seg, offset, block_hash, tokens, record)
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
                      tokens: tuple[int, ...], record: bytes) -> bool:
        ok = False
        try:
            if not seg.dead:
                os.pwrite(seg.fd, record, offset)
                ok = True
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
        """The block's bytes, or None on a miss, a token mismatch or a failed checksum.
        A block whose write is still in flight is read once the write lands."""
        with self._lock:
            writing = self._pending.get(block_hash)
        if writing is not None:
            writing.exception()  # wait; a block just demoted is often the one asked for
        with self._lock:
            loc = self._index.get(block_hash)
            if loc is None or loc.tokens != tuple(token_ids):
                return _done(None)
            loc.segment.inflight += 1
        return self._pool.submit(self._read_record, block_hash, loc)

    def _read_record(self, block_hash: bytes, loc: _Loc) -> memoryview | None:
        raw = bytearray(self.record_bytes)
        try:
            if os.preadv(loc.segment.fd, [raw], loc.offset) != len(raw):
                raw = bytearray()
        except OSError:
            raw = bytearray()
        finally:
            with self._lock:
                self._release(loc.segment)
        data = _decode(raw, block_hash, loc.tokens, self.block_bytes)
        if data is None:
            with self._lock:
                self.num_corrupted += 1
                dropped = self._index.get(block_hash) is loc
                if dropped:
                    del self._index[block_hash]
                    loc.segment.hashes.pop(block_hash, None)
            if dropped and self._notify:
                self._notify("removed", block_hash)
        return data

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
        if self._notify:
            for h in list(self._index):
                self._notify("stored", h)

    def _read_header(self, fd: int, offset: int) -> tuple[bytes, tuple[int, ...]] | None:
        """(hash, token ids) of the record at `offset` if its header fits this layout."""
        n_tok = 4 * self.block_size
        raw = os.pread(fd, HEADER.size + n_tok, offset)
        if len(raw) != HEADER.size + n_tok:
            return None
        magic, version, n, h, _crc, length = HEADER.unpack_from(raw)
        if (magic, version, n, length) != (MAGIC, VERSION, self.block_size, self.block_bytes):
            return None
        return h, tuple(np.frombuffer(raw, dtype="<i4", offset=HEADER.size).tolist())

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


def _encode(block_hash: bytes, tokens: tuple[int, ...], data: bytes) -> bytes:
    tok = np.asarray(tokens, dtype="<i4").tobytes()
    crc = zlib.crc32(data, zlib.crc32(tok))
    return HEADER.pack(MAGIC, VERSION, len(tokens), block_hash, crc, len(data)) + tok + data


def _decode(raw: bytearray, block_hash: bytes, tokens: tuple[int, ...],
            block_bytes: int) -> memoryview | None:
    """The block bytes of a record (a writable view into `raw`), or None if it fails a check."""
    n_tok = 4 * len(tokens)
    if len(raw) != HEADER.size + n_tok + block_bytes:
        return None
    magic, version, n, h, crc, length = HEADER.unpack_from(raw)
    if (magic, version, n, h, length) != (MAGIC, VERSION, len(tokens), block_hash, block_bytes):
        return None
    view = memoryview(raw)
    tok = view[HEADER.size:HEADER.size + n_tok]
    data = view[HEADER.size + n_tok:]
    if zlib.crc32(data, zlib.crc32(tok)) != crc:
        return None
    if np.frombuffer(tok, dtype="<i4").tolist() != list(tokens):
        return None
    return data


def _done(value):
    f: Future = Future()
    f.set_result(value)
    return f
