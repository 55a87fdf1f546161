"""vLLM's OpenAI-server behaviour where pdserve had differed, with the official `openai` client
against `pdserve up` on the real default model (the session's shared server,
tests/e2e/conftest.py): beam search, the chosen token first in completion logprobs,
truncation sides, vLLM's error messages, --root-path, allowed_token_ids and bad_words (with
speculation on), stop_reason, string delta contents, the batched chat endpoint. Short
outputs: this file is lean (about 10 s beside the shared server's start)."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from pdserve.default_model import MODEL_ID
from pdserve.tokenizer import Tokenizer
from tests.e2e.conftest import ROOT_PATH

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def api(real_openai_server):
    with openai.OpenAI(base_url=f"{real_openai_server['http']}/v1", api_key="unused",
                       max_retries=0, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return Tokenizer.from_pretrained(default_model)


def test_beam_search_returns_the_n_best_beams_per_prompt(api):
    # vLLM's own check: two copies of a prompt give the same beams, and the beams differ.
    out = api.completions.create(model=MODEL_ID, prompt=["Hello, my name is"] * 2, n=2,
                                 max_tokens=5, temperature=0,
                                 extra_body={"use_beam_search": True,
                                             "return_token_ids": True})
    texts = [c.text for c in out.choices]
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert texts[0] != texts[1] and texts[:2] == texts[2:]
    assert all(c.finish_reason in ("stop", "length") for c in out.choices)
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices)
    # Streamed: each beam arrives whole, with its finish reason, then [DONE].
    chunks = list(api.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "What is 1+1?"}], n=2,
        max_tokens=4, stream=True, extra_body={"use_beam_search": True}))
    ends = {c.choices[0].index: c.choices[0].finish_reason for c in chunks
            if c.choices and c.choices[0].finish_reason}
    assert set(ends) == {0, 1}


def test_completion_top_logprobs_lead_with_the_chosen_token(api, tokenizer):
    # An echoed prompt's tokens are rarely the model's top choice: the chosen token must
    # still be the first key (vLLM's clients read it so), tokens named as ids.
    out = api.completions.create(model=MODEL_ID, prompt="Say 'Hello, world! 🎉'", echo=True,
                                 max_tokens=4, temperature=0, logprobs=1,
                                 extra_body={"return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    assert lp.top_logprobs[0] is None
    assert lp.tokens[1:] == [next(iter(top)) for top in lp.top_logprobs[1:]]
    ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
    assert tokenizer.decode(ids, skip_special_tokens=True) == out.choices[0].text


@pytest.mark.parametrize("side, kept", [("left", slice(4, 8)), ("right", slice(0, 4))])
def test_truncation_side_picks_which_prompt_tokens_stay(api, side, kept):
    ids = list(range(20, 28))
    out = api.completions.create(model=MODEL_ID, prompt=ids, max_tokens=1, temperature=0,
                                 extra_body={"return_token_ids": True,
                                             "truncate_prompt_tokens": 4,
                                             "truncation_side": side})
    assert out.choices[0].prompt_token_ids == ids[kept]


def test_vllms_error_messages(api):
    with pytest.raises(openai.BadRequestError,
                       match="Either prompt or prompt_embeds must be provided and non-empty"):
        api.completions.create(model=MODEL_ID, prompt=None, max_tokens=5,
                               extra_body={"prompt_embeds": []})
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048 tokens"):
        api.completions.create(model=MODEL_ID, prompt=[20] * 2048, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 2048 tokens"):
        api.completions.create(model=MODEL_ID, prompt="hi", max_tokens=2048)


def test_root_path_serves_the_api_under_its_prefix(real_openai_server):
    url = f"{real_openai_server['http']}{ROOT_PATH}/v1/models"
    with urllib.request.urlopen(url, timeout=60) as resp:
        assert json.loads(resp.read())["data"][0]["id"] == MODEL_ID
    with openai.OpenAI(base_url=f"{real_openai_server['http']}{ROOT_PATH}/v1",
                       api_key="unused", max_retries=0, timeout=120) as client:
        out = client.completions.create(model=MODEL_ID, prompt="Hi", max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_allowed_token_ids_and_bad_words_hold_under_speculation(api):
    prompt = "The capital of France is"
    out = api.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=3, temperature=0,
                                 extra_body={"allowed_token_ids": [11, 12, 13],
                                             "return_token_ids": True})
    assert set(out.choices[0].token_ids) <= {11, 12, 13}
    plain = api.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=3, temperature=0)
    assert "Paris" in plain.choices[0].text
    banned = api.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=3, temperature=0,
                                    extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in banned.choices[0].text


def test_stop_reason_and_string_contents_as_vllm_sends_them(api):
    out = api.completions.create(model=MODEL_ID, prompt="The capital of France is",
                                 max_tokens=8, temperature=0, stop=["."])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == "."
    # Every delta of a stream without tool calls has a string content ("" included).
    stream = api.chat.completions.create(
        model=MODEL_ID, messages=[{"role": "user", "content": "Say hi"}], max_tokens=3,
        stream=True, stream_options={"include_usage": True})
    text = "".join(c.choices[0].delta.content for c in stream if c.choices)
    assert text


def test_batched_chat_answers_each_conversation(real_openai_server):
    body = {"model": MODEL_ID, "max_tokens": 3, "temperature": 0, "messages": [
        [{"role": "user", "content": "Reply with the word alpha"}],
        [{"role": "user", "content": "Reply with the word beta"}]]}
    req = urllib.request.Request(f"{real_openai_server['http']}/v1/chat/completions/batch",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        out = json.loads(resp.read())
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["message"]["content"] for c in out["choices"])
