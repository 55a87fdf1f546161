"""One copy instead of two on one host: the receiver reads each payload out of the sender's
staging pool straight into its paged cache (wire version 9).

Over the landing pool (`nixl_path`) a byte is copied twice after the prefill gathered it: the
sender's CMA write into a slot, then the receiver's copy into the cache; on one host the two
share the cores and the memory bus. A CMA copy also runs at the pace of the *other* process's
pages: a NIXL READ from 2 MiB pages moved 0.8 of a memcpy on the Zen 5 VM, from 4 KiB pages
0.35 (`docs/perf.md`). So a sender on the receiver's host keeps its payloads in a staging pool
of its own (registered once, on huge pages), and the receiver reads them from there:

    receiver: GRANT{its landing slots, its credit counter}          (as before, once)
    sender:   OFFER{its staging pool's descriptor}                  (once, before any part)
      the prefill gathers a layer straight into a lent staging slot (`KVSender.stage`; any
      other payload is copied into one), then per message of k parts, once the counter
      says at most `window - k` parts are unread: LAYER{..., slot} / BATCH{...} (posted)
    receiver, per part: checks its ticket, reservation and window; the sink lands it
      (`RemoteKV.read_runs`: a NIXL READ into the cache blocks when they are registered,
      `LocalRegions`; else a READ into one of the pair's landing slots and a copy), then
      counter += k

Why this is safe without quarantining cache blocks: the read is the receiver's own copy, made
in its pair thread under the sink's lock, the lock that orders writes against cancellation, so
nothing lands in a block after it was freed. On one host a READ is a `process_vm_readv` in the
calling thread: done when the call returns. Across hosts an RDMA READ that timed out could
still land later, so only same-host pairs read (`nixl_agent.is_local_host`); the others keep
the landing pool, whose slots are quarantined instead. A staging slot is lent
(`LandingPool.lend`): it goes back to the pool when nothing holds its tensor, and the pair
holds each part's until the counter says it was read (a pair that did not close cleanly
hands them to the pool's quarantine, since a read may still be under way).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv_store.transfer import carrier, wire
from kv_store.transfer.nixl_agent import NixlAgent, NixlWriteError, Range, Registration
from kv_store.transfer.wire import ProtocolError


class LocalRegions:
    """Memory registered once with this process's agent that reads may land in directly (the
    paged cache); thread-safe."""

    def __init__(self, agent: NixlAgent) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        self._spans: list[tuple[int, int, str, int]] = []  # (start, end, mem, device)
        self._regs: list[Registration] = []

    def add(self, tensor: torch.Tensor) -> None:
        """Register a contiguous tensor (`ValueError` otherwise)."""
        reg = self._agent.register(tensor)
        start = tensor.data_ptr()
        dev = tensor.get_device() if tensor.is_cuda else 0
        with self._lock:
            self._regs.append(reg)
            self._spans.append((start, start + tensor.numel() * tensor.element_size(),
                                reg.mem, dev))

    def memory_of(self, ranges: Sequence[Range]) -> tuple[str, int] | None:
        """(mem, device) of the one region that holds every range, None if none does."""
        with self._lock:
            spans = list(self._spans)
        lo, hi = min(a for a, _ in ranges), max(a + n for a, n in ranges)
        for start, end, mem, dev in spans:
            if start <= lo and hi <= end:
                return mem, dev
        return None

    def close(self) -> None:
        with self._lock:
            regs, self._regs, self._spans = self._regs, [], []
        for reg in regs:
            self._agent.deregister(reg)


@dataclass(frozen=True)
class ReadSource:
    """What a receiving pair reads from: the sender's agent and staging memory."""

    agent: NixlAgent
    peer: str  # the sending agent, as loaded from its OFFER
    remote_mem: tuple[str, int]
    regions: LocalRegions | None
    timeout_s: float

    def read(self, local_mem: tuple[str, int], local: Sequence[Range],
             remote: Sequence[Range]) -> None:
        try:
            self.agent.read(self.peer, local_mem, local, self.remote_mem, remote,
                            self.timeout_s)
        except NixlWriteError as exc:
            raise ReadFailed(str(exc)) from None


class ReadFailed(RuntimeError):
    """A read from the sender's staging pool failed (it is gone, or did not answer in time)."""


@dataclass(frozen=True, eq=False)
class RemoteKV:
    """A LAYER part that waits in the sender's staging slot: `shape` and `dtype` (its wire
    name) as the header says. A sink that lands payloads itself (`reads_in_place`) gets this
    instead of a tensor and calls `read_runs`; any other is given `tensor()`."""

    shape: tuple[int, ...]
    dtype: str
    source: ReadSource
    remote: int  # address of its first byte in the sender's process
    bounce: torch.Tensor  # uint8 view of one of the pair's landing slots (registered)

    @property
    def nbytes(self) -> int:
        return wire.payload_nbytes(self.shape, self.dtype)

    def tensor(self) -> torch.Tensor:
        """The payload, read into the bounce slot (valid until the pair releases the part)."""
        raw = self.bounce[:self.nbytes]
        self.source.read(_mem_of(raw), [(raw.data_ptr(), self.nbytes)],
                         [(self.remote, self.nbytes)])
        return carrier.carrier_view(raw, self.shape, self.dtype)

    def read_runs(self, dst: torch.Tensor, runs: Sequence[tuple[int, int, int]]) -> None:
        """`dst[first + j] = self[at + j]` for each run (first, at, n): one NIXL READ
        straight into `dst` when it lies in registered memory and matches the payload's dtype
        and block shape; otherwise through the bounce slot and a copy."""
        if tuple(dst.shape[1:]) != self.shape[1:]:
            raise ValueError(f"blocks of {tuple(dst.shape[1:])} cannot take KV of "
                             f"{self.shape[1:]}")
        local = self._ranges(dst, runs) if self._direct(dst) else None
        mem = self.source.regions.memory_of([r for r, _ in local]) if local else None
        if mem is None:
            src = self.tensor()
            for first, at, n in runs:
                dst.narrow(0, first, n).copy_(src.narrow(0, at, n))
            return
        self.source.read(mem, [r for r, _ in local], [r for _, r in local])

    def _direct(self, dst: torch.Tensor) -> bool:
        return (self.source.regions is not None and dst.dtype == getattr(torch, self.dtype)
                and not dst.is_cuda)

    def _ranges(self, dst: torch.Tensor, runs: Sequence[tuple[int, int, int]]
                ) -> list[tuple[Range, Range]] | None:
        """(local, remote) byte ranges of the runs, in order; None if `dst` is not laid out
        as whole rows of contiguous bytes."""
        per_block = self.nbytes // self.shape[0] if self.shape[0] else 0
        out: list[tuple[Range, Range]] = []
        for first, at, n in runs:
            if at < 0 or at + n > self.shape[0]:
                raise ProtocolError(f"run {at}+{n} is outside a part of {self.shape[0]} blocks")
            pieces = byte_ranges(dst.narrow(0, first, n))
            if pieces is None:
                return None
            offset = self.remote + at * per_block
            for address, length in pieces:
                out.append(((address, length), (offset, length)))
                offset += length
        return out


def byte_ranges(view: torch.Tensor) -> list[Range] | None:
    """The view's bytes as (address, length) ranges in row-major order: its innermost dims
    that are laid out contiguously form one range per index of the others (a slice of heads
    of a block is one range per block and K/V); consecutive ranges are merged. None for a
    view whose innermost dim is strided."""
    size = view.element_size()
    shape, strides = list(view.shape), list(view.stride())
    if not shape or 0 in shape:
        return []
    inner, expect = len(shape), 1
    while inner > 0 and (shape[inner - 1] == 1 or strides[inner - 1] == expect):
        expect *= shape[inner - 1]
        inner -= 1
    if inner == len(shape) and shape[-1] > 1:
        return None
    length = expect * size
    base = view.data_ptr()
    offsets = [0]
    for dim in range(inner):
        step = strides[dim] * size
        offsets = [o + i * step for o in offsets for i in range(shape[dim])]
    ranges: list[Range] = []
    for off in offsets:
        if ranges and ranges[-1][0] + ranges[-1][1] == base + off:
            ranges[-1] = (ranges[-1][0], ranges[-1][1] + length)
        else:
            ranges.append((base + off, length))
    return ranges


def _mem_of(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.get_device()) if t.is_cuda else ("DRAM", 0)
