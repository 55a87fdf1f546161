"""Response shaping: usage, both logprobs formats, completion and chat objects and chunks."""

from __future__ import annotations

import math

from pdserve.proto import pb
from router.frontend import OutputChunk, Usage
from router.openai.chat import ChatShaper
from router.openai.completions import CompletionShaper, PromptView
from router.openai.responses import (
    LOGPROB_FLOOR,
    chat_logprobs,
    completion_logprobs,
    joined,
    models_json,
    prompt_logprobs_json,
    usage_json,
)
from router.openai.schemas import ServedModel, parse_chat, parse_completion
from router.openai.tools import ToolConfig, output_parser

TEXT = {5: "he", 6: "llo", 7: " wé", 8: "x"}
text_of = TEXT.__getitem__


def lp(token_id: int, logprob: float, *top: tuple[int, float]) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=token_id, logprob=logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def test_usage_adds_up_and_reports_cached_tokens_when_asked():
    assert usage_json(Usage(10, 4, 8)) == {
        "prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
        "prompt_tokens_details": None}
    assert usage_json(Usage(10, 4, 8), details=True)["prompt_tokens_details"] == {
        "cached_tokens": 8}


def test_models_list_has_vllms_fields():
    body = models_json(ServedModel("tiny", 128, 512, 7, root="/models/tiny"))
    (card,) = body["data"]
    assert body["object"] == "list"
    assert card == {"id": "tiny", "object": "model", "created": 7, "owned_by": "pdserve",
                    "root": "/models/tiny", "parent": None, "max_model_len": 128,
                    "permission": []}


def test_completion_logprobs_offsets_and_top():
    out = completion_logprobs([lp(5, -0.5, (6, -0.25), (5, -0.5)), lp(6, -1.0)], text_of, 3)
    assert out["tokens"] == ["he", "llo"]
    assert out["token_logprobs"] == [-0.5, -1.0]
    assert out["text_offset"] == [3, 5]
    assert out["top_logprobs"] == [{"llo": -0.25, "he": -0.5}, {"llo": -1.0}]


def test_completion_top_logprobs_start_with_the_chosen_token():
    # vLLM's clients read the chosen token as the first key, also when it is not the top.
    out = completion_logprobs([lp(7, -2.0, (5, -0.1), (6, -0.2))], text_of, 0, top_n=2)
    assert list(out["top_logprobs"][0]) == [" wé", "he", "llo"]
    assert out["top_logprobs"][0][" wé"] == -2.0


def test_chat_logprobs_carry_bytes_and_alternatives():
    out = chat_logprobs([lp(7, -0.125, (8, -2.0))], text_of)
    assert out == {"refusal": None, "content": [{
        "token": " wé", "logprob": -0.125, "bytes": [32, 119, 195, 169],
        "top_logprobs": [{"token": "x", "logprob": -2.0, "bytes": [120]}]}]}


def test_infinite_logprobs_become_a_json_number():
    out = chat_logprobs([lp(5, -math.inf, (6, math.nan))], text_of)
    assert out["content"][0]["logprob"] == LOGPROB_FLOOR
    assert out["content"][0]["top_logprobs"][0]["logprob"] == LOGPROB_FLOOR


def test_joined_concatenates_and_keeps_the_last_finish():
    whole = joined([OutputChunk([5], "he", [lp(5, -1.0)]), OutputChunk([6, 7], "llo w"),
                    OutputChunk([], "é", [], "length", Usage(3, 3, 0))])
    assert (whole.token_ids, whole.text, whole.finish_reason) == ([5, 6, 7], "hello wé", "length")
    assert len(whole.logprobs) == 1 and whole.usage == Usage(3, 3, 0)


MODEL = ServedModel("tiny", 128, 512, 100)


def completion_shaper(**fields):
    req = parse_completion({"model": "tiny", "prompt": [5], **fields}, MODEL)
    return CompletionShaper("cmpl-1", 100, "tiny", text_of, req, [PromptView([5], "he")],
                            False)


def test_completion_body_shape():
    body = completion_shaper().body(
        [OutputChunk([5, 6], "hello", [], "stop", Usage(2, 2, 0))], Usage(2, 2, 0))
    assert body == {
        "id": "cmpl-1", "object": "text_completion", "created": 100, "model": "tiny",
        "choices": [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "stop",
                     "stop_reason": None, "prompt_logprobs": None}],
        "usage": usage_json(Usage(2, 2, 0)), "system_fingerprint": None}


def test_completion_chunks_skip_empty_ones_and_keep_offsets():
    s = completion_shaper(logprobs=0)
    assert s.head() == []
    first = s.chunk(OutputChunk([5], "he", [lp(5, -1.0)]))
    assert first["choices"][0]["text"] == "he"
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    second = s.chunk(OutputChunk([6], "llo", [lp(6, -1.0)], "stop", Usage(1, 2, 0)))
    assert second["choices"][0]["logprobs"]["text_offset"] == [2]
    assert second["choices"][0]["finish_reason"] == "stop"  # on the last content chunk
    s_plain = completion_shaper()
    s_plain.chunk(OutputChunk([5], "h", []))
    assert s_plain.chunk(OutputChunk([5], "", [])) is None  # partial character: nothing yet
    last = s_plain.chunk(OutputChunk([], "", [], "length", Usage(1, 1, 0)))
    assert last["choices"][0]["finish_reason"] == "length"
    usage = s_plain.usage_chunk(Usage(1, 1, 0))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 2


def test_completion_echo_with_logprobs_scores_the_prompt():
    s = completion_shaper(echo=True, logprobs=1, max_tokens=1)
    plp = [lp(6, -0.5, (6, -0.5), (7, -1.0)), lp(7, -2.0, (8, -0.125))]
    s._views[0] = PromptView([5, 6, 7], "hello wé")
    body = s.body([OutputChunk([8], "x", [lp(8, -0.25)], "length", Usage(3, 1, 0), 0, plp)],
                  Usage(3, 1, 0))
    (choice,) = body["choices"]
    assert choice["text"] == "hello wéx"
    lps = choice["logprobs"]
    assert lps["tokens"] == ["he", "llo", " wé", "x"]
    assert lps["token_logprobs"] == [None, -0.5, -2.0, -0.25]
    assert lps["top_logprobs"][0] is None
    assert lps["top_logprobs"][2] == {"x": -0.125, " wé": -2.0}
    assert lps["text_offset"] == [0, 2, 5, 8]


def test_completion_echo_with_no_tokens_to_generate():
    s = completion_shaper(echo=True, max_tokens=0)
    body = s.body([OutputChunk([8], "x", [], "length", Usage(1, 1, 0))], Usage(1, 1, 0))
    assert body["choices"][0]["text"] == "he" and body["usage"]["completion_tokens"] == 0


def test_prompt_logprobs_are_vllms_shape():
    plp = [lp(6, -0.5, (6, -0.5), (7, -1.0)), lp(7, -2.0, (8, -0.125))]
    plp[1].rank = 3
    out = prompt_logprobs_json(plp, text_of, 1)
    assert out == [None, {"6": {"logprob": -0.5, "rank": 1, "decoded_token": "llo"}},
                   {"7": {"logprob": -2.0, "rank": 3, "decoded_token": " wé"},
                    "8": {"logprob": -0.125, "rank": 1, "decoded_token": "x"}}]
    # The prompt's token leads its entry even when it is among the top ones (vLLM's order).
    (entry,) = prompt_logprobs_json([lp(7, -1.0, (6, -0.5), (7, -1.0))], text_of, 2)[1:]
    assert list(entry) == ["7", "6"] and entry["7"]["rank"] == 2


def chat_shaper(logprobs=False, **fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    if logprobs:
        body["logprobs"] = True
    req = parse_chat(body, MODEL)
    return ChatShaper("chatcmpl-1", 100, "tiny", text_of, req, [1, 2],
                      lambda: output_parser(req.tools, ToolConfig()), False)


def test_chat_stream_starts_with_the_role_then_content_deltas():
    s = chat_shaper()
    ((head, index),) = s.head()
    assert index == 0 and head["object"] == "chat.completion.chunk"
    assert head["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}]
    mid = s.chunk(OutputChunk([5], "he"))
    assert mid["choices"][0]["delta"] == {"content": "he"}
    end = s.chunk(OutputChunk([6], "llo", [], "stop", Usage(1, 2, 0)))
    assert end["choices"][0]["delta"] == {"content": "llo"}
    assert end["choices"][0]["finish_reason"] == "stop"


def test_chat_body_shape_with_logprobs():
    s = chat_shaper(logprobs=True)
    body = s.body([OutputChunk([5], "he", [lp(5, -1.0)], "length", Usage(4, 1, 0))],
                  Usage(4, 1, 0))
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "he", "refusal": None,
                                 "annotations": None, "audio": None, "function_call": None,
                                 "tool_calls": None, "reasoning_content": None}
    assert choice["finish_reason"] == "length"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["he"]
    assert body["usage"]["prompt_tokens"] == 4


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_a_required_tool_call_becomes_tool_calls():
    s = chat_shaper(tools=[WEATHER], tool_choice="required")
    out = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    body = s.body([OutputChunk([5], out, [], "stop", Usage(1, 1, 0))], Usage(1, 1, 0))
    (choice,) = body["choices"]
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == ""
    cut = s.body([OutputChunk([5], out[:30], [], "length", Usage(1, 1, 0))], Usage(1, 1, 0))
    assert cut["choices"][0]["message"]["tool_calls"] is None  # cut short: no call
    assert cut["choices"][0]["message"]["content"] == ""


def test_a_named_tool_call_streams_its_arguments():
    s = chat_shaper(tools=[WEATHER], tool_choice={"type": "function",
                                                  "function": {"name": "get_weather"}})
    deltas = [s.chunk(OutputChunk([5], piece)) for piece in ('{"ci', 'ty": "Pa', 'ris"}')]
    calls = [d["choices"][0]["delta"]["tool_calls"] for d in deltas]
    assert calls[0][0]["function"]["name"] == "get_weather" and calls[0][0]["id"]
    assert "".join(c[0]["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
