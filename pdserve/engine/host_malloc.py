"""How the process's C allocator (glibc malloc) hands activation memory back and forth.

    retain_freed_memory() -> MallocTuning   # once per process, before the first step

torch allocates every CPU tensor with `posix_memalign` and frees it when the last reference
goes; it keeps no cache of its own on the CPU. glibc serves a block of 128 KiB or more with a
fresh `mmap` (its threshold then moves with what is freed) and trims the top of its heap once
128 KiB there are free. A prefill step of 1024 tokens makes and drops a dozen 6-12 MiB
activations per layer; whether they come back as new pages depends on where those moving
thresholds happen to settle. On the real default model's ragged batch-32 run they often did
not settle (every run on the Zen 4 VM, one in five on the Zen 5: 0.3-1.5M minor page faults,
each zero-filling a page, 7-14% of the run) and sometimes did (~10k faults; docs/perf.md).
Fixing both thresholds (`mallopt`: blocks below 32 MiB
from the heap, the heap trimmed only past 256 MiB free) keeps those pages mapped from one
layer to the next, as a caching allocator would; it holds at most what a step's peak needs,
which the process needed anyway. Larger blocks (the KV cache, weights) are still their own
mappings, returned when freed.

The setting is the process's, like `torch.set_num_threads`: the engine applies it when it
runs on the CPU (`EngineConfig.host_malloc`), and it is idempotent.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from dataclasses import dataclass

# mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20
"""Blocks from this size up get their own mapping: glibc's ceiling for the threshold on 64-bit
(HEAP_MAX_SIZE / 2); a step's activations are all below it."""
TRIM_THRESHOLD = 256 << 20
"""Free memory at the heap's top kept mapped, up to this much: several prefill steps' peaks."""

HOST_MALLOC_MODES = ("retain", "system")
"""`EngineConfig.host_malloc`: retain (the thresholds above) or system (glibc's defaults)."""


class MallocState(enum.Enum):
    RETAINED = "retained"
    UNAVAILABLE = "unavailable"  # not glibc, or mallopt refused a value


@dataclass(frozen=True)
class MallocTuning:
    state: MallocState
    detail: str


@functools.cache
def retain_freed_memory() -> MallocTuning:
    """Set glibc's mmap and trim thresholds once for this process (see the module's text)."""
    try:
        libc = ctypes.CDLL(None)
        version = libc.gnu_get_libc_version
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return MallocTuning(MallocState.UNAVAILABLE, "the C library is not glibc")
    version.restype = ctypes.c_char_p
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    for param, value in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                         (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        if mallopt(param, value) != 1:
            return MallocTuning(MallocState.UNAVAILABLE,
                                f"mallopt({param}, {value}) refused by glibc "
                                f"{version().decode()}")
    return MallocTuning(MallocState.RETAINED,
                        f"glibc {version().decode()}: mmap threshold {MMAP_THRESHOLD >> 20} "
                        f"MiB, trim threshold {TRIM_THRESHOLD >> 20} MiB")
