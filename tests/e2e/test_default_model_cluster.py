"""The real default model through the cluster (prefill + decode workers, KV over gloo): the
gRPC API and the official `openai` client give the single-process engine's greedy output,
and the README's OpenAI example works as written against a cluster started without a model."""

from __future__ import annotations

import openai
import pytest

from pdserve.client import Client
from pdserve.default_model import CACHE_DIR_ENV, MODEL_ID
from pdserve.launcher import ClusterSpec, LocalCluster
from tests.helpers.cluster import wait_idle
from tests.helpers.real_model import CHAT_TOKENS, NEW_TOKENS, QUESTION

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(default_model_cache, tmp_path_factory):
    logs = tmp_path_factory.mktemp("default-cluster") / "logs"
    # No model: the launcher serves the default one, found in this cache.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_DIR_ENV, str(default_model_cache))
        spec = ClusterSpec(port=0, threads_per_worker=1, log_dir=str(logs),
                           env={"OMP_NUM_THREADS": "1"},
                           router_args=("--local-prefill-tokens", "0"))  # always disaggregate
        c = LocalCluster(spec).start()
    yield c
    c.stop()


def test_grpc_greedy_equals_the_engine(cluster, default_model_engine_ref):
    ref = default_model_engine_ref
    with Client(cluster.address, max_retries=0) as client:
        (card,) = client.list_models()
        assert card.id == MODEL_ID
        for ids, want in zip(ref["prompt_ids"], ref["greedy"], strict=True):
            out = client.generate(ids, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True,
                                  timeout=120)
            assert out.token_ids == want
    wait_idle(cluster)


def test_openai_chat_answer_equals_the_engine(cluster, default_model_engine_ref):
    ref = default_model_engine_ref
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused",
                       max_retries=0, timeout=120) as client:
        assert [m.id for m in client.models.list().data] == [MODEL_ID]
        reply = client.chat.completions.create(model=MODEL_ID, messages=QUESTION,
                                               max_tokens=CHAT_TOKENS, temperature=0)
        assert reply.choices[0].message.content == ref["chat_text"]
        assert "Paris" in reply.choices[0].message.content
        assert reply.usage.prompt_tokens == len(ref["chat_ids"])
        # The README's example, as written there (a stream, default sampling is seeded
        # per request, so only that it streams an answer is checked).
        text = ""
        for chunk in client.chat.completions.create(
                model=MODEL_ID, messages=[{"role": "user", "content": "Hi"}],
                max_tokens=16, stream=True):
            text += chunk.choices[0].delta.content or ""
        assert text.strip()
    wait_idle(cluster)
