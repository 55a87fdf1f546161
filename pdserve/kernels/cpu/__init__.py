"""C++ CPU kernels built through torch's extension loader on first use, cached on disk.

    ops = load_ops()   # torch.ops.pdserve_cpu, or None when they cannot be built here
    ops.paged_attention(out, q, cache, block_tables, seq_lens, query_start, seqs, scale, window)
    ops.write_kv(cache, k, v, slot_mapping)

The sources (`paged_attention.cpp`) are compiled by `torch.utils.cpp_extension.load` with gcc
(-O3, OpenMP through torch's own pool, AVX2/FMA where the CPU has them) into torch's extension
cache (`$TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions); later processes load the
cached library in milliseconds. A failed build (no compiler, no ninja) is reported once as a
warning and `load_ops()` returns None: callers fall back to the torch reference.

    python -m pdserve.kernels.cpu      # build now (an image's install step), print where
"""

from __future__ import annotations

import functools
import hashlib
import os
import warnings
from pathlib import Path

import torch

SOURCES = (Path(__file__).with_name("paged_attention.cpp"),)
DISABLE_ENV = "PDSERVE_CPU_KERNELS"
"""Set to 0 to never build or load these kernels (the torch reference is used)."""


def _isa_flags() -> tuple[str, list[str]]:
    """(name suffix, compiler flags) for the vector ISA torch detected on this CPU. The suffix
    keeps builds for different ISAs apart in a shared cache."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "generic", []


def _build_spec() -> tuple[str, list[str]]:
    """(extension name, compiler flags). The name carries a hash of the sources and flags, so
    a cached library of that name is this exact build and is loaded without asking ninja."""
    isa, flags = _isa_flags()
    flags = ["-O3", "-fopenmp", *flags]
    digest = hashlib.sha256(" ".join(flags).encode())
    for src in SOURCES:
        digest.update(src.read_bytes())
    return f"pdserve_cpu_{isa}_{digest.hexdigest()[:12]}", flags


@functools.lru_cache(maxsize=1)
def load_ops():
    """torch.ops.pdserve_cpu with its kernels registered, or None (warned once)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    name, flags = _build_spec()
    if not build(name, flags, SOURCES):
        return None
    _register_fakes()
    return torch.ops.pdserve_cpu


def _register_fakes() -> None:
    """Shape functions for torch.compile: both ops only write into their first argument."""
    def paged_attention(out, q, cache, block_tables, seq_lens, query_start, seqs, scale,
                        window):
        return None

    def write_kv(cache, k, v, slot_mapping):
        return None

    torch.library.register_fake("pdserve_cpu::paged_attention", paged_attention)
    torch.library.register_fake("pdserve_cpu::write_kv", write_kv)


def build(name: str, flags: list[str], sources: tuple[Path, ...]) -> bool:
    """Load the cached library `name`, building it from `sources` first if needed; False
    (with a warning) if that fails."""
    from torch.utils import cpp_extension

    _put_ninja_on_path()
    try:
        built = Path(cpp_extension._get_build_directory(name, verbose=False)) / f"{name}.so"
        if built.is_file():
            torch.ops.load_library(str(built))
        else:
            cpp_extension.load(name=name, sources=[str(s) for s in sources],
                               extra_cflags=flags, extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: the reference runs
        warnings.warn(f"pdserve CPU attention kernels could not be built ({exc!s:.300}); "
                      "using the torch reference attention", RuntimeWarning, stacklevel=3)
        return False
    return True


def _put_ninja_on_path() -> None:
    """torch's loader runs `ninja` from PATH; the one pip installed (the `ninja` dependency)
    sits in the venv's bin, which is not on PATH when the venv is not activated."""
    import shutil

    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def main() -> None:
    ops = load_ops()
    if ops is None:
        raise SystemExit("pdserve CPU kernels: build failed (see the warning above)")
    from torch.utils.cpp_extension import _get_build_directory

    print(_get_build_directory(_build_spec()[0], verbose=False))


if __name__ == "__main__":
    main()
