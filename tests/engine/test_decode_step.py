"""Decode-step modes give the eager engine's greedy tokens: `compile_decode="inductor"` on the
CPU (over the C++ attention kernels) and CUDA graphs on a GPU (skipped without CUDA), with
ragged batches that hit padded graph buckets. A backend that cannot be traced runs eager."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import LLM
from pdserve.engine.cuda_graphs import batch_ladder
from pdserve.engine.decode_step import CompiledDecode, EagerDecode
from tests.helpers.checkpoints import VOCAB, save_tiny
from tests.helpers.engine import assert_idle, greedy_ids, random_prompts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("decode_step") / "llama", "llama", seed=5)


def _llm(model_dir, **options) -> LLM:
    return LLM(str(model_dir), dtype="float32", block_size=4, num_gpu_blocks=96,
               enable_prefix_caching=False, **options)


def test_batch_ladder_covers_every_size_up_to_the_largest():
    assert batch_ladder(1) == [1]
    assert batch_ladder(20) == [1, 2, 4, 8, 16, 20]
    ladder = batch_ladder(64)
    assert ladder[:5] == [1, 2, 4, 8, 16] and ladder[-1] == 64
    assert all(any(s >= b for s in ladder) for b in range(1, 65))


@pytest.mark.slow
def test_inductor_decode_gives_the_eager_tokens(tiny):
    torch.set_num_threads(1)
    prompts = random_prompts([5, 9, 3], VOCAB, seed=2)
    compiled = _llm(tiny, compile_decode="inductor")
    assert isinstance(compiled.engine.runner.decode_step, CompiledDecode)
    ours = greedy_ids(compiled, prompts, 6) + greedy_ids(compiled, prompts[:1], 6)
    assert compiled.engine.runner.decode_step.state.value == "compiled"
    eager = _llm(tiny)
    assert ours == greedy_ids(eager, prompts, 6) + greedy_ids(eager, prompts[:1], 6)
    assert_idle(compiled)


def test_untraceable_backend_runs_eager(tiny):
    llm = _llm(tiny, attention_backend="torch", compile_decode="inductor")
    assert isinstance(llm.engine.runner.decode_step, EagerDecode)


def test_cuda_graphs_need_cuda(tiny):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ValueError, match="CUDA"):
        _llm(tiny, compile_decode="cuda_graphs")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_give_the_eager_tokens(tiny):
    prompts = random_prompts([5, 9, 3, 7, 4], VOCAB, seed=3)
    opts = dict(device="cuda", attention_backend="triton", max_num_seqs=8)
    graphs = _llm(tiny, compile_decode="cuda_graphs", **opts)
    eager = _llm(tiny, **opts)
    for batch in (prompts[:1], prompts[:3], prompts):  # buckets 1, 4 (padded), 8 (padded)
        assert greedy_ids(graphs, batch, 6) == greedy_ids(eager, batch, 6)
    assert sorted(graphs.engine.runner.decode_step.graphs) == [1, 4, 8]
    assert_idle(graphs)
