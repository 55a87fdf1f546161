"""Token-level stop rules, applied to the tokens a step accepted for one request.

Stop strings are text-level and live in `pdserve.text_stream`; everything decidable from token
ids alone is here, so the engine, the workers and the router agree on it (the router uses
`stop_rules` to know that a token is a request's last one as soon as it arrives).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.request import Request
from pdserve.engine.sampling_params import SamplingParams


def apply_stop_rules(req: Request, tokens: Sequence[int], eos_ids: frozenset[int],
                     max_model_len: int) -> tuple[list[int], str | None]:
    """Tokens to keep (cut after the first stopping one) and the finish reason, if any."""
    return stop_rules(req.params, req.num_prompt_tokens, len(req.output_token_ids), tokens,
                      eos_ids, max_model_len)


def stop_rules(p: SamplingParams, num_prompt: int, num_output: int, tokens: Sequence[int],
               eos_ids: frozenset[int], max_model_len: int) -> tuple[list[int], str | None]:
    """`apply_stop_rules` for a request with `num_output` tokens so far."""
    kept: list[int] = []
    n_out = num_output
    for tok in tokens:
        kept.append(tok)
        n_out += 1
        if n_out >= p.min_tokens and (
            (tok in eos_ids and not p.ignore_eos) or tok in p.stop_token_ids
        ):
            return kept, "stop"
        if n_out >= p.max_tokens or num_prompt + n_out >= max_model_len:
            return kept, "length"
    return kept, None
