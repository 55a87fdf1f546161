"""The OpenAI-compatible HTTP API end to end: the official `openai` client against a real
router and workers on loopback, checked against the gRPC API of the same cluster."""

from __future__ import annotations

import http.client
import json
import time
import urllib.request

import openai
import pytest

from pdserve.client import Client
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.tokenizer import Tokenizer
from tests.helpers.cluster import TEST_SECRET, wait_idle, worker_stats

pytestmark = pytest.mark.timeout(300)

TOKEN = "e2e-secret"
MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "tell me about the river and the city"}]


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    logs = tmp_path_factory.mktemp("openai-cluster") / "logs"
    spec = ClusterSpec(model=str(tiny_llama), port=0, threads_per_worker=1,
                       worker_args=("--dtype", "float32"), log_dir=str(logs),
                       env={"OMP_NUM_THREADS": "1", "PDSERVE_AUTH_TOKENS": TOKEN},
                       cluster_secret=TEST_SECRET)
    c = LocalCluster(spec).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def api(cluster):
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key=TOKEN,
                       max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with Client(cluster.address, token=TOKEN, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def model_id(api):
    return api.models.list().data[0].id


def _stream_chat(api, model_id, **kwargs):
    stream = api.chat.completions.create(model=model_id, messages=MESSAGES, stream=True,
                                         stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] in ("stop", "length") and not any(finish[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    return text, chunks[-1].usage


def test_models_list_the_served_model(api, grpc_client, model_id):
    (card,) = grpc_client.list_models()
    assert model_id == card.id
    assert api.models.retrieve(model_id).id == model_id


def test_seeded_chat_stream_equals_the_grpc_path(api, grpc_client, model_id, tiny_llama):
    ids = Tokenizer.from_pretrained(tiny_llama).encode_chat(MESSAGES)
    text, usage = _stream_chat(api, model_id, max_tokens=12, temperature=0.8, top_p=0.9,
                               seed=1234)
    ref = grpc_client.generate(ids, max_tokens=12, temperature=0.8, top_p=0.9, seed=1234)
    assert text == ref.text
    assert usage.prompt_tokens == len(ids) == ref.usage.prompt_tokens
    assert usage.completion_tokens == ref.usage.completion_tokens
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_greedy_chat_equals_the_grpc_path(api, grpc_client, model_id, tiny_llama):
    ids = Tokenizer.from_pretrained(tiny_llama).encode_chat(MESSAGES)
    out = api.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=10,
                                      temperature=0, logprobs=True, top_logprobs=2)
    ref = grpc_client.generate(ids, max_tokens=10, temperature=0.0, logprobs=2)
    (choice,) = out.choices
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert out.usage.completion_tokens == ref.usage.completion_tokens
    # The tokens are exact (the text above); the logprobs agree to float noise. Whether the
    # second request reuses the first's cached prefix depends on whether the router's index
    # has learnt of it yet (a poll), so its prompt may be computed in other shapes: fp32 sums
    # in another order, 5e-7 apart once on a loaded machine.
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
        [r.logprob for r in ref.logprobs], abs=1e-5)
    assert [[a.logprob for a in t.top_logprobs] for t in choice.logprobs.content] == [
        pytest.approx([a.logprob for a in r.top], abs=1e-5) for r in ref.logprobs]


def test_seeded_completion_stream_equals_the_grpc_path(api, grpc_client, model_id):
    prompt = "the model and the server"
    stream = api.completions.create(model=model_id, prompt=prompt, max_tokens=14,
                                    temperature=0.9, seed=99, logprobs=1, stream=True,
                                    stream_options={"include_usage": True},
                                    extra_body={"ignore_eos": True, "top_k": 40})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    n_logprobs = sum(len(c.choices[0].logprobs.tokens) for c in chunks
                     if c.choices and c.choices[0].logprobs)
    ref = grpc_client.generate(prompt, max_tokens=14, temperature=0.9, seed=99, top_k=40,
                               ignore_eos=True)
    assert text == ref.text
    assert n_logprobs == 14 == chunks[-1].usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == ref.usage.prompt_tokens


def test_greedy_completion_from_token_ids_with_a_stop_string(api, grpc_client, model_id):
    prompt = [5, 17, 99, 230, 41, 8]
    ref_full = grpc_client.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
    stop = ref_full.text[len(ref_full.text) // 2:][:2]  # a string the output surely contains
    out = api.completions.create(model=model_id, prompt=prompt, max_tokens=16, temperature=0,
                                 stop=[stop], extra_body={"ignore_eos": True})
    ref = grpc_client.generate(prompt, max_tokens=16, temperature=0.0, ignore_eos=True,
                               stop=[stop])
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == "stop" == ref.finish_reason
    assert len(out.choices[0].text) < len(ref_full.text)
    assert out.usage.prompt_tokens == len(prompt)


def test_bad_temperature_is_a_bad_request_naming_the_field(api, model_id):
    with pytest.raises(openai.BadRequestError) as err:
        api.completions.create(model=model_id, prompt="hi", temperature=-1)
    assert "temperature" in err.value.message
    assert err.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as err:
        api.chat.completions.create(model=model_id, messages=MESSAGES, n=0)
    assert err.value.body["param"] == "n"
    with pytest.raises(openai.NotFoundError):
        api.completions.create(model="no-such-model", prompt="hi")


def test_requests_need_the_bearer_token(cluster, model_id):
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="wrong",
                       max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=model_id, prompt="hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    with urllib.request.urlopen(f"http://{cluster.http_address}/health", timeout=10) as resp:
        assert json.loads(resp.read()) == {"status": "ok"}  # health stays open


def test_closing_a_stream_early_leaves_the_workers_idle(cluster, api, model_id):
    stream = api.completions.create(model=model_id, prompt="the stream is closed early",
                                    max_tokens=500, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    for seen, _ in enumerate(stream):
        if seen == 3:
            break
    stream.close()
    assert not any(wait_idle(cluster).values())


def test_a_client_gone_before_the_response_leaves_the_workers_idle(cluster, model_id):
    host, port = cluster.http_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    body = json.dumps({"model": model_id, "messages": MESSAGES, "max_tokens": 900,
                       "temperature": 0, "ignore_eos": True})
    conn.request("POST", "/v1/chat/completions", body, {
        "Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    decode = next(c for c in cluster.children if c.info.get("role") == "decode")
    for _ in range(300):  # until the decode worker runs the request
        if worker_stats(decode.info["address"]).num_running:
            break
        time.sleep(0.05)
    assert worker_stats(decode.info["address"]).num_running == 1
    conn.close()  # hang up without reading the (non-streaming) response
    assert not any(wait_idle(cluster).values())
