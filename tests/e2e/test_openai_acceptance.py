"""Acceptance: the official `openai` client against `pdserve up` serving the real default
model (SmolLM2-135M-Instruct) with a vLLM command line: n-gram speculation on every worker,
every prompt prefilled on the prefill worker and handed to the decode worker
(`--local-prefill-tokens 0`), hermes tool calls.

Every item of the drop-in API, streaming and not: greedy n=1 is the engine's output, n=4
seeded choices are distinct and reproducible, every json_schema output parses and validates
(with speculation on, through the disaggregated path), a required tool call parses into its
tool's arguments schema, vLLM's extras, endpoints and metric names answer."""

from __future__ import annotations

import json
import re
import urllib.request

import jsonschema
import openai
import pytest

from pdserve.default_model import MODEL_ID
from pdserve.engine import LLM, SamplingParams
from tests.helpers.real_model import QUESTION

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

EMPLOYEE = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "department": {"enum": ["sales", "engineering", "research"]},
    "remote": {"type": "boolean"}}, "required": ["name", "age", "department", "remote"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(real_openai_server):
    """`pdserve up` as a vLLM user types it (tests/e2e/conftest.py: shared with
    test_openai_vllm_behaviour.py)."""
    return real_openai_server


@pytest.fixture(scope="module")
def api(server):
    with openai.OpenAI(base_url=f"{server['http']}/v1", api_key="unused", max_retries=0,
                       timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def engine(default_model):
    with LLM(str(default_model), dtype="float32") as llm:
        yield llm


def _stream_text(stream) -> tuple[dict[int, str], dict[int, str | None], list]:
    texts: dict[int, str] = {}
    finish: dict[int, str | None] = {}
    chunks = list(stream)
    for c in chunks:
        for ch in c.choices:
            piece = getattr(ch, "text", None)
            if piece is None:
                piece = ch.delta.content or ""
            texts[ch.index] = texts.get(ch.index, "") + piece
            if ch.finish_reason is not None:
                assert ch.index not in finish  # once per choice
                finish[ch.index] = ch.finish_reason
    return texts, finish, chunks


def test_greedy_n1_is_the_engines_output(api, default_model_engine_ref):
    ref = default_model_engine_ref
    reply = api.chat.completions.create(model=MODEL_ID, messages=QUESTION, max_tokens=24,
                                        temperature=0)
    assert reply.choices[0].message.content == ref["chat_text"]
    texts, finish, _ = _stream_text(api.chat.completions.create(
        model=MODEL_ID, messages=QUESTION, max_tokens=24, temperature=0, stream=True))
    assert texts[0] == ref["chat_text"] and finish[0] in ("stop", "length")
    out = api.completions.create(model=MODEL_ID, prompt=ref["prompt_ids"][0], max_tokens=16,
                                 temperature=0, extra_body={"ignore_eos": True,
                                                            "return_token_ids": True})
    assert out.choices[0].token_ids == ref["greedy"][0]


@pytest.mark.parametrize("stream", [False, True])
def test_n4_seeded_choices_are_distinct_and_reproducible(api, stream):
    kw = dict(model=MODEL_ID, messages=[{"role": "user", "content": "Name a fruit."}], n=4,
              seed=1234, max_tokens=12, temperature=1.0)

    def run() -> list[str]:
        if stream:
            texts, finish, _ = _stream_text(api.chat.completions.create(stream=True, **kw))
            assert sorted(finish) == [0, 1, 2, 3]
            return [texts[i] for i in range(4)]
        out = api.chat.completions.create(**kw)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        return [c.message.content for c in out.choices]

    first = run()
    assert len(set(first)) == 4, first
    assert run() == first


def test_a_batch_of_prompts_echo_and_prompt_logprobs(api, engine):
    prompts = ["The capital of Italy is", "Water is made of"]
    batch = api.completions.create(model=MODEL_ID, prompt=prompts, max_tokens=6,
                                   temperature=0, echo=True, logprobs=1,
                                   extra_body={"prompt_logprobs": 1})
    assert [c.index for c in batch.choices] == [0, 1]
    for prompt, choice in zip(prompts, batch.choices, strict=True):
        assert choice.text.startswith(prompt)
        assert choice.logprobs.token_logprobs[0] is None
        ref = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0,
                                                       prompt_logprobs=1))[0]
        ids = engine.tokenizer.encode(prompt)
        got = [entry[str(tid)]["logprob"]
               for entry, tid in zip(choice.prompt_logprobs[1:], ids[1:], strict=True)]
        assert got == pytest.approx([lp.logprob for lp in ref.prompt_logprobs], abs=1e-3)


def test_logit_bias_steers_and_is_checked(api, engine):
    tok = engine.tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = api.completions.create(model=MODEL_ID, prompt="My favourite fruit is", max_tokens=1,
                                 temperature=0, logit_bias={str(tok): 100})
    assert out.choices[0].text == " banana"
    with pytest.raises(openai.BadRequestError, match="out-of-vocab"):
        api.completions.create(model=MODEL_ID, prompt="x", logit_bias={"999999": 1})


@pytest.mark.parametrize("stream", [False, True])
def test_every_json_schema_output_validates(api, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "employee", "schema": EMPLOYEE,
                                                  "strict": True}}
    messages = [{"role": "user", "content": "Give an example JSON for an employee profile."}]
    for seed in range(2):
        kw = dict(model=MODEL_ID, messages=messages, response_format=fmt, max_tokens=120,
                  temperature=0.8, seed=seed)
        if stream:
            texts, finish, _ = _stream_text(api.chat.completions.create(stream=True, **kw))
            text = texts[0]
            assert finish[0] == "stop"
        else:
            choice = api.chat.completions.create(**kw).choices[0]
            text = choice.message.content
            assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(text), EMPLOYEE)


def test_structured_outputs_regex_choice_grammar_json_object(api):
    ip = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"
    out = api.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Give an example IP address."}],
        max_tokens=20, extra_body={"structured_outputs": {"regex": ip}})
    assert re.fullmatch(ip, out.choices[0].message.content)
    langs = ["Python", "Java", "Rust", "C++"]
    out = api.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "The best language is?"}],
        max_tokens=10, extra_body={"structured_outputs": {"choice": langs}})
    assert out.choices[0].message.content in langs
    sql = 'root ::= "SELECT " column " FROM " table\ncolumn ::= "name" | "email"\n' \
          'table ::= "users" | "orders"'
    out = api.completions.create(model=MODEL_ID, prompt="SQL to list user names:",
                                 max_tokens=20, extra_body={"structured_outputs":
                                                            {"grammar": sql}})
    assert re.fullmatch(r"SELECT (name|email) FROM (users|orders)", out.choices[0].text)
    out = api.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "1+1? Answer in JSON."}],
        max_tokens=60, temperature=0, response_format={"type": "json_object"})
    text = out.choices[0].message.content
    assert text.startswith("{")  # an object, possibly cut by max_tokens
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    with pytest.raises(openai.BadRequestError, match="regex"):
        api.completions.create(model=MODEL_ID, prompt="x",
                               extra_body={"structured_outputs": {"regex": "[.*"}})


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_tool_call_parses_into_its_arguments_schema(api, stream):
    kw = dict(model=MODEL_ID, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
              max_tokens=100, temperature=0.7, seed=3)
    if stream:
        calls: dict[int, list] = {}
        finish = None
        for chunk in api.chat.completions.create(stream=True, **kw):
            ch = chunk.choices[0]
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, [None, ""])
                entry[0] = entry[0] or d.function.name
                entry[1] += d.function.arguments or ""
            finish = ch.finish_reason or finish
        assert finish == "tool_calls"
        pairs = list(calls.values())
    else:
        choice = api.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""
        pairs = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert pairs
    for name, arguments in pairs:
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])


def test_named_and_auto_tool_calls_and_tool_messages(api):
    named = api.chat.completions.create(
        model=MODEL_ID, messages=ASK_WEATHER, tools=[WEATHER], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = named.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    auto = api.chat.completions.create(model=MODEL_ID, messages=ASK_WEATHER, tools=[WEATHER],
                                       max_tokens=60, temperature=0)
    message = auto.choices[0].message  # the model may answer or call: either parses
    assert message.content or message.tool_calls
    follow_up = ASK_WEATHER + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees and sunny"}]
    out = api.chat.completions.create(model=MODEL_ID, messages=follow_up, tools=[WEATHER],
                                      tool_choice="none", max_tokens=30, temperature=0)
    assert out.choices[0].message.content


def test_vllm_extras_endpoints_and_metrics(api, server, engine):
    out = api.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Hi", "extra": 1}],
        max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"unknown_field": True, "min_tokens": 8, "skip_special_tokens": True,
                    "chat_template_kwargs": {}, "top_k": 20})
    counts = [c.usage.completion_tokens for c in out]
    assert counts[-1] == 8 and counts == sorted(counts)
    body = json.dumps({"model": MODEL_ID, "messages": QUESTION}).encode()
    with urllib.request.urlopen(urllib.request.Request(
            f"{server['http']}/tokenize", body, {"Content-Type": "application/json"}),
            timeout=30) as resp:
        tok = json.loads(resp.read())
    assert tok["tokens"] == engine.tokenizer.encode_chat(QUESTION)
    assert api.models.list().data[0].root
    with urllib.request.urlopen(f"{server['http']}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:prefix_cache_hits_total"):
        assert name in text
