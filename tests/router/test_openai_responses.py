"""Response shaping: usage, both logprobs formats, completion and chat objects and chunks."""

from __future__ import annotations

import math

from pdserve.proto import pb
from router.frontend import OutputChunk, Usage
from router.openai.chat import ChatShaper
from router.openai.completions import CompletionShaper
from router.openai.responses import (
    LOGPROB_FLOOR,
    chat_logprobs,
    completion_logprobs,
    joined,
    models_json,
    usage_json,
)
from router.openai.schemas import ServedModel

TEXT = {5: "he", 6: "llo", 7: " wé", 8: "x"}
text_of = TEXT.__getitem__


def lp(token_id: int, logprob: float, *top: tuple[int, float]) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=token_id, logprob=logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def test_usage_adds_up_and_reports_cached_tokens():
    assert usage_json(Usage(10, 4, 8)) == {
        "prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 8}}


def test_models_list():
    body = models_json(ServedModel("tiny", 128, 512, 7))
    assert body == {"object": "list", "data": [{"id": "tiny", "object": "model", "created": 7,
                                                 "owned_by": "pdserve", "max_model_len": 128}]}


def test_completion_logprobs_offsets_and_top():
    out = completion_logprobs([lp(5, -0.5, (6, -0.25), (5, -0.5)), lp(6, -1.0)], text_of, 3)
    assert out["tokens"] == ["he", "llo"]
    assert out["token_logprobs"] == [-0.5, -1.0]
    assert out["text_offset"] == [3, 5]
    assert out["top_logprobs"] == [{"llo": -0.25, "he": -0.5}, {"llo": -1.0}]


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


def completion_shaper(logprobs=False):
    return CompletionShaper("cmpl-1", 100, "tiny", text_of, logprobs)


def test_completion_body_shape():
    body = completion_shaper().body(OutputChunk([5, 6], "hello", [], "stop", Usage(2, 2, 0)))
    assert body == {
        "id": "cmpl-1", "object": "text_completion", "created": 100, "model": "tiny",
        "choices": [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": "stop"}],
        "usage": usage_json(Usage(2, 2, 0))}


def test_completion_chunks_skip_empty_ones_and_keep_offsets():
    s = completion_shaper(logprobs=True)
    assert s.head() == []
    first = s.chunk(OutputChunk([5], "he", [lp(5, -1.0)]))
    assert first["choices"][0]["text"] == "he"
    assert first["choices"][0]["logprobs"]["text_offset"] == [0]
    second = s.chunk(OutputChunk([6], "llo", [lp(6, -1.0)]))
    assert second["choices"][0]["logprobs"]["text_offset"] == [2]
    end = s.chunk(OutputChunk([], "", [], "stop", Usage(1, 2, 0)))
    assert end["choices"][0]["logprobs"] is None  # no tokens in this chunk
    s_plain = completion_shaper()
    assert s_plain.chunk(OutputChunk([5], "", [])) is None  # partial character: nothing yet
    last = s_plain.chunk(OutputChunk([], "", [], "length", Usage(1, 1, 0)))
    assert last["choices"][0]["finish_reason"] == "length"
    usage = s_plain.usage_chunk(Usage(1, 1, 0))
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 2


def test_chat_stream_starts_with_the_role_then_content_deltas():
    s = ChatShaper("chatcmpl-1", 100, "tiny", text_of, False)
    (head,) = s.head()
    assert head["object"] == "chat.completion.chunk"
    assert head["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None}]
    mid = s.chunk(OutputChunk([5], "he"))
    assert mid["choices"][0]["delta"] == {"content": "he"}
    end = s.chunk(OutputChunk([], "", [], "stop", Usage(1, 1, 0)))
    assert end["choices"][0]["delta"] == {} and end["choices"][0]["finish_reason"] == "stop"
    assert s.chunk(OutputChunk([6], "")) is None


def test_chat_body_shape_with_logprobs():
    s = ChatShaper("chatcmpl-1", 100, "tiny", text_of, True)
    body = s.body(OutputChunk([5], "he", [lp(5, -1.0)], "length", Usage(4, 1, 0)))
    assert body["object"] == "chat.completion"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": "he", "refusal": None}
    assert choice["finish_reason"] == "length"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["he"]
    assert body["usage"]["prompt_tokens"] == 4
