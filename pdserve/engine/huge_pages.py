"""Large host buffers on transparent huge pages: the CPU KV cache, NIXL's slot pools and a
CPU model's weights.

A 2 MiB page covers 512 of the 4 KiB ones, so a walk over a layer's blocks misses the TLB far
less, and the kernel's cross-process copy (CMA, which NIXL uses on one host) pins one page per
2 MiB: a NIXL READ from huge pages moved 0.8 of a memcpy on the Zen 5 VM against 0.35 from
4 KiB pages, and a READ into a huge-page cache ~5% more than into a plain one
(`docs/perf.md`). The buffer is a private anonymous mapping, aligned to 2 MiB and advised
`MADV_HUGEPAGE` (what THP's default `madvise` mode needs), then left untouched: pages are
mapped, zeroed, as they are first written, so an unused part of a large cache costs nothing.
Where the kernel grants no huge pages the same buffer is on plain pages.

A CPU model's weights are moved after loading into one such buffer (`weights_to_huge_pages`):
a batch-1 decode step streams every weight once, and the default model's 120 int4 GEMVs ran
in 0.974-0.993x the time from huge pages (docs/perf.md). One buffer for all of them, so a small
tensor does not take a 2 MiB page of its own.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

HUGE_PAGE = 2 << 20


@dataclass(frozen=True)
class HostBuffer:
    """`tensor`: `nbytes` zeroed bytes (uint8) starting on a 2 MiB boundary of `region`, at
    offset `start`; the tensor keeps the mapping alive."""

    tensor: torch.Tensor
    region: mmap.mmap
    start: int


def huge_page_buffer(nbytes: int) -> HostBuffer:
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # no THP in this kernel: plain pages
            region.madvise(mmap.MADV_HUGEPAGE)
    return HostBuffer(whole[start:start + nbytes], region, start)


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on huge pages (see the module docstring)."""
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    if not nbytes:
        return torch.zeros(shape, dtype=dtype)
    return huge_page_buffer(nbytes).tensor.view(dtype).view(shape)


WEIGHT_ALIGN = 64
"""Each weight starts on a cache line of the shared buffer."""


def model_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """A loaded model's weights: its parameters and buffers, and what each layer's linear
    method holds besides them (`LinearMethod.state_tensors`: a packed int4 copy, an LM head's
    int8 one)."""
    out = [*module.parameters(), *module.buffers()]
    for sub in module.modules():
        method = getattr(sub, "method", None)
        state = getattr(method, "state_tensors", None)
        if state is not None:
            out.extend(state())
    return out


def _movable(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    """CPU tensors with a storage of their own, each storage once (tied weights are one)."""
    seen: set[int] = set()
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous():
            continue
        key = t.untyped_storage().data_ptr()
        if key in seen or t.untyped_storage().nbytes() != t.nbytes:
            continue  # shared, or a view into a larger storage: left where it is
        seen.add(key)
        yield t


def weights_to_huge_pages(tensors: Iterable[torch.Tensor]) -> int:
    """Move the CPU tensors into one huge-page buffer, in place (`tensor.data` is swapped, so
    every holder of a tensor sees the new storage, with the same values); returns the bytes
    moved. Tensors that share a storage, or view part of one, stay where they are."""
    moving = list(_movable(tensors))
    offsets, total = [], 0
    for t in moving:
        offsets.append(total)
        total += -(-t.nbytes // WEIGHT_ALIGN) * WEIGHT_ALIGN
    if not total:
        return 0
    arena = huge_page_buffer(total).tensor
    for t, off in zip(moving, offsets, strict=True):
        placed = arena[off:off + t.nbytes].view(t.dtype).view(t.shape)
        placed.copy_(t)
        t.data = placed
    return total
