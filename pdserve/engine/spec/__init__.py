"""Speculative decoding: cheap drafts proposed, verified by the target in one forward, exactly.

    proposer.py     the drafter interface (`Proposer`, `Proposal`: tokens + their q)
    ngram.py        prompt lookup: drafts copied from earlier in the context (no model)
    draft_model.py  a smaller model with its own paged KV cache and block pool
    rejection.py    greedy matching and rejection sampling (the target distribution, exactly)
    verifier.py     one step's logits ──► accepted tokens + logprobs per request
    adaptive.py     how many drafts per request per step (pure policy)
    stats.py        counters reported by `LLMEngine.stats()`
    decoder.py      `SpeculativeDecoder`: wires the above into the engine's step
    config.py       `SpecConfig`, parsed from `EngineConfig.speculative_config`

The scheduler schedules `[last token] + drafts` for a request in decode and rolls rejected KV
back in `Scheduler.update`; this package decides the drafts and which of them are accepted.
"""

from pdserve.engine.spec.config import SpecConfig
from pdserve.engine.spec.decoder import SpeculativeDecoder, build_speculator, spec_stats_off
from pdserve.engine.spec.proposer import Proposal, Proposer

__all__ = ["Proposal", "Proposer", "SpecConfig", "SpeculativeDecoder", "build_speculator",
           "spec_stats_off"]
