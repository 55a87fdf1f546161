"""Token-level stop rules, applied to the tokens a step accepted for one request.

Stop strings are text-level and live in `pdserve.text_stream`; everything decidable from token
ids alone is here, so the engine, the workers and the router agree on it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.engine.request import Request


def apply_stop_rules(req: Request, tokens: Sequence[int], eos_ids: frozenset[int],
                     max_model_len: int) -> tuple[list[int], str | None]:
    """Tokens to keep (cut after the first stopping one) and the finish reason, if any."""
    p = req.params
    kept: list[int] = []
    n_out = len(req.output_token_ids)
    for tok in tokens:
        kept.append(tok)
        n_out += 1
        if n_out >= p.min_tokens and (
            (tok in eos_ids and not p.ignore_eos) or tok in p.stop_token_ids
        ):
            return kept, "stop"
        if n_out >= p.max_tokens or req.num_prompt_tokens + n_out >= max_model_len:
            return kept, "length"
    return kept, None
