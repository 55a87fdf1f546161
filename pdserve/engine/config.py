"""Engine configuration: one frozen dataclass, a docstring per field."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.host_malloc import HOST_MALLOC_MODES

LM_HEAD_DTYPES = ("auto", "model", "bf16", "int8", "int4")
"""The LM head's precisions (`EngineConfig.lm_head_dtype`; `quant.lm_head` says what each is)."""
INT4_KERNELS = ("auto", "cpu", "cpu-invariant", "cpu-torch", "triton", "reference")
"""W4A16 matmul backends (`EngineConfig.int4_kernel`; `quant.int4_kernels` says what each is)."""

@dataclass(frozen=True)
class EngineConfig:
    model: str
    """The checkpoint: a Hugging Face directory (config.json + safetensors + tokenizer), a .gguf
    file, or a directory holding one .gguf (see pdserve/engine/checkpoint)."""
    dtype: str = "auto"
    """Weights/activations dtype: auto (the checkpoint's), float32, bfloat16, float16."""
    device: str = "auto"
    """cpu, cuda, cuda:N, or auto (cuda when available)."""
    block_size: int = 16
    """Tokens per KV block."""
    num_gpu_blocks: int | None = None
    """KV blocks to allocate; None sizes the cache from `kv_cache_memory_gb` (or free memory)."""
    kv_cache_memory_gb: float | None = None
    """KV cache budget when num_gpu_blocks is None (default on CPU: $PDSERVE_CPU_KV_CACHE_GB,
    else 1 GiB; on GPU 80% of free memory)."""
    kv_cache_prefault: bool = False
    """CPU: map every page of the KV cache at start, not as requests first write into it. A
    worker then starts later and holds the whole cache from the start, but its first
    requests pay no page faults (1-6 ms per 2 MiB page measured on a VM: docs/perf.md)."""
    max_num_batched_tokens: int = 1024
    """Token budget per step; also the chunk size of chunked prefill."""
    max_num_seqs: int = 128
    """Most requests in the running batch."""
    max_model_len: int | None = None
    """Longest sequence; default min(max_position_embeddings, 32768)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prefixes across requests."""
    attention_backend: str = "auto"
    """torch (reference), cpu (C++ paged attention reading blocks in place), triton, or auto
    (triton on CUDA; on the CPU the C++ kernels when they build, else torch)."""
    compile_decode: str = "off"
    """How decode-only steps run: off (eager), inductor (torch.compile, CPU or GPU: the first
    decode step compiles), cuda_graphs (CUDA: graphs captured for a ladder of batch sizes).
    Needs a traceable attention backend (cpu, triton); others run eager."""
    tensor_parallel_size: int = 1
    """Ranks that shard each layer (see pdserve.engine.tp for the multi-process driver)."""
    enable_expert_parallel: bool = False
    """MoE models: each TP rank holds whole experts (E / TP of them) instead of a slice of
    every expert (needs the expert count to divide by the TP degree)."""
    seed: int = 0
    """Seed of the engine's own RNG, which draws per-request seeds for unseeded requests."""
    quantization: str | None = None
    """None (the checkpoint as stored), "fp8" (E4M3 weights with per-channel scales, dynamic
    per-token activations), "int4" (W4A16: 4-bit group-quantised weights) or "none" (dense
    weights: a GGUF's 4-bit blocks dequantised to the model's dtype). A quantised checkpoint
    (GPTQ, AWQ, FP8: quantization_config in config.json) runs its own scheme either way, and
    a GGUF whose linear weights are all 4-bit blocks (Q4_0 / Q4_1 / Q4_K) runs as int4."""
    fp8_full_precision_layers: tuple[str, ...] | None = None
    """Under quantization="fp8" (at load): fnmatch patterns of the linear layers kept in the
    model's precision, e.g. ("layers.0.*", "*.mlp.down_proj"); () quantises every one; None
    takes the scheme's measured default (`quant.fp8_scheme.DEFAULT_FULL_PRECISION`)."""
    lm_head_dtype: str = "auto"
    """Precision of the LM head's matmul: model (the model's dtype), bf16 (a bf16 copy), int8
    (an 8-bit copy in groups of 32), int4 (a 4-bit copy), or auto (the quantisation scheme's
    default: int8 under int4, "model" without a scheme). A tied embedding keeps its
    full-precision rows for the lookup."""
    int4_kernel: str = "auto"
    """Under int4, the matmul: cpu (pdserve's C++ kernel, fp32 activations), cpu-invariant
    (one of its kernels at every batch size: what `batch_invariant` runs), cpu-torch
    (torch's packed-int4 kernel, bf16 activations: faster from batch ~8, less exact), triton
    (CUDA), reference (dequantise per call), or auto (cpu, else cpu-torch where ours did not
    build; triton on CUDA)."""
    kv_cache_dtype: str = "auto"
    """auto (same as the model) or fp8 (E4M3 with per-block scales)."""
    batch_invariant: bool = False
    """Every token's numbers independent of what else is in the step: the same bits whatever
    the batch, the chunking of a prompt or the order requests came in, so a seeded sampled
    request gives the same tokens alone or under load. Every int4 layer runs one kernel at
    any M (`int4_kernel="cpu-invariant"`) and every query row the C++ paged attention, so it needs
    an int4 model on the CPU with an int8 or int4 LM head (the default model is one; others
    are refused at load, naming the layer), tensor parallelism off, no speculative decoding
    and eager decode steps. Slower: see docs/perf.md."""
    speculative_config: dict[str, Any] | None = field(default=None, hash=False)
    """vLLM-style: {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n}
    or {"model": DRAFT_DIR, "num_speculative_tokens": k}."""
    model_id: str = ""
    """Name under which the model is served and hashed (default: the checkpoint directory's
    name, or a .gguf file's stem)."""
    kv_host_gb: float = 0.0
    """Host-memory KV tier (GiB, pinned on CUDA): blocks evicted from the device cache are
    kept here and loaded back on a prefix hit (0 = off). Needs prefix caching. With TP > 1
    every rank keeps its own head slice of each block (this much memory per rank)."""
    kv_ssd_dir: str | None = None
    """Directory of the SSD KV tier's segment files (deleted and recreated at start); with
    TP > 1 each rank uses its own subdirectory `rank<r>`."""
    kv_ssd_gb: float = 0.0
    """SSD KV tier capacity (GiB; 0 = off): blocks evicted from the host tier (or from the
    device when there is no host tier) land here, checksummed."""
    kv_ssd_persist: bool = False
    """Keep the SSD tier's segments when the engine closes and rebuild the tier from them at
    start (a restart with the same `kv_ssd_dir` keeps its cache); off: start empty."""
    kv_demote_ahead_blocks: int = 32
    """How many of the next cached-free device blocks in eviction order are copied to the host
    tier ahead of time, between steps, so evicting them later costs no copy (0 = off; capped
    at a quarter of the host tier)."""
    host_malloc: str = "retain"
    """On the CPU, how the process's glibc malloc keeps freed activation memory: retain (fixed
    mmap and trim thresholds, so a step's large activations reuse mapped pages instead of
    page-faulting fresh ones every layer; process-wide, `engine.host_malloc`) or system
    (glibc's defaults, untouched)."""

    def __post_init__(self) -> None:
        _positive(self, "block_size", "max_num_batched_tokens", "max_num_seqs",
                  "tensor_parallel_size")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {self.num_gpu_blocks}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.quantization not in (None, "none", "fp8", "int4"):
            raise ValueError(f"quantization must be None, 'none', 'fp8' or 'int4', got "
                             f"{self.quantization!r}")
        _check_fp8_layers(self)
        if self.int4_kernel not in INT4_KERNELS:
            raise ValueError(f"int4_kernel must be one of {', '.join(INT4_KERNELS)}, got "
                             f"{self.int4_kernel!r}")
        if self.lm_head_dtype not in LM_HEAD_DTYPES:
            raise ValueError(f"lm_head_dtype must be one of {', '.join(LM_HEAD_DTYPES)}, got "
                             f"{self.lm_head_dtype!r}")
        _check_tiers(self)
        if self.compile_decode not in ("off", "inductor", "cuda_graphs"):
            raise ValueError("compile_decode must be 'off', 'inductor' or 'cuda_graphs', got "
                             f"{self.compile_decode!r}")
        if self.batch_invariant:
            _check_batch_invariant(self)
        if self.host_malloc not in HOST_MALLOC_MODES:
            raise ValueError(f"host_malloc must be one of {', '.join(HOST_MALLOC_MODES)}, got "
                             f"{self.host_malloc!r}")
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got "
                             f"{self.kv_cache_dtype!r}")


def _positive(cfg: EngineConfig, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_fp8_layers(cfg: EngineConfig) -> None:
    layers = cfg.fp8_full_precision_layers
    if layers is None:
        return
    if isinstance(layers, str) or not all(isinstance(p, str) and p for p in layers):
        raise ValueError("fp8_full_precision_layers must be a sequence of non-empty layer-name "
                         f"patterns, got {layers!r}")
    if cfg.quantization != "fp8":
        raise ValueError("fp8_full_precision_layers needs quantization='fp8'")
    object.__setattr__(cfg, "fp8_full_precision_layers", tuple(layers))  # JSON gives a list


def _check_tiers(cfg: EngineConfig) -> None:
    for name in ("kv_host_gb", "kv_ssd_gb"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    if (cfg.kv_ssd_gb > 0) != (cfg.kv_ssd_dir is not None):
        raise ValueError("kv_ssd_dir and kv_ssd_gb must be set together "
                         f"(got kv_ssd_dir={cfg.kv_ssd_dir!r}, kv_ssd_gb={cfg.kv_ssd_gb})")
    ahead = cfg.kv_demote_ahead_blocks
    if isinstance(ahead, bool) or not isinstance(ahead, int) or ahead < 0:
        raise ValueError(f"kv_demote_ahead_blocks must be an integer >= 0, got {ahead!r}")
    if cfg.kv_host_gb > 0 or cfg.kv_ssd_gb > 0:
        # TP > 1 is fine: every rank keeps its own tiers for its head slice, rank 0 decides.
        if not cfg.enable_prefix_caching:
            raise ValueError("kv_host_gb / kv_ssd_gb (KV tiers) require enable_prefix_caching")


CPU_KV_CACHE_ENV = "PDSERVE_CPU_KV_CACHE_GB"
"""The CPU KV cache budget (GiB) of an engine that names none, like vLLM's
VLLM_CPU_KVCACHE_SPACE: one setting for every process of a host (a test session, a small
machine running many workers)."""


def cpu_kv_cache_gb() -> float:
    """The default CPU KV cache budget in GiB: $PDSERVE_CPU_KV_CACHE_GB, else 1."""
    raw = os.environ.get(CPU_KV_CACHE_ENV, "").strip()
    if not raw:
        return 1.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"${CPU_KV_CACHE_ENV} must be a number of GiB, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"${CPU_KV_CACHE_ENV} must be positive, got {raw!r}")
    return value


def _check_batch_invariant(c: EngineConfig) -> None:
    """What `batch_invariant` cannot be combined with, refused before anything loads."""
    clashes = {
        "int4_kernel": c.int4_kernel not in ("auto", "cpu-invariant"),
        "quantization": c.quantization not in (None, "int4"),
        "attention_backend": c.attention_backend not in ("auto", "cpu"),
        "lm_head_dtype": c.lm_head_dtype not in ("auto", "int8", "int4"),
        "tensor_parallel_size": c.tensor_parallel_size != 1,
        "speculative_config": c.speculative_config is not None,
        "compile_decode": c.compile_decode != "off",
        "kv_cache_dtype": c.kv_cache_dtype != "auto",
        "device": c.device not in ("auto", "cpu"),
    }
    bad = [name for name, clash in clashes.items() if clash]
    if bad:
        raise ValueError(f"batch_invariant=True runs int4 layers through one CPU kernel and "
                         f"every query row through the C++ paged attention; it cannot take "
                         f"{', '.join(f'{b}={getattr(c, b)!r}' for b in bad)}")
