"""The OpenAI API as vLLM's clients use it, with the official `openai` client against a real
cluster (one prefill and one decode worker, n-gram speculation on the decode worker): n and
batches, echo and prompt logprobs, logit_bias, structured outputs (also through the
disaggregated path), tool calls, vLLM's endpoints, flags and metric names.

Prompts longer than the router's local-prefill threshold (32 tokens) are prefilled on the
prefill worker and handed to the decode worker; shorter ones are prefilled by the decode
worker itself. Outputs are compared with the single-process engine where they are
deterministic."""

from __future__ import annotations

import json
import re
import urllib.request

import grpc
import jsonschema
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine import LLM, SamplingParams
from pdserve.tokenizer import Tokenizer
from tests.helpers.cluster import start_cluster, wait_idle, worker_stats

pytestmark = pytest.mark.timeout(600)

SERVED = "tiny-served"
# A fixed k: with the adaptive policy, which positions carry drafts (and so which random
# streams decide them) depends on the load, and seeded samples would not repeat exactly.
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1, "adaptive": False})
SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["n", "colour", "ok"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1,
                                              "maximum": 7}},
    "required": ["unit", "days"]}}}
# A hermes-style template that knows tools, tool calls and the tool role (--chat-template).
TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>\n"
    "{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHORT = "the river"  # prefilled on the decode worker
LONG = " ".join(["the city by the river and the road to the sea"] * 6)  # on the prefill worker


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm-compat")
    (tmp / "template.jinja").write_text(TEMPLATE)
    c = start_cluster(tiny_llama, tmp, worker_args=("--speculative-config", SPEC),
                      router_args=("--chat-template", str(tmp / "template.jinja"),
                                   "--served-model-name", SERVED, "--tool-call-parser",
                                   "hermes", "--enable-auto-tool-choice",
                                   "--enable-prompt-tokens-details"))
    yield c
    c.stop()


@pytest.fixture(scope="module")
def api(cluster):
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="x",
                       max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=256)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return Tokenizer.from_pretrained(tiny_llama)


def _http(cluster, path, body=None, content_type="application/json"):
    data = None if body is None else (json.dumps(body).encode() if content_type ==
                                      "application/json" else body)
    req = urllib.request.Request(f"http://{cluster.http_address}{path}", data=data,
                                 headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_models_carry_vllms_fields_and_the_served_name(api, tiny_llama):
    (card,) = api.models.list().data
    assert card.id == SERVED
    assert card.root == str(tiny_llama) and card.parent is None
    assert card.max_model_len == 1024


@pytest.mark.parametrize("prompt", [SHORT, LONG])
def test_n_seeded_choices_are_distinct_and_reproducible(api, prompt):
    def run():
        out = api.completions.create(model=SERVED, prompt=prompt, n=4, seed=7, max_tokens=8,
                                     temperature=1.0, extra_body={"ignore_eos": True})
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        return [c.text for c in out.choices]

    first = run()
    assert len(set(first)) == 4
    assert run() == first


def test_greedy_n1_is_the_engines_output(api, engine):
    out = api.completions.create(model=SERVED, prompt=LONG, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
    ref = engine.generate([LONG], SamplingParams(max_tokens=12, temperature=0,
                                                 ignore_eos=True))[0]
    assert out.choices[0].text == ref.text


def test_a_stream_interleaves_choices_and_ends_each_on_its_last_content_chunk(api):
    stream = api.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": SHORT}], n=3, seed=1,
        max_tokens=6, temperature=1.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    texts, finishes, order = {}, {}, []
    for c in chunks[:-1]:
        (choice,) = c.choices
        order.append(choice.index)
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason is not None:
            assert choice.delta.content  # the last content chunk, not an extra empty one
            finishes[choice.index] = choice.finish_reason
        assert c.usage is not None and c.usage.prompt_tokens > 0
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert len(set(order)) == 3 and order != sorted(order)  # interleaved
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 18


def test_a_batch_of_prompts_is_one_choice_per_prompt(api):
    prompts = [SHORT, LONG, [5, 6, 7, 8]]
    batch = api.completions.create(model=SERVED, prompt=prompts, max_tokens=5, temperature=0,
                                   extra_body={"ignore_eos": True})
    alone = [api.completions.create(model=SERVED, prompt=p, max_tokens=5, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0].text
             for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == alone
    assert batch.usage.completion_tokens == 15


@pytest.mark.parametrize("prompt", [SHORT, LONG])
def test_prompt_logprobs_equal_the_engines(api, engine, tokenizer, prompt):
    out = api.completions.create(model=SERVED, prompt=prompt, max_tokens=1, temperature=0,
                                 extra_body={"prompt_logprobs": 2})
    ref = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0,
                                                   prompt_logprobs=2))[0]
    plp = out.choices[0].prompt_logprobs
    ids = tokenizer.encode(prompt)
    assert plp[0] is None and len(plp) == len(ids)
    for entry, tid, lp in zip(plp[1:], ids[1:], ref.prompt_logprobs, strict=True):
        assert entry[str(tid)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)
        assert {int(k) for k, v in entry.items() if v["rank"] <= 2} >= {t for t, _ in lp.top}


def test_echo_with_logprobs_scores_the_prompt(api, tokenizer):
    for prompt in (SHORT, [5, 6, 7, 8, 9]):
        out = api.completions.create(model=SERVED, prompt=prompt, max_tokens=3,
                                     temperature=0, echo=True, logprobs=1)
        text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt,
                                                                       skip_special_tokens=False)
        choice = out.choices[0]
        assert choice.text.startswith(text)
        n_prompt = len(tokenizer.encode(prompt)) if isinstance(prompt, str) else len(prompt)
        assert len(choice.logprobs.tokens) == n_prompt + 3
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.top_logprobs[0] is None
    scored = api.completions.create(model=SERVED, prompt=SHORT, max_tokens=0, echo=True,
                                    logprobs=0)
    assert scored.choices[0].text == SHORT and scored.usage.completion_tokens == 0


def test_logit_bias_forces_a_token_and_bad_ids_are_400(api, tokenizer):
    out = api.completions.create(model=SERVED, prompt=SHORT, max_tokens=4, temperature=0,
                                 logit_bias={"42": 100}, extra_body={"return_token_ids": True,
                                                                     "ignore_eos": True})
    assert out.choices[0].token_ids == [42] * 4
    with pytest.raises(openai.BadRequestError, match="512"):
        api.completions.create(model=SERVED, prompt=SHORT, logit_bias={"600": 1})


@pytest.mark.parametrize("prompt", [SHORT, LONG])
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_outputs_validate(api, prompt, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                  "strict": True}}
    for seed in range(2):
        kw = dict(model=SERVED, messages=[{"role": "user", "content": prompt}],
                  response_format=fmt, max_tokens=60, temperature=1.0, seed=seed)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in
                           api.chat.completions.create(stream=True, **kw) if c.choices)
        else:
            text = api.chat.completions.create(**kw).choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)


def test_structured_outputs_regex_choice_and_invalid_ones(api):
    out = api.completions.create(model=SERVED, prompt=LONG, max_tokens=20, temperature=1.0,
                                 seed=3, extra_body={"structured_outputs":
                                                     {"regex": r"[a-c]{3}-\d\d"}})
    assert re.fullmatch(r"[a-c]{3}-\d\d", out.choices[0].text)
    pick = api.completions.create(model=SERVED, prompt=SHORT, max_tokens=20, temperature=1.0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert pick.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError, match="regex"):
        api.completions.create(model=SERVED, prompt=SHORT,
                               extra_body={"structured_outputs": {"regex": "[.*"}})
    with pytest.raises(openai.BadRequestError, match="json_schema"):
        api.chat.completions.create(model=SERVED, messages=[{"role": "user", "content": "x"}],
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "bad", "schema": {"properties": {"a": 1}}}})


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_parses_into_the_tools_schema(api, stream):
    # parallel_tool_calls=False: exactly one call (a random model would append more).
    kw = dict(model=SERVED, messages=[{"role": "user", "content": LONG}], tools=[WEATHER],
              tool_choice="required", parallel_tool_calls=False, max_tokens=100,
              temperature=1.0, seed=2)
    if not stream:
        choice = api.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls"
        calls = [(c.id, c.function.name, c.function.arguments)
                 for c in choice.message.tool_calls]
    else:
        by_index: dict[int, list] = {}
        finish = None
        for chunk in api.chat.completions.create(stream=True, **kw):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                entry = by_index.setdefault(d.index, [d.id, d.function.name, ""])
                entry[2] += d.function.arguments or ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert finish == "tool_calls"
        calls = [tuple(v) for _, v in sorted(by_index.items())]
    assert calls
    for call_id, name, arguments in calls:
        assert call_id.startswith("call_") and name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_tool_messages_go_through_the_template(cluster, api):
    messages = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    out = api.chat.completions.create(model=SERVED, messages=messages, tools=[WEATHER],
                                      tool_choice="none", max_tokens=3)
    assert out.choices[0].message.role == "assistant"
    status, body = _http(cluster, "/tokenize", {"messages": messages, "tools": [WEATHER]})
    rendered = Tokenizer.from_pretrained(cluster.spec.model, TEMPLATE).apply_chat_template(
        [dict(m, content=m["content"] or "", tool_calls=[
            {"function": {"name": "get_weather", "arguments": {"unit": "celsius"}}}])
         if m.get("tool_calls") else m for m in messages],
        tools=[WEATHER])
    assert status == 200 and '"arguments": {"unit": "celsius"}' in rendered
    assert "21 degrees" in rendered and "<|im_start|>tool" in rendered
    tok = Tokenizer.from_pretrained(cluster.spec.model)
    got = tok.decode(json.loads(body)["tokens"], skip_special_tokens=False)
    assert got == rendered


def test_unknown_fields_are_ignored_and_vllm_extras_honoured(api):
    out = api.chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": SHORT, "extra_field": "0"}],
        max_tokens=3, temperature=0,
        extra_body={"not_a_field": 1, "skip_special_tokens": True, "top_k": 5,
                    "chat_template_kwargs": {"anything": True}, "return_token_ids": True})
    assert len(out.choices[0].token_ids) == 3 and out.prompt_token_ids
    with pytest.raises(openai.BadRequestError, match="beam width"):
        api.completions.create(model=SERVED, prompt=SHORT, n=11,
                               extra_body={"use_beam_search": True})


def test_vllms_endpoints_and_a_form_body(cluster, tokenizer):
    status, body = _http(cluster, "/tokenize", {"prompt": SHORT, "model": SERVED})
    tok = json.loads(body)
    assert status == 200 and tok["tokens"] == tokenizer.encode(SHORT)
    assert tok["max_model_len"] == 1024 and tok["count"] == len(tok["tokens"])
    status, body = _http(cluster, "/detokenize", {"tokens": tok["tokens"]})
    assert json.loads(body)["prompt"] == tokenizer.decode(tok["tokens"],
                                                          skip_special_tokens=False)
    status, body = _http(cluster, "/version")
    assert status == 200 and "version" in json.loads(body)
    status, body = _http(cluster, "/v1/chat/completions", b"model=x",
                         "application/x-www-form-urlencoded")
    assert status == 415


def test_grpc_health_answers_per_service_name(cluster):
    with grpc.insecure_channel(cluster.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "pdserve.v1.PDServe"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_vllm_metrics_count_what_was_served(cluster, api):
    def scrape() -> str:
        return _http(cluster, "/metrics")[1].decode()

    before = scrape()
    api.completions.create(model=SERVED, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0,
                           extra_body={"ignore_eos": True})
    text = scrape()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert name in text, name
    assert f'model_name="{SERVED}"' in text

    def value(t: str, name: str) -> float:
        m = re.search(rf'^{re.escape(name)}{{model_name="{SERVED}"}} (\S+)$', t, re.M)
        return float(m.group(1)) if m else 0.0
    assert value(text, "vllm:generation_tokens_total") - value(
        before, "vllm:generation_tokens_total") == 4
    assert value(text, "vllm:prompt_tokens_total") - value(before, "vllm:prompt_tokens_total") \
        == 4
    assert value(text, "vllm:num_requests_running") == 0


def test_workers_are_idle_afterwards(cluster):
    assert not any(wait_idle(cluster).values())
    decode = next(c for c in cluster.children if c.info.get("role") == "decode")
    assert worker_stats(decode.info["address"]).counters["spec_drafts_proposed"] > 0


# -- the same on gRPC, through the SDK ----------------------------------------------------------


@pytest.fixture(scope="module")
def sdk(cluster):
    from pdserve.client import Client

    with Client(cluster.address, max_retries=0, timeout=300) as client:
        yield client


def test_sdk_n_choices_logit_bias_and_prompt_logprobs(sdk, engine):
    outs = sdk.generate_choices(LONG, n=3, seed=9, max_tokens=6, temperature=1.0,
                                ignore_eos=True, prompt_logprobs=1)
    assert [o.index for o in outs] == [0, 1, 2] and len({o.text for o in outs}) == 3
    assert outs[0].usage.completion_tokens == 18
    ref = engine.generate([LONG], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    got = [lp.logprob for lp in outs[0].prompt_logprobs]
    assert got == pytest.approx([lp.logprob for lp in ref.prompt_logprobs], abs=1e-4)
    forced = sdk.generate(SHORT, max_tokens=3, temperature=0, ignore_eos=True,
                          logit_bias={42: 100.0})
    assert forced.token_ids == [42, 42, 42]


def test_sdk_structured_outputs_and_bad_ones(sdk):
    from pdserve.client import InvalidArgument

    out = sdk.generate(LONG, max_tokens=60, temperature=1.0, seed=4, json_schema=SCHEMA)
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert sdk.generate(SHORT, max_tokens=8, choice=["up", "down"]).text in ("up", "down")
    with pytest.raises(InvalidArgument, match="regex"):
        sdk.generate(SHORT, regex="[.*")


def test_sdk_chat_with_a_required_tool(sdk):
    from pdserve.client import Chat

    chat = Chat(messages=[{"role": "user", "content": LONG}], tools=[WEATHER],
                tool_choice="get_weather")
    out = sdk.generate(chat, max_tokens=60, temperature=1.0, seed=1)
    (call,) = out.tool_calls
    assert call.name == "get_weather" and out.finish_reason == "stop"  # a named call
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    req = Chat(messages=[{"role": "user", "content": SHORT}], tools=[WEATHER],
               tool_choice="required")
    chunks = list(sdk.stream(req, max_tokens=100, temperature=1.0, seed=5))
    assert chunks[-1].finish_reason in ("tool_calls", "length")
    if chunks[-1].finish_reason == "tool_calls":
        assert chunks[-1].tool_calls and all(c.name == "get_weather"
                                             for c in chunks[-1].tool_calls)
