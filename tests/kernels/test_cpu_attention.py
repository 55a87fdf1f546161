"""The C++ CPU paged attention (pdserve.kernels.cpu) against the torch reference, its oracle.

Ragged batches of decode rows, speculative-verify rows and prefill chunks over a shuffled,
garbage-filled cache; GQA group sizes, sliding windows, fp32 / bf16 / fp16. The backend
(`CpuPagedAttention`) must write the cache exactly like the reference and attend within
rounding; a packed FP8 cache runs the reference itself. A source that does not compile falls
back with one warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from pdserve.engine.attention.backend import get_backend, resolve_backend_name
from pdserve.engine.attention.cpu_backend import (
    MAX_KERNEL_PAIRS,
    CpuPagedAttention,
    kernel_segment,
)
from pdserve.engine.attention.torch_ref import TorchAttention
from pdserve.kernels import cpu as cpu_kernels
from tests.kernels.cases import make_case, with_packed_fp8_cache

ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


@pytest.fixture(scope="module")
def backend() -> CpuPagedAttention:
    assert cpu_kernels.load_ops() is not None, "the CPU kernels must build on this machine"
    return CpuPagedAttention()


def _both(backend, case, window):
    out = []
    for b in (backend, TorchAttention()):
        cache = case.cache.clone()
        b.write_kv(cache, case.k, case.v, case.meta)
        meta = b.prepare(case.meta)
        out.append((cache, b.attend(case.q, cache, meta, case.scale, window)))
    return out


@pytest.mark.parametrize("q_lens,ctx_lens,window", [
    ([1, 1, 1], [1, 9, 38], None),       # decode, contexts within and across blocks
    ([1, 4, 1], [30, 12, 7], None),      # a speculative-verify row among decode rows
    ([1, 20, 3], [17, 20, 25], None),    # a short fresh prompt: the kernel's too
    ([1, 520, 3], [17, 520, 25], None),  # a long one (reference path) beside the kernel
    ([1, 3, 1], [40, 19, 6], 5),         # sliding window
])
def test_kernel_attends_like_the_reference(backend, q_lens, ctx_lens, window):
    case = make_case(q_lens, ctx_lens, heads=6, kv_heads=2, seed=sum(ctx_lens))
    (cache_k, out_k), (cache_r, out_r) = _both(backend, case, window)
    assert torch.equal(cache_k, cache_r)
    torch.testing.assert_close(out_k, out_r, atol=ATOL[torch.float32], rtol=0)


def test_short_prompts_go_to_the_kernel_long_ones_to_sdpa(backend):
    # Decode and speculative rows at any context; prompt chunks while query x context stays
    # within MAX_KERNEL_PAIRS (a fresh 512-token prompt), so a step of short prompts runs the
    # C++ decode loop; a long prompt, or a chunk over a long cached context, SDPA.
    assert kernel_segment(1, 100_000) and kernel_segment(16, 100_000)
    assert kernel_segment(512, 512) and not kernel_segment(513, 513)
    assert not kernel_segment(256, 2048)
    assert MAX_KERNEL_PAIRS == 512 * 512
    case = make_case([1, 40, 600, 5], [900, 40, 600, 90], heads=6, kv_heads=2, seed=6)
    plan = backend.prepare(case.meta).backend_plan
    assert plan.kernel_seqs.tolist() == [0, 1, 3] and plan.reference_seqs == (2,)


def test_write_kv_takes_slices_of_a_fused_projection(backend):
    # The decode loop passes v as a view into the qkv projection's output (rows strided, each
    # head row contiguous): written without a copy, it must land exactly as a contiguous one.
    case = make_case([1, 3, 1], [30, 12, 7], heads=6, kv_heads=2, seed=4)
    t, kvh, d = case.k.shape
    fused = torch.cat([torch.randn(t, 5), case.k.reshape(t, -1), case.v.reshape(t, -1)], dim=-1)
    k = fused[:, 5:5 + kvh * d].view(t, kvh, d)
    v = fused[:, 5 + kvh * d:].view(t, kvh, d)
    assert not k.is_contiguous() and not v.is_contiguous()
    strided, dense = case.cache.clone(), case.cache.clone()
    backend.ops.write_kv(strided, k, v, case.meta.slot_mapping)
    backend.ops.write_kv(dense, case.k.contiguous(), case.v.contiguous(), case.meta.slot_mapping)
    assert torch.equal(strided, dense)
    with pytest.raises(RuntimeError, match="each head row"):
        backend.ops.write_kv(strided, case.k.transpose(1, 2).contiguous().transpose(1, 2),
                             case.v, case.meta.slot_mapping)


def test_every_row_mode_takes_prefill_chunks_in_the_kernel():
    # The batch-invariant mode: long query segments (a fresh prompt, a chunk over cached
    # context) through the kernel too, within rounding of the reference's SDPA.
    every = CpuPagedAttention(every_row=True)
    case = make_case([1, 20, 37], [17, 20, 60], heads=6, kv_heads=2, seed=5)
    assert every.prepare(case.meta).backend_plan.reference_seqs == ()
    (cache_k, out_k), (cache_r, out_r) = _both(every, case, None)
    assert torch.equal(cache_k, cache_r)
    torch.testing.assert_close(out_k, out_r, atol=ATOL[torch.float32], rtol=0)


# SmolLM2's 9 query / 3 KV heads over 16-token blocks: contexts shorter than, equal to and
# across the kernel's 8-key groups and the blocks, decode rows beside speculative-verify ones.
REAL_Q = [1, 1, 1, 1, 1, 1, 1, 1, 5, 16]
REAL_CTX = [1, 7, 8, 9, 16, 17, 63, 200, 21, 40]


@pytest.mark.parametrize("head_dim", [64, 80, 128, 20])  # 20: not a multiple of 8 (portable)
@pytest.mark.parametrize("window", [None, 10])
def test_real_model_shapes_ragged(backend, head_dim, window):
    case = make_case(REAL_Q, REAL_CTX, heads=9, kv_heads=3, head_dim=head_dim, block_size=16,
                     seed=head_dim)
    (cache_k, out_k), (cache_r, out_r) = _both(backend, case, window)
    assert torch.equal(cache_k, cache_r)
    torch.testing.assert_close(out_k, out_r, atol=ATOL[torch.float32], rtol=0)


def test_output_does_not_depend_on_the_thread_count(backend):
    # Pairs are split over threads by cost; each pair is computed whole by one thread.
    case = make_case(REAL_Q[::-1] * 3, REAL_CTX[::-1] * 3, heads=9, kv_heads=3, head_dim=64,
                     block_size=16, seed=7)
    meta = backend.prepare(case.meta)
    before = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(backend.attend(case.q, case.cache, meta, case.scale, None))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1), (2, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_any_group_size_and_dtype(backend, heads, kv_heads, dtype):
    case = make_case([1, 1, 2], [13, 33, 5], heads=heads, kv_heads=kv_heads, head_dim=24,
                     block_size=8, dtype=dtype, seed=heads)
    (cache_k, out_k), _ = _both(backend, case, None)
    ref = TorchAttention().attend(case.q.float(), cache_k.float(), case.meta, case.scale, None)
    assert out_k.dtype == dtype
    torch.testing.assert_close(out_k.float(), ref, atol=ATOL[dtype], rtol=0)


def test_packed_fp8_cache_runs_the_reference(backend):
    q_lens, ctx_lens = [1, 1], [9, 14]
    case = with_packed_fp8_cache(make_case(q_lens, ctx_lens, seed=3), q_lens, ctx_lens, seed=3)
    (cache_k, out_k), (cache_r, out_r) = _both(backend, case, None)
    assert torch.equal(cache_k, cache_r)
    assert torch.equal(out_k, out_r)


def test_auto_picks_the_kernel_on_cpu():
    assert resolve_backend_name("auto", "cpu") == "cpu"
    assert isinstance(get_backend("auto", "cpu"), CpuPagedAttention)


def test_a_failed_build_falls_back_with_one_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    bad = tmp_path / "broken.cpp"
    bad.write_text("this is not C++\n")
    with pytest.warns(RuntimeWarning, match="could not be built") as record:
        assert not cpu_kernels.build("pdserve_cpu_broken_test", ["-O0"], (bad,))
    assert len(record) == 1
    monkeypatch.setattr(cpu_kernels, "load_ops", lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_backend_name("auto", "cpu") == "torch"
