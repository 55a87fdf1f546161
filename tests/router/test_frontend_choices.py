"""The frontend's chunks (no workers: the flow is scripted per request): the finish reason
rides on the last token's chunk when the engine's stop rules foresee it, choices run side by
side with their own seeds and indexes, and one choice's failure ends (and closes) them all."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import grpc
import pytest

from pdserve.demo_model import write_tokenizer_files
from pdserve.engine.sampling_params import SamplingParams
from pdserve.observability.router_metrics import RouterMetrics
from pdserve.tokenizer import Tokenizer
from router.config import RouterConfig
from router.flow import FinishEvent, FlowError, TokenEvent
from router.frontend import FinishRules, Frontend, Usage, UsageTotal
from router.validation import ValidRequest

EOS = 2


class ScriptedFlow:
    """Plays `script(req, n)` for each request; records seeds, stopped choices, closes."""

    def __init__(self, script) -> None:
        self.script = script
        self.seeds: list[int | None] = []
        self.stopped: list[int] = []
        self.closed = 0

    def stop_choice(self, rid, index):
        self.stopped.append(index)

    async def run(self, rid, req, timeout_s, timings, n=1, decode_allowed=None):
        self.seeds.append(req.params.seed)
        try:
            for item in self.script(req, n):
                if item == "hang":
                    await asyncio.Event().wait()
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed += 1


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return Tokenizer.from_pretrained(write_tokenizer_files(tmp_path_factory.mktemp("tok"), 512))


RULES = FinishRules(frozenset({EOS}), 100)


def frontend(tokenizer, script, rules=RULES) -> Frontend:
    f = Frontend(RouterConfig(model="unused"), tokenizer, None, None, RouterMetrics(), rules)
    f.flow = ScriptedFlow(script)
    return f


def collect(f: Frontend, reqs, n):
    async def run():
        async with aclosing(f.generate_choices(reqs, n, None)) as chunks:
            return [c async for c in chunks]
    return asyncio.run(run())


def req(max_tokens=3, seed=None, **kw):
    return ValidRequest("r", [10, 11], SamplingParams(max_tokens=max_tokens, seed=seed, **kw))


def test_the_finish_rides_on_the_last_token_chunk(tokenizer):
    f = frontend(tokenizer, lambda r, n: [TokenEvent([40]), TokenEvent([41, 42]),
                                          FinishEvent("length", 2, 3, 1)])
    chunks = collect(f, [req()], 1)
    assert [c.token_ids for c in chunks] == [[40], [41, 42]]
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage == Usage(2, 3, 1)
    assert chunks[-1].text and chunks[0].finish_reason is None


def test_eos_is_foreseen_too_and_unforeseeable_ends_get_their_own_chunk(tokenizer):
    f = frontend(tokenizer, lambda r, n: [TokenEvent([40]), TokenEvent([EOS]),
                                          FinishEvent("stop", 2, 2, 0)])
    assert [c.finish_reason for c in collect(f, [req(max_tokens=9)], 1)] == [None, "stop"]
    f = frontend(tokenizer, lambda r, n: [TokenEvent([40]), FinishEvent("abort", 2, 1, 0)])
    chunks = collect(f, [req(max_tokens=9)], 1)
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [([40], None), ([], "abort")]


def test_a_wrong_foresight_is_harmless(tokenizer):
    """The router's context limit is smaller than a worker's: it expects an end that does
    not come, and the chunk goes out without a finish when more tokens arrive."""
    f = frontend(tokenizer, lambda r, n: [TokenEvent([40]), TokenEvent([41]),
                                          FinishEvent("length", 2, 2, 0)],
                 rules=FinishRules(frozenset({EOS}), 3))
    chunks = collect(f, [req(max_tokens=2)], 1)
    assert [(c.token_ids, c.finish_reason) for c in chunks] == [([40], None), ([41], "length")]


def forked(r, n):
    """A decode worker's forked stream: each choice a token, then its end."""
    return [TokenEvent([40 + j], index=j) for j in range(n)] + [
        FinishEvent("stop", 2, 1, 0, index=j) for j in reversed(range(n))]


def test_a_prompts_choices_are_one_flow_and_batches_number_by_prompt(tokenizer):
    f = frontend(tokenizer, forked)
    chunks = collect(f, [req(seed=5), req(seed=5)], 3)
    assert f.flow.seeds == [5, 5]  # one flow per prompt; the decode worker derives the rest
    assert sorted(c.index for c in chunks if c.finish_reason) == [0, 1, 2, 3, 4, 5]
    assert {c.index: c.token_ids for c in chunks if c.token_ids} == {
        0: [40], 1: [41], 2: [42], 3: [40], 4: [41], 5: [42]}
    unseeded = frontend(tokenizer, forked)
    collect(unseeded, [req()], 2)
    assert unseeded.flow.seeds[0] is not None  # drawn once, so the choices can derive theirs


def test_a_stop_string_ends_one_choice_and_the_others_go_on(tokenizer):
    stop = tokenizer.decode([41])

    def script(r, n):
        return [TokenEvent([40], index=0), TokenEvent([41], index=1),
                TokenEvent([43], index=1),  # after the choice ended: dropped
                TokenEvent([42], index=0), FinishEvent("length", 2, 2, 0, index=0),
                FinishEvent("abort", 2, 2, 0, index=1)]

    f = frontend(tokenizer, script)
    chunks = collect(f, [req(stop=[stop])], 2)
    ends = {c.index: c.finish_reason for c in chunks if c.finish_reason}
    assert ends == {0: "length", 1: "stop"} and f.flow.stopped == [1]
    assert [c.token_ids for c in chunks if c.index == 1] == [[41]]


def test_one_prompt_failing_fails_the_batch_and_closes_the_others(tokenizer):
    def script(r, n):
        if r.prompt_token_ids == [66]:
            return [FlowError(grpc.StatusCode.UNAVAILABLE, "lost")]
        return [TokenEvent([40]), "hang"]

    f = frontend(tokenizer, script)
    lost = ValidRequest("r", [66], SamplingParams(max_tokens=3))
    with pytest.raises(FlowError, match="lost"):
        collect(f, [req(seed=1), lost, req(seed=2)], 2)
    assert f.flow.closed == 3 and f.inflight == 0


def test_usage_of_several_choices_counts_each_prompt_once():
    total = UsageTotal(2)
    for index, u in enumerate([Usage(10, 3, 4), Usage(10, 5, 8), Usage(7, 1, 0),
                               Usage(7, 2, 0)]):
        total.add(u, index)
    assert total.finished == 4
    assert total.total() == Usage(17, 11, 4)


def test_stop_reason_names_the_stop_string_or_the_requests_stop_token(tokenizer):
    stop = tokenizer.decode([41])
    f = frontend(tokenizer, lambda r, n: [TokenEvent([40]), TokenEvent([41])])
    (*_, last) = collect(f, [req(stop=[stop])], 1)
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    # A stop token of the request's: its id; EOS: none (vLLM's stop_reason).
    for token, want in ((77, 77), (EOS, None)):
        f = frontend(tokenizer, lambda r, n, t=token: [TokenEvent([40, t]),
                                                       FinishEvent("stop", 2, 2, 0)])
        (*_, last) = collect(f, [req(stop_token_ids=[77])], 1)
        assert (last.finish_reason, last.stop_reason) == ("stop", want)
