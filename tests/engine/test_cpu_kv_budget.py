"""The default CPU KV cache budget: $PDSERVE_CPU_KV_CACHE_GB (like vLLM's
VLLM_CPU_KVCACHE_SPACE), 1 GiB without it; an explicit budget always wins."""

from __future__ import annotations

import pytest

from pdserve.engine import LLM
from pdserve.engine.config import CPU_KV_CACHE_ENV, cpu_kv_cache_gb


def test_the_environment_sets_the_default_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv(CPU_KV_CACHE_ENV, raising=False)
    assert cpu_kv_cache_gb() == 1.0
    monkeypatch.setenv(CPU_KV_CACHE_ENV, "0.5")
    assert cpu_kv_cache_gb() == 0.5
    for bad in ("lots", "0", "-1"):
        monkeypatch.setenv(CPU_KV_CACHE_ENV, bad)
        with pytest.raises(ValueError, match=CPU_KV_CACHE_ENV):
            cpu_kv_cache_gb()


def test_an_engine_without_a_budget_sizes_its_cache_from_it(monkeypatch, tiny_llama):
    monkeypatch.setenv(CPU_KV_CACHE_ENV, "0.01")
    small = LLM(str(tiny_llama), dtype="float32").engine
    per_block = small.kv_layout.block_bytes(1)
    assert small.pool.num_blocks == int(0.01 * 2**30 // per_block)
    explicit = LLM(str(tiny_llama), dtype="float32", kv_cache_memory_gb=0.02).engine
    assert explicit.pool.num_blocks == int(0.02 * 2**30 // per_block)
