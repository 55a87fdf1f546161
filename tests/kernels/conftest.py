"""Kernel tests run the Triton kernels on the CPU through Triton's interpreter.

Triton decides interpreter-or-GPU when a `@triton.jit` function is defined, i.e. when a
pdserve.kernels module is first imported, so the variable must be set before that: here, at
conftest load. (A test module of another directory that imports pdserve.kernels earlier in the
same run would defeat this; the tests then fail with a message saying so.) With CUDA the kernels
are compiled and the tests run on the GPU instead.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    from pdserve.kernels.paged_attention import _prefill_kernel
    from pdserve.kernels.runtime import is_interpreted

    if is_interpreted(_prefill_kernel):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        pytest.fail("pdserve.kernels was imported before TRITON_INTERPRET=1 was set and there "
                    "is no CUDA: set TRITON_INTERPRET=1 in the environment or tests/conftest.py")
    return torch.device("cuda")
