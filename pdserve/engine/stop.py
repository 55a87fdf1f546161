"""Token-level stop rules, applied to the tokens a step accepted for one request.

Stop strings are text-level and live in `pdserve.text_stream`; everything decidable from token
ids alone is here, so the engine, the workers and the router agree on it (the router applies
them to each token it receives, to know a request's last one as soon as it arrives). Tokens a
request brought with it (a migrated request's earlier output) count as output: for
min_tokens, max_tokens and the context limit alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.finish import FinishReason
from pdserve.engine.sampling_params import SamplingParams


def stop_reason(params: SamplingParams, num_prompt_tokens: int, output: Sequence[int],
                eos_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
    """Why a request whose output so far is `output` is over (None: it goes on), judged on
    its last token: what a continuation must check before it generates anything."""
    if not output:
        return None
    return _judge(params, num_prompt_tokens, len(output), output[-1], eos_ids, max_model_len)


def apply_stop_rules(params: SamplingParams, num_prompt_tokens: int, num_output: int,
                     tokens: Sequence[int], eos_ids: frozenset[int], max_model_len: int
                     ) -> tuple[list[int], FinishReason | None]:
    """Tokens to keep of `tokens` (new ones, after `num_output` earlier ones), cut after the
    first stopping one, and the finish reason, if any."""
    kept: list[int] = []
    n_out = num_output
    for tok in tokens:
        kept.append(tok)
        n_out += 1
        reason = _judge(params, num_prompt_tokens, n_out, tok, eos_ids, max_model_len)
        if reason is not None:
            return kept, reason
    return kept, None


def _judge(p: SamplingParams, num_prompt_tokens: int, n_out: int, tok: int,
           eos_ids: frozenset[int], max_model_len: int) -> FinishReason | None:
    if n_out >= p.min_tokens and ((tok in eos_ids and not p.ignore_eos)
                                  or tok in p.stop_token_ids):
        return FinishReason.STOP
    if n_out >= p.max_tokens or num_prompt_tokens + n_out >= max_model_len:
        return FinishReason.LENGTH
    return None
