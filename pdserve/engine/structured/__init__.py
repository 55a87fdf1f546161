"""Structured outputs: grammar-constrained decoding through xgrammar.

    spec.py          StructuredOutput: what a request constrains its output to (pure data,
                     on the wire in SamplingParams)
    grammar.py       spec -> xgrammar Grammar (tokenizer-independent: the router validates
                     requests with it), and the error text a client sees
    tokenizer_info.py  our Tokenizer -> xgrammar TokenizerInfo
    compiler.py      spec -> CompiledGrammar for one tokenizer, thread-safe, cached
    state.py         one request's matcher: follows its output tokens, fills its bitmask rows
    manager.py       the engine's per-step use: bitmask for a plan, advance after a step

The bitmask is applied to the logits in `pdserve.engine.sampler.apply_token_bitmask`, before
the sampler (and speculative verification) see them, on whichever worker samples: the prefill
worker for the first token, the decode worker after. A matcher is rebuilt from the request's
spec and follows `output_token_ids` lazily, so it survives the P->D hand-off (and preemption)
without any message: the decode worker's matcher accepts P's first token on its first step.
"""

from pdserve.engine.structured.spec import ConstraintKind, StructuredOutput

__all__ = ["ConstraintKind", "StructuredOutput"]
