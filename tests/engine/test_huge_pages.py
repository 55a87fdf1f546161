"""The CPU KV cache and NIXL's slot pools sit on transparent huge pages where the kernel
grants them (`pdserve.engine.huge_pages`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.engine.huge_pages import HUGE_PAGE, huge_page_zeros
from pdserve.engine.kv_layout import KVLayout
from pdserve.engine.quant.kv_format import KVCacheFormat

pytestmark = pytest.mark.unit

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib(address: int) -> int | None:
    """AnonHugePages of the mapping holding `address` in this process (None: not found)."""
    lo = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            lo = (start, end)
        elif head == "AnonHugePages:" and lo and lo[0] <= address < lo[1]:
            return int(line.split()[1])
    return None


def test_a_huge_page_tensor_is_zeroed_aligned_and_of_the_asked_shape():
    t = huge_page_zeros((3, 2, 5), torch.float32)
    assert t.shape == (3, 2, 5) and t.dtype == torch.float32 and not t.any()
    assert t.data_ptr() % HUGE_PAGE == 0 and t.is_contiguous()
    assert huge_page_zeros((0, 4), torch.float16).shape == (0, 4)


@pytest.mark.skipif(not _THP.exists() or "[never]" in _THP.read_text(),
                    reason="this kernel grants no transparent huge pages")
def test_written_cache_pages_are_huge_ones():
    t = huge_page_zeros((4 * HUGE_PAGE // 4,), torch.float32)
    t.fill_(1.0)  # first touch maps the pages
    assert (_huge_kib(t.data_ptr()) or 0) >= HUGE_PAGE // 1024


def test_the_cpu_kv_cache_comes_from_huge_pages():
    layout = KVLayout.gqa(2, 4, 8, 4, KVCacheFormat.from_config("auto", torch.float32))
    caches = layout.new_caches(16, 1, torch.device("cpu"))
    assert all(c.data_ptr() % HUGE_PAGE == 0 and not c.any() for c in caches)
