"""OpenAI request bodies -> typed requests: accepted shapes, defaults, tolerance of unknown
fields, vLLM's extras, and 400s naming the field."""

from __future__ import annotations

import json
import logging

import pytest

from pdserve.engine.structured import ConstraintKind
from router.openai.errors import ApiError, RequestError
from router.openai.schemas import (
    IgnoredFields,
    ServedModel,
    Truncation,
    check_prompt_ids,
    parse_chat,
    parse_completion,
    parse_json_body,
)
from router.openai.tools import ToolConfig, ToolMode

MODEL = ServedModel(id="tiny", max_model_len=128, vocab_size=512, created=1)
USER = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
AUTO = ToolConfig(parser="hermes", auto=True)


def completion(**fields):
    return parse_completion({"model": "tiny", "prompt": "hello", **fields}, MODEL)


def chat(tools_config=None, **fields):
    return parse_chat({"model": "tiny", "messages": USER, **fields}, MODEL, tools_config)


def param_of(fn, **fields) -> str | None:
    with pytest.raises(RequestError) as err:
        fn(**fields)
    return err.value.param


def test_completion_defaults_follow_openai():
    req = completion()
    assert req.prompts == ("hello",)
    assert (req.out.stream, req.out.stream_options.include_usage, req.out.n) == (False, False, 1)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.logprobs, p.stop) == (16, 1.0, 1.0, None, ())
    assert (req.best_of, req.add_special_tokens, req.generate) == (1, True, True)


def test_completion_sampling_fields_reach_sampling_params():
    req = completion(max_tokens=7, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1,
                     presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
                     seed=42, stop="\n", ignore_eos=True, min_tokens=2, logprobs=3,
                     stream=True, stream_options={"include_usage": True}, user="u",
                     logit_bias={"7": 2.5}, prompt_logprobs=1)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (7, 0.5, 0.9, 5, 0.1)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert (p.seed, p.stop, p.ignore_eos, p.min_tokens, p.logprobs) == (42, ("\n",), True, 2, 3)
    assert (p.logit_bias, p.prompt_logprobs) == (((7, 2.5),), 1)
    assert (req.out.stream, req.out.stream_options.include_usage) == (True, True)


@pytest.mark.parametrize("prompt, expected", [
    ("text", ("text",)), ([5, 6, 7], ((5, 6, 7),)), (["text"], ("text",)),
    ([[5, 6]], ((5, 6),)), (["a", "b"], ("a", "b")), ([[1], [2, 3]], ((1,), (2, 3))),
])
def test_completion_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompts == expected


@pytest.mark.parametrize("prompt", ["", [], ["a", ""], [1, "a"], [True, 2], 5, {}, [[]]])
def test_bad_prompts_name_the_prompt(prompt):
    assert param_of(completion, prompt=prompt) == "prompt"


def test_missing_prompt_is_an_error():
    # vLLM's words, which its clients and tests match on.
    for body in ({"model": "tiny"}, {"prompt": []}, {"prompt": ""}):
        with pytest.raises(RequestError, match="Either prompt or prompt_embeds must be "
                                               "provided and non-empty"):
            parse_completion(body, MODEL)


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1.0}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"min_tokens": 20}, "min_tokens"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"top_k": 2**40}, "top_k"),
    ({"stop": ["a", 3]}, "stop"),
    ({"stop_token_ids": [600]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"n": 0}, "n"),
    ({"n": 3, "best_of": 2}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"stream": "yes"}, "stream"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"use_beam_search": True, "n": 11}, "n"),
    ({"use_beam_search": True, "structured_outputs": {"regex": "a+"}}, "use_beam_search"),
    ({"suffix": "x"}, "suffix"),
])
def test_invalid_completion_fields_are_named(fields, param):
    assert param_of(completion, **fields) == param


def test_range_errors_use_pydantic_words():
    with pytest.raises(RequestError, match="less_than_equal"):
        completion(seed=2**63)
    with pytest.raises(RequestError, match="greater_than_equal"):
        completion(seed=-(2**63) - 1)


def test_logit_bias_errors_name_every_bad_key_and_the_vocabulary():
    with pytest.raises(RequestError, match="bad1.*bad2"):
        completion(logit_bias={"bad1": 1, "bad2": 2})
    with pytest.raises(RequestError, match=r"\[600\].*512"):
        completion(logit_bias={"600": 1})


def test_unknown_fields_are_ignored_and_logged_once(caplog):
    ignored = IgnoredFields(logging.getLogger("test.ignored"))
    body = {"model": "tiny", "prompt": "x", "frobnicate": 1, "service_tier": "auto"}
    with caplog.at_level(logging.WARNING, "test.ignored"):
        parse_completion(body, MODEL, ignored)
        parse_completion(body, MODEL, ignored)
    (record,) = caplog.records
    assert "frobnicate" in record.message and "service_tier" in record.message


def test_vllm_extras_are_accepted_and_honoured():
    req = completion(skip_special_tokens=False, return_token_ids=True,
                     return_tokens_as_token_ids=True, truncate_prompt_tokens=4,
                     request_id="abc", use_beam_search=False, add_special_tokens=False,
                     spaces_between_special_tokens=True, length_penalty=1.0)
    assert (req.out.skip_special_tokens, req.out.return_token_ids) == (False, True)
    assert (req.out.tokens_as_ids, req.truncation) == (True, Truncation(4, left=True))
    assert (req.out.request_id, req.add_special_tokens) == ("abc", False)


def test_n_best_of_and_echo():
    req = completion(n=3, seed=5)
    assert (req.out.n, req.best_of, req.params.seed) == (3, 3, 5)
    best = completion(n=2, best_of=4)
    assert best.best_of == 4 and best.params.logprobs == 0  # ranked by logprob
    echo = completion(echo=True, logprobs=2, max_tokens=0)
    assert echo.out.echo and not echo.generate and echo.params.max_tokens == 1
    assert echo.params.prompt_logprobs == 2


def test_negative_seeds_fold_into_the_engine_range():
    assert completion(seed=-1).params.seed == 2**63 - 1


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
    assert req.template.add_generation_prompt and not req.template.continue_final_message
    assert req.tools.mode is ToolMode.NONE


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


def test_chat_content_parts_roles_and_extra_keys():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    req = chat(messages=[{"role": "system", "content": "s"},
                         {"role": "user", "content": parts, "name": "bob", "extra": 1},
                         {"role": "my-custom-role", "content": "c"},
                         {"role": "assistant", "content": None}])
    assert req.messages == ({"role": "system", "content": "s"},
                            {"role": "user", "content": "a\nb", "name": "bob"},
                            {"role": "my-custom-role", "content": "c"},
                            {"role": "assistant", "content": ""})


@pytest.mark.parametrize("messages", [
    [], "hi", [{"content": "x"}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "assistant", "content": "x", "tool_calls": [{"id": "1"}]}], [5],
])
def test_bad_messages_name_messages(messages):
    assert param_of(chat, messages=messages) == "messages"


def test_chat_template_options():
    req = chat(add_generation_prompt=False, continue_final_message=True,
               chat_template_kwargs={"enable_thinking": False}, add_special_tokens=True)
    t = req.template
    assert (t.add_generation_prompt, t.continue_final_message, t.add_special_tokens) == (
        False, True, True)
    assert t.kwargs == {"enable_thinking": False}
    assert param_of(chat, continue_final_message=True) == "continue_final_message"
    assert param_of(chat, chat_template="{{ x }}") == "chat_template"


def test_response_format_and_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    js = chat(response_format={"type": "json_schema",
                               "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert js.params.structured.kind is ConstraintKind.JSON_SCHEMA
    assert json.loads(js.params.structured.spec) == schema
    assert chat(response_format={"type": "json_object"}).params.structured.kind is \
        ConstraintKind.JSON_OBJECT
    assert chat(response_format={"type": "text"}).params.structured is None
    for field, value, kind in [("regex", "a+", ConstraintKind.REGEX),
                               ("choice", ["a", "b"], ConstraintKind.CHOICE),
                               ("grammar", 'root ::= "x"', ConstraintKind.GRAMMAR),
                               ("json", schema, ConstraintKind.JSON_SCHEMA)]:
        assert completion(structured_outputs={field: value}).params.structured.kind is kind
    assert completion(guided_regex="a+").params.structured.kind is ConstraintKind.REGEX
    assert completion(guided_choice=["x"]).params.structured.choices == ("x",)


@pytest.mark.parametrize("fields", [
    {"structured_outputs": {"regex": {"1": "Python"}}},
    {"structured_outputs": {"regex": "a", "json": {}}},
    {"structured_outputs": {"choice": []}},
    {"response_format": {"type": "xml"}},
    {"response_format": {"type": "json_schema"}},
    {"guided_json": "{not json"},
    {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
])
def test_malformed_constraints_are_400s(fields):
    with pytest.raises(RequestError):
        completion(**fields)


def test_tools_and_tool_choice():
    assert chat(tools=[WEATHER], tool_choice="none").tools.mode is ToolMode.NONE
    required = chat(tools=[WEATHER], tool_choice="required")
    assert required.tools.mode is ToolMode.REQUIRED
    assert json.loads(required.params.structured.spec)["type"] == "array"
    named = chat(tools=[WEATHER], tool_choice={"type": "function",
                                               "function": {"name": "get_weather"}})
    assert named.tools.mode is ToolMode.NAMED
    assert json.loads(named.params.structured.spec)["required"] == ["city"]
    assert chat(AUTO, tools=[WEATHER]).tools.mode is ToolMode.AUTO  # the default with tools
    assert param_of(chat, tools=[WEATHER]) == "tool_choice"  # auto needs the server flags
    assert param_of(chat, tool_choice="required") == "tool_choice"  # no tools
    assert param_of(chat, tools=[WEATHER], tool_choice={"type": "function",
                                                        "function": {"name": "nope"}}) == \
        "tool_choice"
    assert param_of(chat, tools=[{"type": "function"}]) == "tools"
    assert param_of(chat, tools=[WEATHER], tool_choice="required",
                    response_format={"type": "json_object"}) == "tool_choice"


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


@pytest.mark.parametrize("ids, max_tokens, match", [
    ([], None, "empty"), ([1, 512], None, "out of vocabulary"),
    ([-1], None, "out of vocabulary"),
    ([3] * 128, None, "maximum context length is 128 tokens. However, your request has 128"),
    ([3] * 100, 50, "maximum context length is 128"),
])
def test_prompt_ids_must_fit_the_model(ids, max_tokens, match):
    with pytest.raises(RequestError, match=match) as err:
        check_prompt_ids(ids, MODEL, "prompt", max_tokens)
    assert err.value.param == "prompt"


@pytest.mark.parametrize("fields, want", [
    ({}, None), ({"truncate_prompt_tokens": 4}, Truncation(4, True)),
    ({"truncate_prompt_tokens": 4, "truncation_side": "right"}, Truncation(4, False)),
    ({"truncate_prompt_tokens": -1}, Truncation(128, True)),  # -1: the model's context
])
def test_prompt_truncation_as_vllm_takes_it(fields, want):
    assert completion(**fields).truncation == want
    assert chat(**fields).truncation == want


def test_truncation_keeps_the_chosen_side():
    ids = list(range(8))
    assert Truncation(4, left=True).apply(ids) == [4, 5, 6, 7]
    assert Truncation(4, left=False).apply(ids) == [0, 1, 2, 3]
    assert Truncation(10).apply(ids) == ids


@pytest.mark.parametrize("fields, param", [
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 4, "truncation_side": "middle"}, "truncation_side"),
])
def test_bad_truncation_is_a_400_naming_the_field(fields, param):
    assert param_of(completion, **fields) == param


def test_max_logprobs_lowers_the_logprob_limits():
    model = ServedModel(id="tiny", max_model_len=128, vocab_size=512, created=1,
                        max_logprobs=2)
    parse_completion({"prompt": "hi", "logprobs": 2}, model)
    for body in ({"prompt": "hi", "logprobs": 3}, {"prompt": "hi", "prompt_logprobs": 3}):
        with pytest.raises(RequestError, match="less than or equal to 2"):
            parse_completion(body, model)
    with pytest.raises(RequestError, match="less than or equal to 2"):
        parse_chat({"messages": USER, "logprobs": True, "top_logprobs": 3}, model)


def test_allowed_token_ids_and_bad_words_are_read_and_checked():
    req = completion(allowed_token_ids=[1, 2], bad_words=["foo", " "])
    assert req.params.allowed_token_ids == (1, 2) and req.bad_words == ("foo",)
    assert chat(bad_words=["x"]).bad_words == ("x",)
    for fields in ({"allowed_token_ids": []}, {"allowed_token_ids": [600]},
                   {"allowed_token_ids": "1"}):
        assert param_of(completion, **fields) == "allowed_token_ids"
    assert param_of(completion, bad_words=[1]) == "bad_words"


def test_bad_words_are_tokenized_as_vllm_does(tmp_path):
    from pdserve.demo_model import write_tokenizer_files
    from pdserve.tokenizer import Tokenizer
    from router.openai.generation import bad_words_token_ids

    tok = Tokenizer.from_pretrained(write_tokenizer_files(tmp_path, 512))
    seqs = bad_words_token_ids(tok, ["hello"])
    assert seqs[0] == tuple(tok.encode("hello", add_special_tokens=False))
    for seq in seqs[1:]:  # the mid-text spelling, when it differs
        assert seq == tuple(tok.encode(" hello", add_special_tokens=False))


def test_priority_zero_is_fcfs_and_any_other_is_vllms_400():
    completion(priority=0)
    with pytest.raises(RequestError, match="Priority scheduling is not enabled") as err:
        chat(priority=5)
    assert err.value.param == "priority"


def test_max_tokens_beyond_the_context_is_vllms_message():
    for fn, field in ((completion, "max_tokens"), (chat, "max_completion_tokens")):
        with pytest.raises(RequestError, match="is too large: 129. This model's maximum "
                                               "context length is 128 tokens") as err:
            fn(**{field: 129})
        assert err.value.param == field
