"""vLLM's server flags over the scripted frontend: --root-path, --enable-force-include-usage,
--return-tokens-as-token-ids, the API keys the router takes from its environment; and vLLM's
batched chat endpoint."""

from __future__ import annotations

import json

from pdserve.proto import pb
from router.__main__ import api_tokens
from router.frontend import OutputChunk, Usage
from router.openai.server import ApiOptions
from tests.router.test_openai_server import post, post_stream, serve, tokenizer  # noqa: F401

BODY = {"model": "tiny", "prompt": "x", "max_tokens": 2}


def test_root_path_serves_both_paths_and_keeps_auth(tokenizer):  # noqa: F811
    key = {"Authorization": "Bearer k"}

    async def scenario(s, u, f):
        plain = await post(s, f"{u}/v1/completions", BODY, key)
        rooted = await post(s, f"{u}/llm/v1/completions", BODY, key)
        refused = await post(s, f"{u}/llm/v1/completions", BODY)
        async with s.get(f"{u}/llm/health") as r:  # probes stay open under the prefix
            health = r.status
        return plain[0], rooted[0], refused[0], health

    got, _ = serve(tokenizer, scenario=scenario, tokens=("k",), root_path="/llm/")
    assert got == (200, 200, 401, 200)


def test_force_include_usage_puts_usage_on_every_chunk(tokenizer):  # noqa: F811
    body = {**BODY, "stream": True}  # no stream_options at all
    events, _ = serve(tokenizer, scenario=lambda s, u, f: post_stream(
        s, f"{u}/v1/completions", body), api=ApiOptions(force_include_usage=True))
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 2]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 5


def test_tokens_as_ids_from_the_server_flag(tokenizer):  # noqa: F811
    lp = pb.TokenLogprob(token_id=76, logprob=-0.5, top=[pb.TopLogprob(token_id=76,
                                                                      logprob=-0.5)])
    script = [OutputChunk([76], "llo", [lp], "length", Usage(1, 1, 0))]
    (status, out, _), _ = serve(tokenizer, script, scenario=lambda s, u, f: post(
        s, f"{u}/v1/completions", {**BODY, "logprobs": 1}),
        api=ApiOptions(tokens_as_ids=True))
    assert status == 200
    assert out["choices"][0]["logprobs"]["tokens"] == ["token_id:76"]


def test_api_keys_come_from_pdserves_and_vllms_variables():
    assert api_tokens({}) == ()
    assert api_tokens({"VLLM_API_KEY": "v"}) == ("v",)
    assert api_tokens({"PDSERVE_AUTH_TOKENS": "a,b", "VLLM_API_KEY": "a"}) == ("a", "b")


def test_batched_chat_answers_one_choice_per_conversation(tokenizer):  # noqa: F811
    convs = [[{"role": "user", "content": "alpha"}], [{"role": "user", "content": "beta"}]]
    body = {"model": "tiny", "messages": convs, "max_tokens": 2}
    (status, out, _), fe = serve(tokenizer, scenario=lambda s, u, f: post(
        s, f"{u}/v1/chat/completions/batch", body))
    assert status == 200 and out["object"] == "chat.completion"
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert [c["message"]["content"] for c in out["choices"]] == ["hello", "hello"]
    assert out["usage"]["prompt_tokens"] == 6  # each conversation's prompt counted once
    assert [r.prompt_token_ids for r in fe.requests] == [tokenizer.encode_chat(c)
                                                         for c in convs]
    for bad in ({**body, "stream": True}, {**body, "messages": [[]]}, {**body, "n": 2},
                {**body, "messages": "hi"}):
        (status, err, _), _ = serve(tokenizer, scenario=lambda s, u, f, b=bad: post(
            s, f"{u}/v1/chat/completions/batch", b))
        assert status == 400, bad
