"""Where the Triton kernels can run, and the small launch-shape helpers they share.

A `@triton.jit` function is built for the GPU, or, when `TRITON_INTERPRET=1` is set before the
kernel module is imported, as a Python function that runs on the CPU (slow; for tests). Which of
the two a kernel is was fixed at import time, so `check_tensors` asks the kernel object itself
rather than reading the environment again.
"""

from __future__ import annotations

import torch
import triton
from triton.runtime import JITFunction


def is_interpreted(kernel: object) -> bool:
    """True when `kernel` was built by Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(kernel, JITFunction)


def check_tensors(kernel: object, **tensors: torch.Tensor) -> None:
    """Raise a clear error if `kernel` cannot read these tensors (named for the message)."""
    devices = {t.device for t in tensors.values()}
    if len(devices) != 1:
        where = ", ".join(f"{n}={t.device}" for n, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {where}")
    if is_interpreted(kernel):
        return
    device = devices.pop()
    if device.type != "cuda":
        raise RuntimeError(
            f"Triton kernels need CUDA tensors (got {device}); on a CPU set TRITON_INTERPRET=1 "
            "before pdserve.kernels is imported, or use the torch attention backend")


def pow2(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor): Triton block shapes must be powers of two."""
    return max(floor, triton.next_power_of_2(max(1, int(n))))


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (1 elsewhere: the interpreter runs programs serially)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count
