"""Large host buffers on transparent huge pages: the CPU KV cache and NIXL's slot pools.

A 2 MiB page covers 512 of the 4 KiB ones, so a walk over a layer's blocks misses the TLB far
less, and the kernel's cross-process copy (CMA, which NIXL uses on one host) pins one page per
2 MiB: a NIXL READ from huge pages moved 0.8 of a memcpy on the Zen 5 VM against 0.35 from
4 KiB pages, and a READ into a huge-page cache ~5% more than into a plain one
(`docs/perf.md`). The buffer is a private anonymous mapping, aligned to 2 MiB and advised
`MADV_HUGEPAGE` (what THP's default `madvise` mode needs), then left untouched: pages are
mapped, zeroed, as they are first written, so an unused part of a large cache costs nothing.
Where the kernel grants no huge pages the same buffer is on plain pages.
"""

from __future__ import annotations

import contextlib
import mmap
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
