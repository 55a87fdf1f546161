"""`host_malloc="retain"`: glibc keeps a step's freed activation pages mapped, so the next
layer's activations of the same size reuse them instead of page-faulting fresh ones."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.host_malloc import MallocState, retain_freed_memory
from pdserve.serving.worker_options import add_worker_args, options_from_args

# A child process per mode: the setting is process-wide, and this one's history would blur
# it. Six 12 MiB activations live together (as a prefill layer's do), then are dropped.
_PLACEMENT = """
import ctypes, sys, torch
from pdserve.engine.host_malloc import retain_freed_memory
if sys.argv[1] == "retain":
    print(retain_freed_memory().state.value)
libc = ctypes.CDLL(None)
libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, (ctypes.c_ssize_t,)
x = torch.ones(3 << 20)
live = [x * 2.0 for _ in range(6)]
heap = next(line.split()[0] for line in open("/proc/self/maps") if line.rstrip().endswith("[heap]"))
lo, hi = (int(v, 16) for v in heap.split("-"))
in_heap = all(lo <= t.data_ptr() < hi for t in live)
top = libc.sbrk(0)
del live
print(in_heap, libc.sbrk(0) == top)
"""


def _placement(mode: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", _PLACEMENT, mode], check=True,
                          capture_output=True, text=True, timeout=120).stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_activations_come_from_the_heap_and_stay_mapped_once_freed():
    # Retained: the blocks are heap memory, and freeing them keeps the heap's top where it was,
    # so the next layer's activations reuse those pages (docs/perf.md counts the page faults
    # this saves). glibc's defaults give each block a fresh mapping of its own.
    assert _placement("retain") == ["retained", "True", "True"]
    assert _placement("system")[0] == "False"
    assert retain_freed_memory() is retain_freed_memory()   # once per process


def test_the_mode_is_validated_and_reaches_the_engine_config():
    assert EngineConfig(model="m").host_malloc == "retain"
    with pytest.raises(ValueError, match="host_malloc must be one of retain, system"):
        EngineConfig(model="m", host_malloc="jemalloc")
    p = argparse.ArgumentParser()
    add_worker_args(p)
    for argv, want in (([], "retain"), (["--host-malloc", "system"], "system")):
        opts = options_from_args("decode", p.parse_args(["--model", "m", *argv]))
        assert opts.engine.host_malloc == want
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--host-malloc", "tcmalloc"])


def test_the_engine_applies_it_on_the_cpu_only_when_asked(tiny_llama):
    from pdserve.engine import LLM

    kept = LLM(str(tiny_llama), dtype="float32").engine
    assert kept.malloc is not None and kept.malloc.state in (MallocState.RETAINED,
                                                             MallocState.UNAVAILABLE)
    assert LLM(str(tiny_llama), dtype="float32", host_malloc="system").engine.malloc is None
