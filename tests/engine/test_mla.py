"""Multi-head latent attention: the KV layout value, the two exact attention forms, FP8 latent
rows, host/SSD tiers and tensor parallelism (parity with HF is in test_moe_parity.py)."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.attention import mla
from pdserve.engine.attention.mla import MLAHeads, mla_attend, write_latent
from pdserve.engine.kv_layout import KVKind, KVLayout
from pdserve.engine.model_runner import build_inputs
from pdserve.engine.quant.kv_format import KVCacheFormat
from pdserve.engine.scheduler import ScheduledChunk
from tests.engine.test_tiered_cache import FixedSpeeds
from tests.helpers.checkpoints import VOCAB
from tests.helpers.engine import assert_idle, random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
F32 = KVCacheFormat(torch.float32)
FP8 = KVCacheFormat(torch.float32, fp8=True)


# -- the layout value ----------------------------------------------------------------------
def test_gqa_and_mla_layouts_give_shapes_bytes_and_routes():
    gqa = KVLayout.gqa(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, fmt=F32)
    lat = KVLayout.mla(num_layers=2, kv_lora_rank=32, rope_dim=8, block_size=16, fmt=F32)
    assert gqa.cache_shape(10) == (10, 2, 2, 16, 16)
    assert gqa.cache_shape(10, tp_size=2) == (10, 2, 1, 16, 16)
    assert lat.cache_shape(10) == lat.cache_shape(10, tp_size=4) == (10, 1, 1, 16, 40)
    assert gqa.bytes_per_token() == 2 * 2 * 2 * 16 * 4 and lat.bytes_per_token() == 2 * 40 * 4
    assert lat.block_bytes() == 2 * 16 * 40 * 4 == lat.block_bytes(tp_size=2)  # replicated
    assert gqa.block_bytes(tp_size=2) == gqa.block_bytes() // 2
    # FP8: the latent and the rope key each carry their own float32 scale.
    assert KVLayout.mla(2, 32, 8, 16, FP8).cache_shape(3) == (3, 1, 1, 16, 48)
    # A prompt of 20 tokens moves 2 whole blocks; an MLA row once per receiving rank.
    assert lat.transfer_bytes(20) == 32 * lat.bytes_per_token()
    assert lat.transfer_bytes(20, receiver_tp=2) == 2 * lat.transfer_bytes(20)
    assert gqa.transfer_bytes(20, receiver_tp=2) == gqa.transfer_bytes(20)  # heads split
    d1 = [("d0", 0, 1)]
    assert lat.head_routes(0, 2, d1) == [("d0", 0, 1)] and lat.head_routes(1, 2, d1) == []
    d2 = [("d0", 0, 2), ("d1", 1, 2)]
    assert lat.head_routes(0, 1, d2) == [("d0", 0, 1), ("d1", 0, 1)]
    assert gqa.head_routes(0, 1, d2) == [("d0", 0, 1), ("d1", 1, 2)]
    assert gqa.hash_key() == str(F32)  # existing GQA block hashes are unchanged
    assert lat.hash_key() != gqa.hash_key() and lat.kind is KVKind.MLA


def test_the_engine_sizes_and_hashes_by_the_layout(tiny_deepseek_v2, tiny_llama):
    mla_llm = LLM(str(tiny_deepseek_v2), dtype="float32", kv_cache_memory_gb=2**20 / 2**30)
    layout = mla_llm.engine.kv_layout
    assert layout.kind is KVKind.MLA and layout.head_dim == 40 and layout.latent_dim == 32
    assert mla_llm.engine.pool.num_blocks == 2**20 // layout.block_bytes()
    assert all(tuple(c.shape) == layout.cache_shape(mla_llm.engine.pool.num_blocks)
               for c in mla_llm.engine.kv_caches)
    gqa = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=8).engine.kv_layout
    # Same width (hidden 64, 2 layers): a 40-element latent row against K and V of two
    # 16-wide heads (64 elements).
    assert gqa.bytes_per_token() / layout.bytes_per_token() == pytest.approx(1.6)


# -- the two forms ---------------------------------------------------------------------------
def _random_heads(g, h=4, dn=16, dv=8, r=24):
    return MLAHeads(torch.randn(h * (dn + dv), r, generator=g) * 0.3, h, dn, dv)


def _reference(q_nope, q_rope, rows, heads: MLAHeads, scale, ctx):
    """Plain multi-head attention over fully expanded keys and values, per request."""
    r = heads.kv_b.shape[1]
    kv = (rows[:, :r] @ heads.kv_b.T).view(ctx, heads.num_heads, -1)
    k = torch.cat([kv[..., :heads.nope_dim],
                   rows[:, None, r:].expand(ctx, heads.num_heads, -1)], dim=-1)
    q = torch.cat([q_nope, q_rope], dim=-1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    n = q.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, kv[..., heads.nope_dim:])


@pytest.mark.parametrize("absorb_max", [0, 1, 16, 10**6], ids=["expanded", "decode-only",
                                                               "default", "absorbed"])
def test_absorbed_and_expanded_forms_equal_plain_attention(monkeypatch, absorb_max):
    """Decode rows, a short verification query and a long prefill chunk after cached
    context, in one batch; every way of splitting them between the forms is exact."""
    monkeypatch.setattr(mla, "ABSORB_MAX_QUERY", absorb_max)
    g = torch.Generator().manual_seed(3)
    heads, bs, r, dr = _random_heads(g), 4, 24, 8
    first = [ScheduledChunk("a", [1] * 7, 0, [0, 1], 1), ScheduledChunk("b", [1] * 5, 0, [2, 3], 1),
             ScheduledChunk("c", [1] * 6, 0, [4, 5, 6, 7, 8], 1)]
    step = [ScheduledChunk("a", [1], 7, [0, 1], 1), ScheduledChunk("b", [1] * 3, 5, [2, 3], 3),
            ScheduledChunk("c", [1] * 13, 6, [4, 5, 6, 7, 8], 1)]
    cache = torch.zeros(9, 1, 1, bs, r + dr)
    rows1, rows2 = torch.randn(18, r + dr, generator=g), torch.randn(17, r + dr, generator=g)
    write_latent(cache, rows1[:, :r], rows1[:, r:],
                 build_inputs(first, bs, torch.device("cpu")).meta)
    meta = build_inputs(step, bs, torch.device("cpu")).meta
    write_latent(cache, rows2[:, :r], rows2[:, r:], meta)
    q_nope, q_rope = torch.randn(17, 4, 16, generator=g), torch.randn(17, 4, dr, generator=g)
    got = mla_attend(q_nope, q_rope, cache, meta, heads, 0.3)
    contexts = {"a": torch.cat([rows1[:7], rows2[:1]]), "b": torch.cat([rows1[7:12], rows2[1:4]]),
                "c": torch.cat([rows1[12:], rows2[4:]])}
    for i, c in enumerate(step):
        s, e = meta.query_start[i], meta.query_start[i + 1]
        want = _reference(q_nope[s:e], q_rope[s:e], contexts[c.request_id], heads, 0.3,
                          meta.seq_lens[i])
        torch.testing.assert_close(got[s:e], want, rtol=1e-4, atol=1e-5)


# -- FP8 rows, tiers -------------------------------------------------------------------------
def test_fp8_latent_rows_keep_attention_within_the_rounding_bound():
    """Both forms read the FP8 rows (each part with its own scale; the rope key is not
    normalised and may be far larger than the latent)."""
    g = torch.Generator().manual_seed(4)
    heads, bs, r, dr = _random_heads(g), 4, 24, 8
    chunks = [ScheduledChunk("a", [1] * 9, 0, [0, 1, 2], 1),
              ScheduledChunk("b", [1] * 30, 0, [3, 4, 5, 6, 7, 8, 9, 10], 1)]
    meta = build_inputs(chunks, bs, torch.device("cpu")).meta
    latent, rope = torch.randn(39, r, generator=g), 20 * torch.randn(39, dr, generator=g)
    q_nope, q_rope = torch.randn(39, 4, 16, generator=g), torch.randn(39, 4, dr, generator=g)
    outs = []
    for fmt in (F32, FP8):
        layout = KVLayout.mla(1, r, dr, bs, fmt)
        (cache,) = layout.new_caches(11, 1, torch.device("cpu"))
        write_latent(cache, latent, rope, meta)
        outs.append(mla_attend(q_nope, q_rope * 0.05, cache, meta, heads, 0.2))
    rel = (outs[1] - outs[0]).norm() / outs[0].norm()
    assert rel < 2 ** -4, rel


def test_fp8_latent_cache_serves_requests(tiny_deepseek_v3):
    ref = LLM(str(tiny_deepseek_v3), dtype="float32", num_gpu_blocks=32)
    fp8 = LLM(str(tiny_deepseek_v3), dtype="float32", num_gpu_blocks=32, kv_cache_dtype="fp8")
    assert all(c.dtype == torch.uint8 and c.shape[-1] == 48 for c in fp8.engine.kv_caches)
    assert fp8.engine.hash_extra != ref.engine.hash_extra
    p = random_prompts([70], VOCAB, seed=4)[0]
    want, got = ref.engine.prompt_logits(p), fp8.engine.prompt_logits(p)
    # A whole MoE model: rounding can flip an expert choice, so only the mean is bounded.
    rel = (got - want).norm(dim=-1) / (want - want.mean(-1, keepdim=True)).norm(dim=-1)
    assert rel.mean() < 0.1, rel
    out = fp8.generate(random_prompts([30], VOCAB, seed=5), GREEDY)
    assert len(out[0].token_ids) == GREEDY.max_tokens
    assert_idle(fp8)


def test_latent_blocks_go_through_host_and_ssd_and_back(tiny_deepseek_v2, tmp_path):
    prompts = random_prompts([22, 23, 21], VOCAB, seed=7)
    ref = LLM(str(tiny_deepseek_v2), dtype="float32", block_size=4, num_gpu_blocks=64)
    want = [ref.generate([p], GREEDY)[0].token_ids for p in prompts]
    layout = ref.engine.kv_layout
    llm = LLM(str(tiny_deepseek_v2), dtype="float32", block_size=4, num_gpu_blocks=10,
              max_num_batched_tokens=64, kv_host_gb=3 * layout.block_bytes() / 2**30,
              kv_ssd_dir=str(tmp_path / "ssd"), kv_ssd_gb=64 * 2 * layout.block_bytes() / 2**30)
    tiers = llm.engine.tiers
    assert tiers.block_bytes == layout.block_bytes()
    tiers.bandwidth = FixedSpeeds(1e12, 1e12, 1.0)  # loading always beats recomputing
    got = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    tiers.flush()
    got.append(llm.generate([prompts[0]], GREEDY)[0].token_ids)
    assert got == want + [want[0]]
    stats = llm.engine.stats()
    assert stats["kv_tier_ssd_hits"] > 0 and stats["kv_tier_ssd_bytes_out"] == (
        stats["kv_tier_ssd_hits"] * layout.block_bytes())
    assert_idle(llm)


# -- tensor parallelism ----------------------------------------------------------------------
@pytest.mark.timeout(300)
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp", "ep"])
def test_tp2_equals_tp1(tiny_deepseek_v3, expert_parallel):
    path = str(tiny_deepseek_v3)
    prompts = random_prompts([4, 23, 61], VOCAB, seed=31)
    ref = LLM(path, dtype="float32")
    expected = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    ref_logits = ref.engine.prompt_logits(prompts[2])
    with LLM(path, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=24,
             enable_expert_parallel=expert_parallel) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        logits = llm.engine.prompt_logits(prompts[2])
        attn = llm.engine.runner.model.layers[0].self_attn
        assert attn.num_heads == 2  # heads split; the latent is whole on every rank
        assert llm.engine.kv_caches[0].shape[1:] == ref.engine.kv_caches[0].shape[1:]
        assert_idle(llm)
    assert got == expected
    assert (logits - ref_logits).abs().max().item() < 1e-4


# -- the CPU kernel backend and the weight schemes --------------------------------------------
def test_mla_under_the_cpu_kernel_backend_equals_the_torch_path(tiny_deepseek_v2):
    """The C++ paged kernel reads GQA blocks only: MLA layers keep their own torch path
    whatever backend the engine picked ("auto" is "cpu" wherever the kernel builds)."""
    prompts = random_prompts([5, 37], VOCAB, seed=12)
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(str(tiny_deepseek_v2), dtype="float32", num_gpu_blocks=32,
                  attention_backend=backend)
        assert llm.engine.runner.backend.name == backend
        outs[backend] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert outs["cpu"] == outs["torch"]


@pytest.fixture(scope="module")
def dense_mla(tmp_path_factory):
    """Every layer dense (MLA's projections alone; int4 MoE experts are
    tests/engine/test_moe_int4.py's) and a q bottleneck 4-bit groups divide."""
    from tests.helpers.checkpoints import save_tiny

    return save_tiny(tmp_path_factory.mktemp("dense_mla"), "deepseek_v3", seed=9,
                     initializer_range=0.2, first_k_dense_replace=2, q_lora_rank=32)


def test_int4_weights_on_mla_equal_their_dequantised_dense_model(dense_mla):
    """W4A16 runs every MLA projection but kv_b_proj (read as a matrix by the absorbed form,
    so it stays dense): the logits equal those of the dense model holding the dequantised
    weights, up to the kernel's bf16 activations."""
    from pdserve.engine.quant.int4 import Int4LinearMethod

    q = LLM(str(dense_mla), dtype="float32", num_gpu_blocks=32, quantization="int4")
    dense = LLM(str(dense_mla), dtype="float32", num_gpu_blocks=32)
    attn = q.engine.runner.model.layers[0].self_attn
    assert isinstance(attn.kv_a_proj_with_mqa.method, Int4LinearMethod)
    assert not isinstance(attn.kv_b_proj.method, Int4LinearMethod)
    modules = dict(dense.engine.runner.model.named_modules())
    swapped = 0
    for name, module in q.engine.runner.model.named_modules():
        if isinstance(getattr(module, "method", None), Int4LinearMethod) and "lm_head" not in name:
            modules[name].weight.data.copy_(module.method.dequantize())
            swapped += 1
    assert swapped == 2 * 6  # q_a, q_b, kv_a, o, gate_up, down in each layer
    prompt = random_prompts([40], VOCAB, seed=6)[0]
    want, got = dense.engine.prompt_logits(prompt), q.engine.prompt_logits(prompt)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < 0.02
    assert len(q.generate([prompt], GREEDY)[0].token_ids) == GREEDY.max_tokens
    assert_idle(q)


def test_forked_choices_copy_latent_blocks(tiny_deepseek_v2):
    """n > 1 on an MLA model: the choices share the prompt's latent blocks and copy the
    partial last one; each equals a separate request with its seed."""
    from pdserve.engine.sampler import choice_seed
    from tests.engine.test_fork import run

    llm = LLM(str(tiny_deepseek_v2), dtype="float32", num_gpu_blocks=64)
    prompt = random_prompts([37], VOCAB, seed=14)[0]
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    choices, computed = run(llm, prompt, params, 3, seed=21)
    alone = [llm.generate([prompt], SamplingParams(max_tokens=6, temperature=1.0,
                                                   ignore_eos=True, seed=choice_seed(21, j)))
             [0].token_ids for j in range(3)]
    assert choices == alone and computed == 37 + 2
    assert_idle(llm)
