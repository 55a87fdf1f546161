"""vLLM's beam search (`use_beam_search`), run by the router one token at a time, as vLLM's
own front end runs it: each step asks the workers for one token of every live beam with its
top 2 × width logprobs, and keeps the `width` best continuations.

    beams = [prompt]
    repeat max_tokens times (or until no beam is live):
        one request per live beam: max_tokens 1, logprobs 2 × width   (the prefix cache
                                                                      serves the shared part)
        candidates = every beam × every token it was offered
        an EOS candidate (unless ignore_eos) is a finished beam; the rest compete:
        live beams = the `width` best by score
    answer = the `width` best of finished + live beams, each one choice

A beam's score is vLLM's: cumulative logprob / (prompt + output tokens, EOS not counted)
** length_penalty. `BeamSearch` (the policy) is pure; `beam_chunks` drives it through the
frontend and yields each choice as one final `OutputChunk` (finish "stop" for an EOS,
"length" otherwise), so both endpoints shape, stream and count it like any other output.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Collection, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from pdserve.engine.finish import FinishReason
from pdserve.engine.sampling_params import MAX_LOGPROBS
from pdserve.proto import pb
from router.frontend import Frontend, OutputChunk, Usage
from router.openai.schemas import BeamOptions
from router.validation import ValidRequest


@dataclass(frozen=True)
class Beam:
    tokens: tuple[int, ...]
    """Output tokens so far (a finished beam's last one is its EOS)."""
    cum_logprob: float
    logprobs: tuple[pb.TokenLogprob, ...] = ()
    """Each output token with the alternatives its step offered."""
    finished: bool = False


class BeamSearch:
    """The policy: which beams live on after each step. No I/O."""

    def __init__(self, options: BeamOptions, prompt_len: int, eos: Collection[int],
                 ignore_eos: bool, top_n: int) -> None:
        self.options = options
        self.prompt_len = prompt_len
        self.eos = frozenset(eos)
        self.ignore_eos = ignore_eos
        self.top_n = top_n
        self.live: list[Beam] = [Beam((), 0.0)]
        self.finished: list[Beam] = []

    def score(self, beam: Beam) -> float:
        length = self.prompt_len + len(beam.tokens) - (1 if beam.finished else 0)
        return beam.cum_logprob / max(length, 1) ** self.options.length_penalty

    def step(self, offered: Sequence[pb.TokenLogprob]) -> None:
        """`offered[i]`: what live beam i's next position offered (its chosen token and the
        top alternatives)."""
        grown: list[Beam] = []
        for beam, lp in zip(self.live, offered, strict=True):
            for token, logprob in _candidates(lp).items():
                entry = pb.TokenLogprob(token_id=token, logprob=logprob,
                                        top=list(lp.top[:self.top_n]))
                nxt = Beam((*beam.tokens, token), beam.cum_logprob + logprob,
                           (*beam.logprobs, entry))
                if token in self.eos and not self.ignore_eos:
                    self.finished.append(dataclasses.replace(nxt, finished=True))
                else:
                    grown.append(nxt)
        grown.sort(key=self.score, reverse=True)
        self.live = grown[:self.options.width]

    def best(self) -> list[Beam]:
        every = sorted(self.finished + self.live, key=self.score, reverse=True)
        return every[:self.options.width]


def _candidates(lp: pb.TokenLogprob) -> dict[int, float]:
    out = {t.token_id: t.logprob for t in lp.top}
    out.setdefault(lp.token_id, lp.logprob)
    return out


async def beam_chunks(frontend: Frontend, reqs: Sequence[ValidRequest], options: BeamOptions,
                      max_model_len: int) -> AsyncIterator[OutputChunk]:
    """Every prompt's beam search (the prompts concurrently); prompt i's beam j is choice
    i * width + j, yielded once whole. Raises what the frontend raises (`FlowError`,
    `Overloaded`) before any choice is yielded."""
    try:  # one search failing cancels the others (their flows free the workers' blocks)
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(_search(frontend, r, options, max_model_len))
                     for r in reqs]
    except ExceptionGroup as eg:
        raise eg.exceptions[0] from None
    for i, (req, task) in enumerate(zip(reqs, tasks, strict=True)):
        for j, beam in enumerate(task.result()):
            yield _chunk(frontend, req, beam, i * options.width + j)


async def _search(frontend: Frontend, req: ValidRequest, options: BeamOptions,
                  max_model_len: int) -> list[Beam]:
    p = req.params
    eos = set(frontend.rules.eos_token_ids) if frontend.rules is not None else set()
    eos |= set(p.stop_token_ids)
    top_n = p.logprobs or 0
    search = BeamSearch(options, len(req.prompt_token_ids), eos, p.ignore_eos, top_n)
    # One token per step, greedy (only its logprobs matter), the engine's own stops off.
    step = dataclasses.replace(p, max_tokens=1, min_tokens=0, temperature=0.0, seed=None,
                               stop=(), stop_token_ids=(), ignore_eos=True,
                               logprobs=min(max(2 * options.width, top_n), MAX_LOGPROBS),
                               prompt_logprobs=None, include_stop_str_in_output=False)
    steps = min(p.max_tokens, max_model_len - len(req.prompt_token_ids))
    for _ in range(steps):
        if not search.live:
            break
        batch = [ValidRequest(req.request_id, [*req.prompt_token_ids, *b.tokens], step,
                              req.skip_special_tokens) for b in search.live]
        search.step(await _one_token_each(frontend, batch))
    return search.best()


async def _one_token_each(frontend: Frontend, batch: list[ValidRequest]
                          ) -> list[pb.TokenLogprob]:
    offered: dict[int, pb.TokenLogprob] = {}
    async with aclosing(frontend.generate_choices(batch, 1, None)) as chunks:
        async for c in chunks:
            if c.logprobs and c.index not in offered:
                offered[c.index] = c.logprobs[0]
    missing = [i for i in range(len(batch)) if i not in offered]
    if missing:
        raise RuntimeError(f"beam search: no logprobs for beams {missing}")
    return [offered[i] for i in range(len(batch))]


def _chunk(frontend: Frontend, req: ValidRequest, beam: Beam, index: int) -> OutputChunk:
    shown = beam.tokens[:-1] if beam.finished else beam.tokens  # the EOS is not text
    text = frontend.tokenizer.decode(list(shown), skip_special_tokens=req.skip_special_tokens)
    finish = FinishReason.STOP if beam.finished else FinishReason.LENGTH
    usage = Usage(len(req.prompt_token_ids), len(beam.tokens), 0)
    return OutputChunk(list(beam.tokens), text, list(beam.logprobs) if req.params.logprobs
                       is not None else [], finish, usage, index)
