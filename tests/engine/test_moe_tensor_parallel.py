"""Qwen3 and MoE models under tensor parallelism (two real processes over gloo): TP=2 equals
TP=1, with experts sliced over the ranks or, with expert parallelism, owned whole."""

from __future__ import annotations

import json
import shutil

import pytest

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.layers.moe import FusedExperts
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.tp.driver import check_divisible
from tests.helpers.checkpoints import VOCAB
from tests.helpers.engine import assert_idle, random_prompts

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("ckpt,expert_parallel", [
    ("tiny_qwen3", False), ("tiny_qwen2_moe", False), ("tiny_qwen2_moe", True),
    ("tiny_mixtral", True)], ids=["qwen3", "qwen2_moe-tp", "qwen2_moe-ep", "mixtral-ep"])
def test_tp2_equals_tp1(request, ckpt, expert_parallel):
    path = str(request.getfixturevalue(ckpt))
    prompts = random_prompts([4, 23, 61], VOCAB, seed=31)
    ref = LLM(path, dtype="float32")
    expected = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    ref_logits = ref.engine.prompt_logits(prompts[2])
    with LLM(path, dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=24,
             enable_expert_parallel=expert_parallel) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        logits = llm.engine.prompt_logits(prompts[2])
        experts = [m for m in llm.engine.runner.model.modules()
                   if isinstance(m, FusedExperts)]
        assert experts or ckpt == "tiny_qwen3"
        assert all(m.num_local == (2 if expert_parallel else 4) for m in experts)
        assert_idle(llm)
    assert got == expected
    assert (logits - ref_logits).abs().max().item() < 1e-4


def test_expert_counts_that_do_not_split_are_refused_before_starting(tiny_mixtral, tmp_path):
    model = shutil.copytree(tiny_mixtral, tmp_path / "six")
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_local_experts"] = 6  # 4 heads and 2 KV heads do split over 4 ranks
    (model / "config.json").write_text(json.dumps(cfg))
    check_divisible(ModelConfig.from_pretrained(model), 4, expert_parallel=False)
    with pytest.raises(ValueError, match="6 experts do not split"):
        LLM(str(model), dtype="float32", tensor_parallel_size=4, enable_expert_parallel=True)
