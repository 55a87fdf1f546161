"""C++ CPU kernels built through torch's extension loader on first use, cached on disk.

    ops = load_ops()   # torch.ops.pdserve_cpu, or None when they cannot be built here
    ops.paged_attention(out, q, cache, block_tables, seq_lens, query_start, seqs, scale, window)
    ops.write_kv(cache, k, v, slot_mapping)
    quant = load_layer_ops()   # torch.ops.pdserve_layers, or None
    quant.int8_linear(x, w_int8, scale)                   # -> x @ dequant(w)^T, fp32
    quant.int4_linear(x, packed, scale, offset, group)    # -> x @ dequant(w)^T, fp32
    torch.classes.pdserve_layers.FlatDecoder()           # the decode loop's layers in C++

The sources (`paged_attention.cpp`; `int8_linear.cpp`, `int4_linear.cpp`, `layer_ops.cpp` and
`flat_decoder.cpp` as a library of their own, built with AVX-512 where the CPU has it) are
compiled by `torch.utils.cpp_extension.load` with gcc (-O3, OpenMP through torch's own pool,
AVX2/FMA where the CPU has them) into torch's extension cache (`$TORCH_EXTENSIONS_DIR`, default
~/.cache/torch_extensions); later processes load the cached library in milliseconds. A failed
build (no compiler, no ninja) is reported once as a warning and `load_ops()` returns None:
callers fall back to the torch reference.

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
LAYER_SOURCES = (Path(__file__).with_name("int8_linear.cpp"),
                 Path(__file__).with_name("int4_linear.cpp"),
                 Path(__file__).with_name("layer_ops.cpp"),
                 Path(__file__).with_name("flat_decoder.cpp"))
ISAS = ("avx512", "avx2", "generic")
_ISA_FLAGS = {"avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2",
                         "-mfma", "-mf16c"],
              "avx2": ["-mavx2", "-mfma", "-mf16c"],
              "generic": []}
DISABLE_ENV = "PDSERVE_CPU_KERNELS"
"""Set to 0 to never build or load these kernels (the torch reference is used)."""


def _isa_flags() -> tuple[str, list[str]]:
    """(name suffix, compiler flags) for the vector ISA torch detected on this CPU. The suffix
    keeps builds for different ISAs apart in a shared cache."""
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        return "avx2", ["-mavx2", "-mfma", "-mf16c"]
    return "generic", []


def best_isa() -> str:
    """The widest ISA of `ISAS` torch detected on this CPU."""
    cap = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(cap, "generic")


def _build_spec(prefix: str = "pdserve_cpu", sources: tuple[Path, ...] = SOURCES,
                isa_flags: tuple[str, list[str]] | None = None) -> tuple[str, list[str]]:
    """(extension name, compiler flags). The name carries a hash of the sources and flags, so
    a cached library of that name is this exact build and is loaded without asking ninja."""
    isa, flags = isa_flags or _isa_flags()
    flags = ["-O3", "-fopenmp", *flags]
    digest = hashlib.sha256(" ".join(flags).encode())
    # The headers beside the sources (simd.h) are part of the build too.
    for src in (*sources, *sorted(Path(__file__).parent.glob("*.h"))):
        digest.update(src.read_bytes())
    return f"{prefix}_{isa}_{digest.hexdigest()[:12]}", flags


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


def load_layer_ops(isa: str | None = None):
    """torch.ops.pdserve_layers built for `isa` (one of `ISAS`; default: this CPU's widest), or
    None (warned once). Tests name an ISA to check a narrower build on a wider machine; only
    one ISA's library can be loaded into a process (the ops share one name)."""
    return _load_layer_ops(isa or best_isa())


@functools.cache
def _load_layer_ops(isa: str):
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    if isa not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {isa!r}")
    name, flags = _layer_spec(isa)
    if not build(name, flags, LAYER_SOURCES):
        return None
    torch.library.register_fake("pdserve_layers::int8_linear", _int8_linear_fake)
    torch.library.register_fake("pdserve_layers::int4_linear", _int4_linear_fake)
    torch.library.register_fake("pdserve_layers::int4_linear_rowwise", _int4_linear_fake)
    torch.library.register_fake("pdserve_layers::rms_norm", _rms_norm_fake)
    torch.library.register_fake("pdserve_layers::add_rms_norm", _add_rms_norm_fake)
    torch.library.register_fake("pdserve_layers::rotary", _rotary_fake)
    torch.library.register_fake("pdserve_layers::silu_mul", _silu_mul_fake)
    return torch.ops.pdserve_layers


def _layer_spec(isa: str) -> tuple[str, list[str]]:
    # No contraction of a * b + c into one FMA: the int4 kernel dequantises with the fp32
    # loader's two roundings (the FMAs it wants are written as intrinsics).
    return _build_spec("pdserve_layers", LAYER_SOURCES,
                       (isa, [*_ISA_FLAGS[isa], "-ffp-contract=off"]))


def _int8_linear_fake(x, w, scale):
    return x.new_empty((x.shape[0], w.shape[0]))


def _int4_linear_fake(x, packed, scale, offset, group):
    return x.new_empty((x.shape[0], scale.shape[0]))


def _rms_norm_fake(x, weight, eps):
    return torch.empty_like(x)


def _add_rms_norm_fake(x, residual, weight, eps):
    return torch.empty_like(x), torch.empty_like(x)


def _rotary_fake(q, k, cos, sin):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _silu_mul_fake(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


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
        warnings.warn(f"pdserve CPU kernels {name} could not be built ({exc!s:.300}); "
                      "using the torch reference", RuntimeWarning, stacklevel=3)
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
    if load_ops() is None or load_layer_ops() is None:
        raise SystemExit("pdserve CPU kernels: build failed (see the warning above)")
    from torch.utils.cpp_extension import _get_build_directory

    print(_get_build_directory(_build_spec()[0], verbose=False))
    isa = best_isa()
    quant = _layer_spec(isa)[0]
    print(_get_build_directory(quant, verbose=False))


if __name__ == "__main__":
    main()
