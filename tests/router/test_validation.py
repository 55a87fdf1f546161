"""One set of request limits for both public APIs: the byte bound on text before tokenising
(sound: no text that fits the context is refused), the transport limits derived from it, and
the checks on sampling fields gRPC and HTTP share."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.demo_model import write_tokenizer_files
from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pb
from pdserve.tokenizer import Tokenizer
from router.validation import (
    RequestError,
    RequestLimits,
    check_generate,
    check_params,
    check_text,
)

LIMITS = RequestLimits(max_model_len=128, vocab_size=512, max_token_bytes=4)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(write_tokenizer_files(tmp_path_factory.mktemp("tok"), 512))


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1, max_size=400))
def test_the_text_bound_never_refuses_a_text_that_fits(tokenizer, text):
    limits = RequestLimits(32, 512, tokenizer.max_token_bytes)  # small: the bound is reached
    try:
        check_text(text, limits, "prompt")
    except RequestError:
        assert len(tokenizer.encode(text)) >= limits.max_model_len, "refused a text that fits"


def test_text_over_the_bound_is_refused_without_tokenising():
    with pytest.raises(RequestError, match="longer than 512 bytes") as err:
        check_text("é" * 257, LIMITS, "prompt")  # 514 bytes in 257 characters
    assert err.value.param == "prompt"
    check_text("é" * 256, LIMITS, "prompt")
    with pytest.raises(RequestError, match="longer than"):
        check_text("x" * 50_000_000, LIMITS, "prompt")  # refused on its length alone


def test_text_that_is_not_unicode_is_refused():
    with pytest.raises(RequestError, match="not valid Unicode"):
        check_text("a\ud800b", LIMITS, "prompt")


def test_transport_limits_leave_room_for_any_valid_request():
    assert LIMITS.max_message_bytes > LIMITS.max_prompt_bytes
    assert LIMITS.max_message_bytes > 5 * LIMITS.max_model_len  # varint token ids
    assert LIMITS.max_body_bytes > 6 * LIMITS.max_prompt_bytes  # worst-case JSON escapes


@pytest.mark.parametrize("params, field", [
    (SamplingParams(max_tokens=129), "max_tokens"),
    (SamplingParams(stop=["x"] * 17), "stop"),
    (SamplingParams(stop=["x" * 1025]), "stop"),
    (SamplingParams(stop_token_ids=[1] * 1025), "stop_token_ids"),
    (SamplingParams(stop_token_ids=[512]), "stop_token_ids"),
    (SamplingParams(top_k=2**31), "top_k"),
])
def test_sampling_limits(params, field):
    with pytest.raises(RequestError) as err:
        check_params(params, LIMITS)
    assert err.value.param == field


def test_grpc_and_http_refuse_the_same_max_tokens():
    from router.openai.schemas import ServedModel, parse_completion

    req = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=10**9))
    with pytest.raises(RequestError, match="max_tokens must be <= the model's context"):
        check_generate(req, LIMITS, "tiny")
    model = ServedModel("tiny", LIMITS.max_model_len, LIMITS.vocab_size, 0)
    # The same limit over HTTP, in vLLM's words (its clients match on them).
    with pytest.raises(RequestError, match="'max_tokens' or 'max_completion_tokens' is too "
                                           "large") as err:
        parse_completion({"prompt": "hi", "max_tokens": 10**9}, model)
    assert err.value.param == "max_tokens"
    parse_completion({"prompt": "hi", "max_tokens": LIMITS.max_model_len}, model)


def test_grpc_request_checks_name_the_field():
    for req, match in [
        (pb.GenerateRequest(), "prompt must be set"),
        (pb.GenerateRequest(text=""), "must not be empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "must not be empty"),
        (pb.GenerateRequest(text="x", request_id="a b"), "request_id"),
        (pb.GenerateRequest(text="x", model="other"), "not served here"),
        (pb.GenerateRequest(text="x", sampling=pb.SamplingParams(top_p=0)), "top_p"),
    ]:
        with pytest.raises(RequestError, match=match):
            check_generate(req, LIMITS, "tiny")
    ok = check_generate(pb.GenerateRequest(text="hello"), LIMITS, "tiny")
    assert ok.text == "hello" and ok.token_ids is None
