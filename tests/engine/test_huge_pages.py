"""The CPU KV cache and NIXL's slot pools sit on transparent huge pages where the kernel
grants them (`pdserve.engine.huge_pages`)."""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

from pdserve.engine.huge_pages import HUGE_PAGE, huge_page_zeros
from pdserve.engine.kv_layout import KVLayout
from pdserve.engine.quant.kv_format import KVCacheFormat

pytestmark = pytest.mark.unit

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _smaps_kib(address: int, field: str) -> int | None:
    """A field of /proc/self/smaps (KiB) for the mapping holding `address` (None: no such
    mapping)."""
    lo = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            lo = (start, end)
        elif head == field and lo and lo[0] <= address < lo[1]:
            return int(line.split()[1])
    return None


def _huge_kib(address: int) -> int | None:
    return _smaps_kib(address, "AnonHugePages:")


def _resident_fraction(t: torch.Tensor) -> float:
    """The share of `t`'s 4 KiB pages that are mapped now (mincore(2): exact for the range,
    where smaps sums whole mappings, which the kernel merges when they are adjacent)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.data_ptr() - t.data_ptr() % page
    length = t.data_ptr() + t.nbytes - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec)
    assert rc == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) / pages


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


def test_a_prefaulted_cpu_kv_cache_is_resident_from_the_start_and_a_lazy_one_is_not():
    layout = KVLayout.gqa(2, 4, 8, 16, KVCacheFormat.from_config("auto", torch.float32))
    blocks = 2048  # 8 MiB a layer
    lazy = layout.new_caches(blocks, 1, torch.device("cpu"))
    eager = layout.new_caches(blocks, 1, torch.device("cpu"), prefault=True)
    assert all(_resident_fraction(c) == 0 for c in lazy)  # untouched: nothing mapped
    assert all(_resident_fraction(c) == 1 for c in eager)
    assert all(c.data_ptr() % HUGE_PAGE == 0 and not c.any() for c in eager)


def test_the_engine_prefaults_its_cache_when_asked(tiny_llama):
    from pdserve.engine import LLM

    for prefault in (False, True):
        llm = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=1024,
                  kv_cache_prefault=prefault)
        resident = [_resident_fraction(c) for c in llm.engine.kv_caches]
        assert resident == [1.0 if prefault else 0.0] * len(resident)


def test_a_cpu_models_weights_share_one_huge_page_buffer(tiny_llama):
    # Parameters, buffers and what the linear methods hold (the packed int4 copies, the LM
    # head's int8 one) are moved after loading into one buffer, in one run of memory.
    from pdserve.engine import LLM
    from pdserve.engine.huge_pages import WEIGHT_ALIGN, model_tensors

    llm = LLM(str(tiny_llama), dtype="float32", quantization="int4", lm_head_dtype="int8")
    tensors = {t.data_ptr(): t for t in model_tensors(llm.engine.runner.model) if t.numel()}
    methods = [m.method for m in llm.engine.runner.model.modules()
               if getattr(m, "method", None) is not None]
    assert any(m.state_tensors() for m in methods)  # the packed copies are among them
    starts = sorted(tensors)
    assert starts[0] % HUGE_PAGE == 0
    span = sum(-(-t.nbytes // WEIGHT_ALIGN) * WEIGHT_ALIGN for t in tensors.values())
    last = tensors[starts[-1]]
    assert last.data_ptr() + last.nbytes - starts[0] <= span
