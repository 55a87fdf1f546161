"""FP8 KV cache: packed rows (E4M3 values + float32 scale), the cache layout, and accuracy.

Tolerances: each K/V element is rounded to 3 mantissa bits, at most 2^-4 of its value
(half an ULP; values far below the row's amax fall in E4M3's subnormals, spaced 2^-9 of the
scale). Attention averages those errors over the context, so its output stays within 2^-4
relative rms; the logits see that error only through o_proj and the residual stream. On the tiny
checkpoint the logits' relative rms error measures ~0.5% (2% at worst) and the largest
single-logit error ~0.07 standard deviations of the logits: we assert 5% and 0.25.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention.torch_ref import TorchAttention
from pdserve.engine.model_runner import build_inputs
from pdserve.engine.quant.fp8 import FP8_MAX
from pdserve.engine.quant.kv_format import KVCacheFormat
from pdserve.engine.quant.kv_fp8 import SCALE_BYTES, pack_fp8, packed_dim, unpack_fp8
from pdserve.engine.scheduler import ScheduledChunk
from tests.helpers.checkpoints import VOCAB
from tests.helpers.engine import assert_idle, random_prompts


@pytest.fixture(scope="module")
def fp8_kv(tiny_llama):
    return LLM(str(tiny_llama), num_gpu_blocks=64, kv_cache_dtype="fp8",
               max_num_batched_tokens=32)


# -- packing -------------------------------------------------------------------------------
def test_pack_unpack_round_trip_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=g) * torch.logspace(-3, 3, 7).view(7, 1, 1)
    x[2, 1] = 0.0
    packed = pack_fp8(x)
    assert packed.dtype == torch.uint8 and packed.shape == (7, 3, 64 + SCALE_BYTES)
    scale = packed[..., 64:].contiguous().view(torch.float32)
    torch.testing.assert_close(scale[..., 0], (x.abs().amax(-1) / FP8_MAX).clamp(min=1e-12))
    back = unpack_fp8(packed, torch.float32)
    assert back.shape == x.shape
    assert torch.equal(back[2, 1], torch.zeros(64))
    bound = 2 ** -4 * x.abs() + 2 ** -10 * scale  # half an ULP, normal or subnormal
    assert ((back - x).abs() <= bound * 1.0001).all()


def test_values_on_the_e4m3_grid_round_trip_exactly():
    x = torch.tensor([[448.0, -1.0, 0.5, 0.0, -0.015625, 96.0, 3.5, -448.0]])
    back = unpack_fp8(pack_fp8(x), torch.float32)
    assert torch.equal(back, x)  # scale is exactly 1.0: every value is representable
    assert unpack_fp8(pack_fp8(x.bfloat16()), torch.bfloat16).dtype == torch.bfloat16


def test_packed_rows_need_head_dim_aligned_for_the_scale():
    assert packed_dim(128) == 132
    with pytest.raises(ValueError, match="head_dim"):
        packed_dim(62)


# -- layout and hashing --------------------------------------------------------------------
def test_fp8_cache_is_uint8_with_scales_in_each_row(fp8_kv):
    cfg = fp8_kv.engine.model_config
    caches = fp8_kv.engine.runner.caches
    assert len(caches) == cfg.num_layers
    assert all(c.dtype == torch.uint8 for c in caches)
    assert caches[0].shape == (64, 2, cfg.num_kv_heads, 16, cfg.head_dim + SCALE_BYTES)


def test_kv_format_names_differ_and_the_unquantised_name_is_unchanged():
    plain = KVCacheFormat.from_config("auto", torch.float32)
    fp8 = KVCacheFormat.from_config("fp8", torch.float32)
    assert str(plain) == str(torch.float32)  # existing block hashes stay valid
    assert str(fp8) != str(plain)
    assert str(fp8) != str(KVCacheFormat.from_config("fp8", torch.bfloat16))


def test_auto_sizing_counts_the_packed_bytes(tiny_llama):
    budget = 2 ** 20
    fp8 = LLM(str(tiny_llama), kv_cache_dtype="fp8", kv_cache_memory_gb=budget / 2 ** 30)
    plain = LLM(str(tiny_llama), kv_cache_memory_gb=budget / 2 ** 30)
    cfg = fp8.engine.model_config
    per_token_head = {"fp8": cfg.head_dim + SCALE_BYTES, "plain": cfg.head_dim * 4}
    for name, llm in (("fp8", fp8), ("plain", plain)):
        per_block = cfg.num_layers * 2 * cfg.num_kv_heads * 16 * per_token_head[name]
        assert llm.engine.pool.num_blocks == budget // per_block
        cache_bytes = sum(c.numel() * c.element_size() for c in llm.engine.runner.caches)
        assert cache_bytes <= budget


# -- accuracy ------------------------------------------------------------------------------
def test_prompt_logits_stay_close_to_the_full_precision_cache(tiny_llama, fp8_kv):
    ref = LLM(str(tiny_llama), num_gpu_blocks=64)
    for p in random_prompts([9, 64, 100], VOCAB, seed=4):
        want, got = ref.engine.prompt_logits(p), fp8_kv.engine.prompt_logits(p)
        rel = (got - want).norm(dim=-1) / (want - want.mean(-1, keepdim=True)).norm(dim=-1)
        assert rel.max() < 0.05, rel.max()
        assert ((got - want).abs() / want.std(-1, keepdim=True)).max() < 0.25
    assert_idle(fp8_kv)


def test_mixed_decode_and_prefill_attention_matches_the_float_cache():
    """Decode rows (the batched gather) and a chunk after cached context (the per-request
    gather) read the FP8 cache; both must stay within the rounding bound of the fp32 one."""
    g = torch.Generator().manual_seed(5)
    kvh, heads, d, bs = 2, 4, 32, 4
    chunks = [ScheduledChunk("a", [1] * 6, 0, [0, 1], 1),
              ScheduledChunk("b", [1] * 9, 0, [2, 3, 4], 1),
              ScheduledChunk("c", [1] * 5, 0, [5, 6], 1)]
    full = build_inputs(chunks, bs, torch.device("cpu"))
    k, v = (torch.randn(20, kvh, d, generator=g) for _ in range(2))
    # Step 2: one decode token each for a and b, and c's next chunk of 3 after its 5.
    step = build_inputs([ScheduledChunk("a", [1], 6, [0, 1], 1),
                         ScheduledChunk("b", [1], 9, [2, 3, 4], 1),
                         ScheduledChunk("c", [1] * 3, 5, [5, 6], 1)], bs, torch.device("cpu"))
    k2, v2 = (torch.randn(5, kvh, d, generator=g) for _ in range(2))
    q = torch.randn(5, heads, d, generator=g)
    backend, outs = TorchAttention(), []
    for fmt in (KVCacheFormat(torch.float32), KVCacheFormat(torch.float32, fp8=True)):
        cache = torch.zeros(8, 2, kvh, bs, fmt.last_dim(d), dtype=fmt.storage_dtype)
        backend.write_kv(cache, k, v, full.meta)
        backend.write_kv(cache, k2, v2, step.meta)
        outs.append(backend.attend(q, cache, step.meta, d ** -0.5, None))
    rel = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert rel < 2 ** -4, rel


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_generation_runs_end_to_end_and_frees_every_block(tiny_llama, dtype):
    llm = LLM(str(tiny_llama), dtype=dtype, num_gpu_blocks=64, kv_cache_dtype="fp8",
              max_num_batched_tokens=32)  # chunked prefill: later chunks read FP8 context
    prompts = random_prompts([5, 40, 70], VOCAB, seed=6)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in first] == [12, 12, 12]
    assert all(0 <= t < VOCAB for o in first for t in o.token_ids)
    assert_idle(llm)
    again = llm.generate(prompts[2:], params)[0]  # prefix-cache hit on FP8 blocks
    assert again.num_cached_tokens > 0
    assert again.token_ids == first[2].token_ids
    assert_idle(llm)
