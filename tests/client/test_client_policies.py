"""The SDK's pure parts: retry policy, error mapping, request building, response assembly."""

from __future__ import annotations

import random
from dataclasses import fields
from typing import get_type_hints

import grpc
import pytest

from pdserve.client import (
    Chunk,
    GenerateKwargs,
    GenerateOptions,
    Internal,
    InvalidArgument,
    PDServeError,
    Unavailable,
    Usage,
    channel,
    response,
)
from pdserve.client.errors import error_for
from pdserve.client.request import build_request
from pdserve.client.retry import Deadline, RetryPolicy, next_wait
from pdserve.proto import pb


def test_without_a_hint_only_unavailable_is_retryable_and_only_max_retries_times():
    policy = RetryPolicy(max_retries=2)
    assert policy.should_retry(grpc.StatusCode.UNAVAILABLE, 0)
    assert policy.should_retry(grpc.StatusCode.UNAVAILABLE, 1)
    assert not policy.should_retry(grpc.StatusCode.UNAVAILABLE, 2)
    for code in grpc.StatusCode:
        if code is not grpc.StatusCode.UNAVAILABLE:
            assert not policy.should_retry(code, 0), code


def test_backoff_grows_exponentially_with_jitter_and_is_capped():
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=1.0, multiplier=2.0)
    rng = random.Random(0)
    for retries_done, bound in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0]):
        waits = {policy.backoff_s(retries_done, rng) for _ in range(50)}
        assert all(bound / 2 <= w <= bound for w in waits)
        assert len(waits) > 1  # jittered, not a fixed schedule


def test_next_wait_gives_up_when_the_deadline_leaves_no_room():
    policy = RetryPolicy(initial_backoff_s=10.0, max_backoff_s=10.0)
    rng = random.Random(0)
    code = grpc.StatusCode.UNAVAILABLE
    assert next_wait(policy, code, 0, Deadline.after(None), rng) is not None
    assert next_wait(policy, code, 0, Deadline.after(1.0), rng) is None
    assert next_wait(policy, grpc.StatusCode.INTERNAL, 0, Deadline.after(None), rng) is None


def test_resource_exhausted_is_retried_only_with_a_hint_and_never_sooner():
    policy = RetryPolicy(max_retries=2)
    rng = random.Random(0)
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    forever = Deadline.after(None)
    assert next_wait(policy, code, 0, forever, rng) is None  # no hint: final
    waits = [next_wait(policy, code, 0, forever, rng, retry_after_s=1.5) for _ in range(20)]
    assert all(1.5 <= w <= 1.65 for w in waits)
    assert next_wait(policy, code, 2, forever, rng, retry_after_s=1.5) is None  # retries spent
    assert next_wait(policy, code, 0, Deadline.after(1.0), rng, retry_after_s=1.5) is None
    # A hint on UNAVAILABLE stretches the backoff, never shortens it.
    assert next_wait(policy, grpc.StatusCode.UNAVAILABLE, 0, forever, rng, 0.9) >= 0.9


@pytest.mark.parametrize("kwargs", [{"max_retries": -1}, {"initial_backoff_s": 3.0}])
def test_retry_policy_rejects_nonsense(kwargs):
    with pytest.raises(ValueError):
        RetryPolicy(**kwargs)


def test_error_classes_carry_code_and_message():
    err = error_for(grpc.StatusCode.UNAVAILABLE, "no healthy decode worker")
    assert isinstance(err, Unavailable) and err.code == grpc.StatusCode.UNAVAILABLE
    assert str(err) == "UNAVAILABLE: no healthy decode worker"
    other = error_for(grpc.StatusCode.UNIMPLEMENTED, "nope")
    assert type(other) is PDServeError and str(other) == "UNIMPLEMENTED: nope"
    assert isinstance(InvalidArgument("x"), ValueError)


def test_generate_kwargs_and_generate_options_list_the_same_arguments():
    assert set(get_type_hints(GenerateKwargs)) == {f.name for f in fields(GenerateOptions)}


def test_build_request_leaves_unset_options_unset():
    request = build_request([1, 2], GenerateOptions(max_tokens=None, logprobs=0))
    assert request.WhichOneof("prompt") == "token_ids" and list(request.token_ids.ids) == [1, 2]
    assert request.sampling.HasField("logprobs") and request.sampling.logprobs == 0
    assert not request.sampling.HasField("max_tokens")
    assert not request.sampling.HasField("temperature")


def test_build_request_rejects_float32_overflow_and_bool_ints():
    with pytest.raises(InvalidArgument, match="top_p"):
        build_request("x", GenerateOptions(top_p=1e39))
    with pytest.raises(InvalidArgument, match="max_tokens"):
        build_request("x", GenerateOptions(max_tokens=True))


def test_build_request_carries_the_token_masks():
    request = build_request("x", GenerateOptions(allowed_token_ids=[3, 4],
                                                 bad_words_token_ids=[[5], [6, 7]]))
    assert list(request.sampling.allowed_token_ids) == [3, 4]
    assert [list(s.ids) for s in request.sampling.bad_words_token_ids] == [[5], [6, 7]]
    with pytest.raises(InvalidArgument, match=r"bad_words_token_ids\[0\]"):
        build_request("x", GenerateOptions(bad_words_token_ids=[[-1]]))


def test_finish_reasons_map_to_lowercase_names():
    assert response.finish_reason_name(pb.FINISH_REASON_UNSPECIFIED) is None
    assert response.finish_reason_name(pb.FINISH_REASON_STOP) == "stop"
    assert response.finish_reason_name(pb.FINISH_REASON_LENGTH) == "length"
    assert response.finish_reason_name(pb.FINISH_REASON_ABORT) == "abort"
    assert response.finish_reason_name(99) == "unknown"  # a value added after this client


def _chunk(tokens, text, finish=None, usage=None):
    return Chunk("r", tokens, text, None, finish, usage)


def test_assemble_concatenates_and_takes_finish_and_usage_from_the_last_chunk():
    usage = Usage(3, 3, 0)
    chunks = [_chunk([1], "a"), _chunk([2, 3], "bc"), _chunk([], "", "length", usage)]
    completion = response.assemble(chunks, request_id="r", want_logprobs=False)
    assert completion.token_ids == [1, 2, 3] and completion.text == "abc"
    assert completion.finish_reason == "length" and completion.usage == usage


@pytest.mark.parametrize("chunks", [[], [_chunk([1], "a")], [_chunk([1], "a", finish="stop")]])
def test_assemble_refuses_a_stream_without_finish_and_usage(chunks):
    with pytest.raises(Internal):
        response.assemble(chunks, request_id="r", want_logprobs=False)


def test_channel_options_have_keepalive_and_limits_and_accept_overrides():
    options = dict(channel.channel_options([("grpc.keepalive_time_ms", 5000)]))
    assert options["grpc.keepalive_time_ms"] == 5000
    assert options["grpc.max_receive_message_length"] == channel.MAX_MESSAGE_BYTES
    assert options["grpc.max_send_message_length"] == channel.MAX_MESSAGE_BYTES


def test_token_becomes_a_bearer_header_and_bad_tokens_are_rejected():
    assert channel.call_metadata("abc") == (("authorization", "Bearer abc"),)
    assert channel.call_metadata(None) == ()
    for bad in ["", "a b", "line\nbreak"]:
        with pytest.raises(ValueError, match="token"):
            channel.call_metadata(bad)


def test_client_certificate_needs_root_certificates_and_both_halves():
    with pytest.raises(ValueError, match="root_certificates"):
        channel.credentials(None, private_key=b"k", certificate_chain=b"c")
    with pytest.raises(ValueError, match="both"):
        channel.credentials(b"roots", private_key=b"k")


def test_build_request_accepts_numpy_token_ids_and_scalars():
    np = pytest.importorskip("numpy")
    options = GenerateOptions(temperature=np.float32(0.5), seed=np.uint64(7))
    request = build_request(np.array([1, 2, 3], dtype=np.int64), options)
    assert list(request.token_ids.ids) == [1, 2, 3]
    assert request.sampling.temperature == 0.5 and request.sampling.seed == 7
    with pytest.raises(InvalidArgument, match=r"prompt\[0\]: expected an integer"):
        build_request(np.array([1.5]), GenerateOptions())
