"""Shared fixtures: tiny checkpoints built once per session, thread limits for 2-core CI."""

from __future__ import annotations

import os

import pytest
import torch

# Triton picks interpreter vs GPU when a kernel module is first imported: decide it up front.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two cores are shared by the test process and any workers it starts.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# Every engine that names no KV budget (most test engines, and the workers they start, which
# inherit this) allocates 256 MiB of KV, not the 1 GiB default: a session holds dozens of
# engines at once on a 24 GiB machine, and tiny models fill a fraction of even this.
os.environ.setdefault("PDSERVE_CPU_KV_CACHE_GB", "0.25")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from tests.helpers.checkpoints import save_tiny

    return save_tiny(tmp_path_factory.mktemp("llama"), "llama", attention_bias=True)


@pytest.fixture(scope="session")
def tiny_llama3(tmp_path_factory):
    from tests.helpers.checkpoints import save_tiny

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return save_tiny(tmp_path_factory.mktemp("llama3"), "llama", seed=3, rope_scaling=scaling,
                     num_key_value_heads=1, head_dim=32, max_shard_size="100KB")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory):
    from tests.helpers.checkpoints import save_tiny

    return save_tiny(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def tiny_mistral(tmp_path_factory):
    from tests.helpers.checkpoints import save_tiny

    return save_tiny(tmp_path_factory.mktemp("mistral"), "mistral", seed=2)


# Qwen3 and MoE checkpoints (2 layers, hidden 64, 4 experts top-2): a wider init spread than
# transformers' default so routing and greedy outputs are decided by clear margins.
@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory):
    from tests.helpers.checkpoints import save_tiny

    return save_tiny(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=4, initializer_range=0.2)


@pytest.fixture(scope="session")
def tiny_mixtral(tmp_path_factory):
    from tests.helpers.checkpoints import save_tiny

    return save_tiny(tmp_path_factory.mktemp("mixtral"), "mixtral", seed=5,
                     initializer_range=0.2)


@pytest.fixture(scope="session")
def tiny_qwen2_moe(tmp_path_factory):
    from tests.helpers.checkpoints import save_tiny

    return save_tiny(tmp_path_factory.mktemp("qwen2_moe"), "qwen2_moe", seed=6,
                     initializer_range=0.2)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tmp_path_factory):
    from tests.helpers.checkpoints import save_tiny

    return save_tiny(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe", seed=7,
                     initializer_range=0.2)
# DeepSeek (MLA + MoE): V2 (V2-Lite shape, group-limited routing) and V3 (q bottleneck,
# noaux_tc routing with a random correction bias, yarn rope).
@pytest.fixture(scope="session")
def tiny_deepseek_v2(tmp_path_factory):
    from tests.helpers.checkpoints import save_tiny

    return save_tiny(tmp_path_factory.mktemp("deepseek_v2"), "deepseek_v2", seed=8,
                     initializer_range=0.2)


@pytest.fixture(scope="session")
def tiny_deepseek_v3(tmp_path_factory):
    from tests.helpers.checkpoints import save_tiny

    return save_tiny(tmp_path_factory.mktemp("deepseek_v3"), "deepseek_v3", seed=9,
                     initializer_range=0.2)


# Learned drafters for tiny_llama: random heads in each layout vLLM loads (their drafts are
# almost never accepted), and an EAGLE head fitted to the target's own greedy output on
# `FIT_PROMPTS` (most of its drafts on those prompts are accepted).
@pytest.fixture(scope="session")
def random_heads(tiny_llama, tmp_path_factory):
    from tests.helpers.draft_heads import save_eagle, save_eagle3, save_medusa

    tmp = tmp_path_factory.mktemp("heads")
    return {"eagle": save_eagle(tmp / "eagle", tiny_llama),
            "eagle3": save_eagle3(tmp / "eagle3", tiny_llama),
            "medusa": save_medusa(tmp / "medusa", tiny_llama)}


@pytest.fixture(scope="session")
def fitted_eagle(tiny_llama, tmp_path_factory):
    from tests.helpers.draft_heads import fit_eagle

    return fit_eagle(tiny_llama, tmp_path_factory.mktemp("fitted-eagle"))


@pytest.fixture(scope="session")
def tiny_deepseek_v3_mtp(tmp_path_factory):
    from tests.helpers.draft_heads import save_deepseek_v3_with_mtp

    return save_deepseek_v3_with_mtp(tmp_path_factory.mktemp("deepseek_v3_mtp"), seed=11)


# The real default model (SmolLM2-135M-Instruct): prepared once per session into a private
# cache, with one engine and one HF transformers reference shared by every test that needs it.
@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory):
    from tests.helpers.real_model import require_default_model

    require_default_model()
    from pdserve.default_model import ensure_default_model

    cache = tmp_path_factory.mktemp("pdserve-cache")
    ensure_default_model(cache, progress=None)
    return cache


@pytest.fixture(scope="session")
def default_model(default_model_cache):
    from pdserve.default_model import prepared_dir

    return prepared_dir(default_model_cache)


@pytest.fixture(scope="session")
def default_model_engine_ref(default_model):
    from tests.helpers.real_model import engine_reference

    return engine_reference(default_model)


@pytest.fixture(scope="session")
def default_model_hf_ref(default_model_engine_ref):
    pytest.importorskip("accelerate")
    from pdserve.default_model import source_file
    from tests.helpers.real_model import hf_reference

    ref = default_model_engine_ref
    return hf_reference(source_file(), ref["prompt_ids"], ref["greedy"])


# Directories whose tests start real processes; everything else is a unit test.
_DIR_MARKERS = {"e2e": "e2e", "faults": "faults", "security": "e2e"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        parts = item.path.relative_to(config.rootpath).parts
        sub = parts[1] if len(parts) > 2 and parts[0] == "tests" else ""
        item.add_marker(getattr(pytest.mark, _DIR_MARKERS.get(sub, "unit")))
