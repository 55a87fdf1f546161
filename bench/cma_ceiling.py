"""What one kernel copy between two processes moves per second on this host: the ceiling of a
same-host NIXL transfer, beside the memory copy the transfer bench divides by.

NIXL's UCX backend moves bytes between two processes on one host with CMA
(`process_vm_writev` / `process_vm_readv`: the kernel pins the pages of one side and copies,
in the calling thread). A user-space memcpy is the figure the issue sets its target against;
on a VM the kernel's copy can be well below it (measured: ~0.5 of a 2-thread memcpy on the
2-core EPYC Zen 4 from 4 KiB pages), so the transfer's ratio reads against both. The child's
buffer is on huge pages, as a sender's staging pool is: CMA's pace follows the other
process's pages.

`CmaCopy(nbytes, chunk)` starts a child process holding `nbytes` of touched memory; `measure()`
reads them into this process's buffer in `chunk`-byte calls (a KV layer's size) and returns
the best bytes/s of `repeats`, or None where the kernel refuses (no CMA, or ptrace limits).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time

import torch

_CHILD = """
import ctypes, mmap, sys
n, huge = int(sys.argv[1]), 2 << 20
# private and on huge pages, as a staging pool is: a shared mapping is shmem (4 KiB pages
# here), which CMA reads at ~0.35 of a memcpy against ~0.8 from 2 MiB pages
buf = mmap.mmap(-1, n + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
if hasattr(mmap, "MADV_HUGEPAGE"):
    buf.madvise(mmap.MADV_HUGEPAGE)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
addr += -addr % huge
ctypes.memset(addr, 1, n)  # touched, as a worker's payloads are
print(addr, flush=True)
sys.stdin.read()  # until the parent closes the pipe
"""


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class CmaCopy:
    """A child process's buffer, read with `process_vm_readv`; `close()` ends the child."""

    def __init__(self, nbytes: int, chunk: int) -> None:
        self.nbytes, self.chunk = nbytes, chunk
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._child = subprocess.Popen([sys.executable, "-c", _CHILD, str(nbytes)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = self._child.stdout.readline()
        self._remote = int(line) if line.strip().isdigit() else None  # None: the child failed
        self._local = torch.ones(nbytes, dtype=torch.uint8)  # faulted in, like a used cache

    def measure(self, repeats: int = 3) -> float | None:
        if self._remote is None or not hasattr(self._libc, "process_vm_readv"):
            return None  # no child buffer, or not Linux
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for at in range(0, self.nbytes, self.chunk):
                n = min(self.chunk, self.nbytes - at)
                local = _IoVec(self._local.data_ptr() + at, n)
                remote = _IoVec(self._remote + at, n)
                got = self._libc.process_vm_readv(self._child.pid, ctypes.byref(local), 1,
                                                  ctypes.byref(remote), 1, 0)
                if got != n:
                    print(f"CMA read refused: {os.strerror(ctypes.get_errno())}",
                          file=sys.stderr)
                    return None
            best = min(best, time.perf_counter() - t0)
        return self.nbytes / best

    def close(self) -> None:
        self._child.stdin.close()
        try:
            self._child.wait(10)
        except subprocess.TimeoutExpired:
            self._child.kill()
