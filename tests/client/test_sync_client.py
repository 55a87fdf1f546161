"""The blocking Client against a real gRPC server on loopback (see conftest.FakePDServe)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.client import (
    Cancelled,
    Chunk,
    Client,
    Completion,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    ModelCard,
    PDServeError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    Usage,
)
from tests.client.fake_pdserve import FakeServer

pytestmark = pytest.mark.timeout(60)

FAST_RETRY = {"initial_backoff_s": 0.001, "max_backoff_s": 0.002}


@pytest.fixture
def client(fake: FakeServer):
    with Client(fake.target, **FAST_RETRY) as c:
        yield c


def test_generate_text_prompt_echoes_and_reports_usage(client: Client, fake: FakeServer):
    completion = client.generate("hello world", max_tokens=5, request_id="req-1")
    assert completion == Completion(
        request_id="req-1",
        token_ids=[ord(c) for c in "hello"],
        text="hello",
        finish_reason="length",
        usage=Usage(prompt_tokens=11, completion_tokens=5, cached_tokens=1),
        logprobs=None,
    )
    assert fake.servicer.requests[0].text == "hello world"


def test_generate_token_prompt_with_logprobs(client: Client):
    completion = client.generate([5, 6, 7], max_tokens=10, logprobs=2)
    assert completion.token_ids == [5, 6, 7]
    assert completion.text == "<5><6><7>"
    assert completion.finish_reason == "stop"
    assert completion.logprobs is not None
    assert [lp.token_id for lp in completion.logprobs] == [5, 6, 7]
    assert [[t.token_id for t in lp.top] for lp in completion.logprobs] == [[5, 6], [6, 7], [7, 8]]


def test_generate_assigns_a_request_id_when_none_is_given(client: Client, fake: FakeServer):
    completion = client.generate("ab")
    assert completion.request_id and fake.servicer.requests[0].request_id == completion.request_id


def test_sampling_arguments_reach_the_server_and_unset_ones_stay_unset(client, fake):
    client.generate("x", temperature=0.0, seed=2**63, stop="END", stop_token_ids=[2], top_k=-1)
    sampling = fake.servicer.requests[0].sampling
    assert sampling.HasField("temperature") and sampling.temperature == 0.0
    assert not sampling.HasField("top_p") and not sampling.HasField("logprobs")
    assert sampling.max_tokens == 16 and sampling.seed == 2**63 and sampling.top_k == -1
    assert list(sampling.stop) == ["END"] and list(sampling.stop_token_ids) == [2]


def test_stream_yields_chunks_that_add_up_to_the_completion(client: Client):
    chunks = list(client.stream("abcde", max_tokens=16, request_id="s"))
    assert [c.token_ids for c in chunks] == [[97, 98], [99, 100], [101], []]
    assert [c.finish_reason for c in chunks] == [None, None, None, "stop"]
    assert [c.usage for c in chunks[:-1]] == [None, None, None]
    assert chunks[-1] == Chunk(
        request_id="s",
        token_ids=[],
        text="",
        logprobs=None,
        finish_reason="stop",
        usage=Usage(prompt_tokens=5, completion_tokens=5, cached_tokens=1),
    )
    assert "".join(c.text for c in chunks) == client.generate("abcde").text


@pytest.mark.parametrize(
    ("code", "error_class"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.CANCELLED, Cancelled),
        (grpc.StatusCode.UNAUTHENTICATED, Unauthenticated),
        (grpc.StatusCode.INTERNAL, Internal),
        (grpc.StatusCode.NOT_FOUND, PDServeError),
    ],
)
def test_server_status_maps_to_its_exception_and_is_not_retried(client, fake, code, error_class):
    fake.servicer.fail_before_output = [code] * 4
    with pytest.raises(PDServeError) as caught:
        client.generate("hi")
    assert type(caught.value) is error_class
    assert caught.value.code == code
    assert str(caught.value) == f"{code.name}: scripted {code.name}"
    assert fake.servicer.calls == 1


def test_unavailable_is_retried_until_success(client: Client, fake: FakeServer):
    fake.servicer.fail_before_output = [grpc.StatusCode.UNAVAILABLE] * 3
    assert client.generate("ok").text == "ok"
    assert fake.servicer.calls == 4
    assert len({r.request_id for r in fake.servicer.requests}) == 1  # one id across retries


def test_unavailable_gives_up_after_max_retries(fake: FakeServer):
    fake.servicer.fail_before_output = [grpc.StatusCode.UNAVAILABLE] * 10
    with Client(fake.target, max_retries=2, **FAST_RETRY) as client:
        with pytest.raises(Unavailable):
            client.generate("ok")
    assert fake.servicer.calls == 3


def test_no_retry_when_the_backoff_would_outlast_the_deadline(fake: FakeServer):
    fake.servicer.fail_before_output = [grpc.StatusCode.UNAVAILABLE] * 10
    with Client(fake.target, initial_backoff_s=30, max_backoff_s=30) as client:
        with pytest.raises(Unavailable):
            client.generate("ok", timeout=5)
    assert fake.servicer.calls == 1


def test_stream_retries_unavailable_before_the_first_chunk(client: Client, fake: FakeServer):
    fake.servicer.fail_before_output = [grpc.StatusCode.UNAVAILABLE]
    assert "".join(c.text for c in client.stream("abc")) == "abc"
    assert fake.servicer.calls == 2


def test_stream_is_not_retried_after_a_chunk_was_received(client: Client, fake: FakeServer):
    fake.servicer.fail_after_first_chunk = [grpc.StatusCode.UNAVAILABLE]
    received = []
    with pytest.raises(Unavailable):
        for chunk in client.stream("abcdef"):
            received.append(chunk)
    assert [c.text for c in received] == ["ab"]
    assert fake.servicer.calls == 1


def test_generate_restarts_cleanly_after_unavailable_mid_stream(client, fake):
    fake.servicer.fail_after_first_chunk = [grpc.StatusCode.UNAVAILABLE]
    completion = client.generate("abcdef")
    assert completion.text == "abcdef" and completion.token_ids == [ord(c) for c in "abcdef"]
    assert fake.servicer.calls == 2


def test_deadline_raises_deadline_exceeded(client: Client, fake: FakeServer):
    fake.servicer.stall_after_first_chunk = True
    with pytest.raises(DeadlineExceeded):
        client.generate("abcdef", timeout=0.3)
    assert fake.servicer.ended_early.wait(timeout=10)


def test_client_default_timeout_applies_to_every_call(fake: FakeServer):
    fake.servicer.stall_before_output = True
    with Client(fake.target, timeout=0.3) as client:
        with pytest.raises(DeadlineExceeded):
            list(client.stream("abc"))
    assert fake.servicer.calls == 1


def test_leaving_a_stream_early_cancels_the_request_on_the_server(client, fake):
    fake.servicer.stall_after_first_chunk = True
    stream = client.stream("abcdef")
    assert next(stream).text == "ab"
    stream.close()
    assert fake.servicer.ended_early.wait(timeout=10)


def test_bearer_token_is_sent_on_every_call(fake: FakeServer):
    fake.servicer.required_token = "s3cret"
    with Client(fake.target, token="s3cret") as client:
        client.generate("a")
        list(client.stream("a"))
        client.list_models()
    assert [m["authorization"] for m in fake.servicer.metadata] == ["Bearer s3cret"] * 3


@pytest.mark.parametrize("token", [None, "wrong"])
def test_missing_or_wrong_token_is_unauthenticated(fake: FakeServer, token):
    fake.servicer.required_token = "s3cret"
    with Client(fake.target, token=token) as client:
        with pytest.raises(Unauthenticated):
            client.generate("a")


def test_list_models(client: Client):
    assert client.list_models() == [
        ModelCard(id="tiny-llama", max_model_len=2048, owned_by="pdserve")
    ]


def test_stream_ending_without_finish_reason_is_an_internal_error(client, fake):
    fake.servicer.omit_finish = True
    with pytest.raises(Internal, match="without a finish reason"):
        client.generate("abc")
    with pytest.raises(Internal):
        list(client.stream("abc"))


@pytest.mark.parametrize(
    ("prompt", "kwargs", "field"),
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([1, -2], {}, r"prompt\[1\]"),
        ("x", {"max_tokens": -1}, "max_tokens"),
        ("x", {"temperature": float("nan")}, "temperature"),
        ("x", {"seed": 2**64}, "seed"),
        ("x", {"stop": [""]}, "stop"),
        ("x", {"timeout": 0}, "timeout"),
    ],
)
def test_invalid_arguments_fail_before_any_call(client, fake, prompt, kwargs, field):
    with pytest.raises(InvalidArgument, match=f"^INVALID_ARGUMENT: {field}"):
        client.generate(prompt, **kwargs)
    with pytest.raises(ValueError, match=field):  # InvalidArgument is a ValueError too
        client.stream(prompt, **kwargs)
    assert fake.servicer.calls == 0


def test_unknown_keyword_is_a_type_error(client: Client):
    with pytest.raises(TypeError, match="max_token"):
        client.generate("x", max_token=3)


def test_resource_exhausted_with_a_retry_hint_is_retried_after_the_hint(fake: FakeServer):
    fake.servicer.fail_before_output = [grpc.StatusCode.RESOURCE_EXHAUSTED]
    fake.servicer.retry_after_ms = "200"
    with Client(fake.target, **FAST_RETRY) as client:
        assert client.generate("ab").text == "ab"
    first, second = fake.servicer.call_times
    assert second - first >= 0.2  # never sooner than the server asked


def test_resource_exhausted_hint_is_reported_when_retries_run_out(fake: FakeServer):
    fake.servicer.fail_before_output = [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2
    fake.servicer.retry_after_ms = "10"
    with Client(fake.target, max_retries=1, **FAST_RETRY) as client:
        with pytest.raises(ResourceExhausted) as err:
            client.generate("ab")
    assert err.value.retry_after_s == 0.01 and fake.servicer.calls == 2
