"""The beam-search policy (`router/openai/beam_search.py`), without workers: which beams live
on after each step, how EOS ends a beam, vLLM's length-normalised score."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pb
from router.frontend import OutputChunk, Usage
from router.openai.beam_search import Beam, BeamSearch
from router.openai.schemas import BeamOptions, parse_chat, parse_completion
from tests.router.test_openai_schemas import MODEL, USER

EOS = 0


def offered(chosen: tuple[int, float], *top: tuple[int, float]) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=chosen[0], logprob=chosen[1],
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def test_each_step_keeps_the_width_best_continuations():
    s = BeamSearch(BeamOptions(2), prompt_len=3, eos={EOS}, ignore_eos=False, top_n=0)
    s.step([offered((5, -0.1), (5, -0.1), (6, -0.5), (7, -2.0))])
    assert [b.tokens for b in s.live] == [(5,), (6,)]
    # Beam (6,) has the better continuation: it overtakes (5, ...).
    s.step([offered((8, -3.0), (8, -3.0), (9, -3.5)), offered((8, -0.2), (8, -0.2))])
    assert [b.tokens for b in s.live] == [(6, 8), (5, 8)]
    assert s.live[0].cum_logprob == pytest.approx(-0.7)


def test_an_eos_candidate_finishes_its_beam_and_competes_at_the_end():
    s = BeamSearch(BeamOptions(2), prompt_len=1, eos={EOS}, ignore_eos=False, top_n=0)
    s.step([offered((EOS, -0.05), (EOS, -0.05), (5, -1.0), (6, -1.5))])
    assert [b.tokens for b in s.finished] == [(EOS,)] and s.finished[0].finished
    assert [b.tokens for b in s.live] == [(5,), (6,)]
    best = s.best()
    assert best[0].tokens == (EOS,) and [b.tokens for b in best[1:]] == [(5,)]


def test_ignore_eos_keeps_eos_beams_live():
    s = BeamSearch(BeamOptions(1), prompt_len=1, eos={EOS}, ignore_eos=True, top_n=0)
    s.step([offered((EOS, -0.05), (EOS, -0.05), (5, -1.0))])
    assert s.finished == [] and s.live[0].tokens == (EOS,)


def test_the_score_is_vllms_length_normalised_logprob():
    s = BeamSearch(BeamOptions(1, length_penalty=2.0), prompt_len=2, eos={EOS},
                   ignore_eos=False, top_n=0)
    assert s.score(Beam((5, 6), -4.0)) == pytest.approx(-4.0 / 4**2)
    # The EOS itself does not count towards the length.
    assert s.score(Beam((5, EOS), -4.0, finished=True)) == pytest.approx(-4.0 / 3**2)


def test_the_chosen_token_keeps_its_steps_alternatives():
    s = BeamSearch(BeamOptions(1), prompt_len=1, eos={EOS}, ignore_eos=False, top_n=1)
    s.step([offered((5, -0.1), (5, -0.1), (6, -0.5))])
    (entry,) = s.live[0].logprobs
    assert entry.token_id == 5 and [t.token_id for t in entry.top] == [5]


def test_use_beam_search_takes_n_as_the_width_on_both_endpoints():
    req = parse_completion({"prompt": "hi", "n": 3, "best_of": 5, "use_beam_search": True,
                            "length_penalty": 0.5}, MODEL)
    assert req.beam == BeamOptions(3, 0.5) and req.best_of == 3  # best_of plays no part
    assert parse_chat({"messages": USER, "n": 2, "use_beam_search": True}, MODEL).beam == \
        BeamOptions(2)
    assert parse_completion({"prompt": "hi"}, MODEL).beam is None


class _Tokens:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{t}>" for t in ids)


class _Rules:
    eos_token_ids = frozenset({EOS})


class _Frontend:
    """One token per request: after token t the model offers t+1 (likely), EOS, then t+2."""

    tokenizer = _Tokens()
    rules = _Rules()

    def __init__(self):
        self.calls = []

    async def generate_choices(self, reqs, n, timeout_s):
        self.calls.append([list(r.prompt_token_ids) for r in reqs])
        for i, r in enumerate(reqs):
            last = r.prompt_token_ids[-1]
            assert (r.params.max_tokens, r.params.logprobs, n) == (1, 4, 1)
            yield OutputChunk([last + 1], "", [offered((last + 1, -0.1), (last + 1, -0.1),
                                                       (EOS, -1.0), (last + 2, -3.0))],
                              index=i)


def test_the_driver_asks_one_token_per_live_beam_and_answers_whole_choices():
    import asyncio

    from router.openai.beam_search import beam_chunks
    from router.validation import ValidRequest

    fe = _Frontend()
    req = ValidRequest("r", [10], SamplingParams(max_tokens=3, temperature=0.0))

    async def run():
        return [c async for c in beam_chunks(fe, [req, req], BeamOptions(2), 64)]

    chunks = asyncio.run(run())
    assert [c.index for c in chunks] == [0, 1, 2, 3]
    best, second = chunks[0], chunks[1]
    assert best.token_ids == [11, 12, 13] and best.text == "<11><12><13>"
    assert best.finish_reason == "length" and best.usage == Usage(1, 3, 0)
    # An EOS beam: its EOS is in token_ids, not in the text; its score (the EOS not
    # counted in its length) beats the live beams that fell behind.
    assert second.token_ids == [11, 12, EOS] and second.text == "<11><12>"
    assert second.finish_reason == "stop"
    # 3 steps for each prompt: one beam to start from, then the two live ones.
    assert sorted(len(batch) for batch in fe.calls) == [1, 1, 2, 2, 2, 2]
