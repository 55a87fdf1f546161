"""Public request → (prompt token ids, SamplingParams), or a ValueError naming the field."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.sampling_params import SamplingParams
from pdserve.proto import pb
from pdserve.serving.convert import params_from_pb
from pdserve.tokenizer import Tokenizer

MAX_REQUEST_ID = 256
_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._:-")


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    skip_special_tokens: bool = True
    """Leave special tokens (EOS, chat markers) out of the output text."""


def validate(req: pb.GenerateRequest, tokenizer: Tokenizer, vocab_size: int,
             max_model_len: int, model_id: str) -> ValidRequest:
    if len(req.request_id) > MAX_REQUEST_ID:
        raise ValueError(f"request_id is longer than {MAX_REQUEST_ID} characters")
    if not set(req.request_id) <= _ID_CHARS:
        raise ValueError("request_id may only contain letters, digits and . _ : -")
    if req.model and req.model != model_id:
        raise ValueError(f"model {req.model!r} is not served here (serving {model_id!r})")
    which = req.WhichOneof("prompt")
    if which == "text":
        if not req.text:
            raise ValueError("prompt text must not be empty")
        ids = tokenizer.encode(req.text)
    elif which == "token_ids":
        ids = list(req.token_ids.ids)
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"prompt token_ids contains ids outside [0, {vocab_size}): "
                             f"{bad[:5]}")
    else:
        raise ValueError("prompt must be set (text or token_ids)")
    if not ids:
        raise ValueError("prompt must not be empty")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; the model's context is "
                         f"{max_model_len}")
    params = params_from_pb(req.sampling)
    params.validate_for_model(vocab_size)
    return ValidRequest(req.request_id, ids, params)
