"""OpenAI request bodies -> typed requests: accepted shapes, defaults, and 400s naming the field."""

from __future__ import annotations

import pytest

from router.openai.errors import ApiError, RequestError
from router.openai.schemas import ServedModel, parse_chat, parse_completion, parse_json_body
from router.validation import check_prompt_ids

MODEL = ServedModel(id="tiny", max_model_len=128, vocab_size=512, created=1)
USER = [{"role": "user", "content": "hi"}]


def completion(**fields):
    return parse_completion({"model": "tiny", "prompt": "hello", **fields}, MODEL)


def chat(**fields):
    return parse_chat({"model": "tiny", "messages": USER, **fields}, MODEL)


def param_of(fn, **fields) -> str | None:
    with pytest.raises(RequestError) as err:
        fn(**fields)
    return err.value.param


def test_completion_defaults_follow_openai():
    req = completion()
    assert req.prompt == "hello"
    assert (req.stream, req.include_usage) == (False, False)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.logprobs, p.stop) == (16, 1.0, 1.0, None, ())


def test_completion_sampling_fields_reach_sampling_params():
    req = completion(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1,
                     presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                     seed=42, stop="\n", ignore_eos=True, min_tokens=2, logprobs=3,
                     stream=True, stream_options={"include_usage": True}, user="u", n=1)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (7, 0.5, 0.9, 5, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.seed, p.stop, p.ignore_eos, p.min_tokens, p.logprobs) == (42, ("\n",), True, 2, 3)
    assert (req.stream, req.include_usage) == (True, True)


@pytest.mark.parametrize("prompt, expected", [
    ("text", "text"), ([5, 6, 7], (5, 6, 7)), (["text"], "text"), ([[5, 6]], (5, 6)),
])
def test_completion_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt == expected


@pytest.mark.parametrize("prompt", ["", ["a", "b"], [[1], [2]], [1, "a"], [True, 2], 5, {}])
def test_bad_prompts_name_the_prompt(prompt):
    assert param_of(completion, prompt=prompt) == "prompt"


def test_missing_prompt_is_an_error():
    with pytest.raises(RequestError, match="prompt is required"):
        parse_completion({"model": "tiny"}, MODEL)


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"min_tokens": 20}, "min_tokens"),
    ({"seed": -1}, "seed"),
    ({"top_k": 2**40}, "top_k"),
    ({"stop": ["a", 3]}, "stop"),
    ({"stop_token_ids": [600]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"n": 2}, "n"),
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": 1}}, "stream_options"),
    ({"functions_please": 1}, "functions_please"),
])
def test_invalid_completion_fields_are_named(fields, param):
    assert param_of(completion, **fields) == param


def test_nulls_count_as_absent():
    req = completion(temperature=None, stop=None, logprobs=None, seed=None, suffix=None)
    assert req.params.temperature == 1.0 and req.params.seed is None


def test_another_model_is_not_found():
    with pytest.raises(ApiError) as err:
        completion(model="gpt-4")
    assert (err.value.status, err.value.param, err.value.code) == (404, "model", "model_not_found")


def test_chat_defaults_run_to_the_context_end():
    req = chat()
    assert req.messages == ({"role": "user", "content": "hi"},)
    assert req.params.max_tokens == MODEL.max_model_len
    assert req.logprobs is False and req.params.logprobs is None


def test_chat_max_completion_tokens_wins_and_is_named():
    assert chat(max_tokens=5, max_completion_tokens=3).params.max_tokens == 3
    assert param_of(chat, max_completion_tokens=0) == "max_completion_tokens"
    assert param_of(chat, max_tokens=0) == "max_tokens"


def test_chat_logprobs_take_top_logprobs():
    req = chat(logprobs=True, top_logprobs=4)
    assert req.logprobs is True and req.params.logprobs == 4
    assert chat(logprobs=True).params.logprobs == 0
    assert param_of(chat, top_logprobs=2) == "top_logprobs"
    assert param_of(chat, logprobs=True, top_logprobs=21) == "top_logprobs"
    assert param_of(chat, logprobs=3) == "logprobs"


def test_chat_content_parts_are_joined():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = chat(messages=[{"role": "system", "content": "s"},
                         {"role": "user", "content": parts, "name": "bob"},
                         {"role": "assistant", "content": None}])
    assert req.messages == ({"role": "system", "content": "s"},
                            {"role": "user", "content": "a\nb", "name": "bob"},
                            {"role": "assistant", "content": ""})


@pytest.mark.parametrize("messages", [
    [], "hi", [{"role": "wizard", "content": "x"}], [{"content": "x"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": "x", "tool_calls": []}], [5],
])
def test_bad_messages_name_messages(messages):
    assert param_of(chat, messages=messages) == "messages"


def test_chat_refuses_what_it_cannot_honour():
    assert param_of(chat, tools=[{"type": "function"}]) == "tools"
    assert param_of(chat, tool_choice="auto") == "tool_choice"
    assert param_of(chat, response_format={"type": "json_object"}) == "response_format"
    assert chat(response_format={"type": "text"}, tools=[], tool_choice="none").params


@pytest.mark.parametrize("raw, match", [
    (b'{"a": NaN}', "NaN"), (b'{"a": 1, "a": 2}', "duplicate"), (b"\xff\xfe", "UTF-8"),
    (b"{", "not valid JSON"), (b"[" * 100000 + b"]" * 100000, "nested"),
])
def test_json_bodies_are_parsed_strictly(raw, match):
    with pytest.raises(RequestError, match=match):
        parse_json_body(raw)


def test_a_body_that_is_not_an_object_is_refused():
    with pytest.raises(RequestError, match="JSON object"):
        parse_completion([1, 2], MODEL)


@pytest.mark.parametrize("ids, match", [
    ([], "empty"), ([1, 512], "outside"), ([-1], "outside"), ([3] * 128, "context"),
])
def test_prompt_ids_must_fit_the_model(ids, match):
    with pytest.raises(RequestError, match=match) as err:
        check_prompt_ids(ids, MODEL.limits, "prompt")
    assert err.value.param == "prompt"
