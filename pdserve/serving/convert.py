"""Conversions between protobuf messages and the engine's typed values (one place only)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.finish import FinishReason
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.structured.spec import ConstraintKind, StructuredOutput
from pdserve.proto import pb

if TYPE_CHECKING:
    from pdserve.engine.sampler import TokenLogprobs

_OPTIONAL_FIELDS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                    "repetition_penalty", "presence_penalty", "frequency_penalty", "seed",
                    "logprobs", "prompt_logprobs")
# StructuredOutput.constraint oneof field -> kind (the text fields carry the spec).
_CONSTRAINTS = {"json_schema": ConstraintKind.JSON_SCHEMA,
                "json_object": ConstraintKind.JSON_OBJECT, "regex": ConstraintKind.REGEX,
                "choice": ConstraintKind.CHOICE, "grammar": ConstraintKind.GRAMMAR,
                "structural_tag": ConstraintKind.STRUCTURAL_TAG}
_CONSTRAINT_FIELD = {kind: name for name, kind in _CONSTRAINTS.items()}

_FINISH_TO_PB = {
    None: "FINISH_REASON_UNSPECIFIED",
    FinishReason.STOP: "FINISH_REASON_STOP",
    FinishReason.LENGTH: "FINISH_REASON_LENGTH",
    FinishReason.ABORT: "FINISH_REASON_ABORT",
}


def finish_to_pb(reason: FinishReason | None) -> int:
    """The public enum value of a finish reason (UNSPECIFIED while running)."""
    return pb.FinishReason.Value(_FINISH_TO_PB[reason])


def finish_from_pb(value: int) -> FinishReason:
    """A finish reason from the wire; anything unknown or unset reads as ABORT."""
    for reason, name in _FINISH_TO_PB.items():
        if reason is not None and pb.FinishReason.Value(name) == value:
            return reason
    return FinishReason.ABORT


def params_from_pb(msg: pb.SamplingParams) -> SamplingParams:
    """Validated `SamplingParams`; unset optional fields take the engine's defaults.

    Raises ValueError naming the offending field."""
    kwargs: dict = {}
    for name in _OPTIONAL_FIELDS:
        if msg.HasField(name):
            kwargs[name] = getattr(msg, name)
    # float32 on the wire: round to the nearest 1e-6 so 0.9 stays 0.9, not 0.899999976.
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                 "frequency_penalty"):
        if name in kwargs:
            kwargs[name] = round(float(kwargs[name]), 6)
    # float32 on the wire: biases are decimal numbers in [-100, 100], as above.
    bias = {int(t): round(float(b), 6) for t, b in msg.logit_bias.items()}
    return SamplingParams(stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
                          ignore_eos=msg.ignore_eos,
                          include_stop_str_in_output=msg.include_stop_str_in_output,
                          logit_bias=bias, structured=structured_from_pb(msg),
                          allowed_token_ids=tuple(msg.allowed_token_ids),
                          bad_words_token_ids=tuple(tuple(s.ids)
                                                    for s in msg.bad_words_token_ids),
                          **kwargs)


def structured_from_pb(msg: pb.SamplingParams) -> StructuredOutput | None:
    if not msg.HasField("structured"):
        return None
    s = msg.structured
    which = s.WhichOneof("constraint")
    if which is None:
        raise ValueError("structured must set one constraint (json_schema, json_object, "
                         "regex, choice, grammar or structural_tag)")
    kind = _CONSTRAINTS[which]
    if kind is ConstraintKind.CHOICE:
        return StructuredOutput(kind, choices=tuple(s.choice.choices),
                                any_whitespace=s.any_whitespace)
    if kind is ConstraintKind.JSON_OBJECT:
        return StructuredOutput(kind, any_whitespace=s.any_whitespace)
    return StructuredOutput(kind, getattr(s, which), any_whitespace=s.any_whitespace)


def structured_to_pb(s: StructuredOutput) -> pb.StructuredOutput:
    msg = pb.StructuredOutput(any_whitespace=s.any_whitespace)
    if s.kind is ConstraintKind.CHOICE:
        msg.choice.choices.extend(s.choices)
    elif s.kind is ConstraintKind.JSON_OBJECT:
        msg.json_object = True
    else:
        setattr(msg, _CONSTRAINT_FIELD[s.kind], s.spec)
    return msg


def params_to_pb(p: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(stop=list(p.stop), stop_token_ids=list(p.stop_token_ids),
                            ignore_eos=p.ignore_eos,
                            include_stop_str_in_output=p.include_stop_str_in_output,
                            allowed_token_ids=list(p.allowed_token_ids),
                            bad_words_token_ids=[pb.TokenIds(ids=list(s))
                                                 for s in p.bad_words_token_ids])
    for name in _OPTIONAL_FIELDS:
        value = getattr(p, name)
        if value is not None:
            setattr(msg, name, value)
    for tid, bias in p.logit_bias:
        msg.logit_bias[tid] = bias
    if p.structured is not None:
        msg.structured.CopyFrom(structured_to_pb(p.structured))
    return msg


def logprob_to_pb(lp: TokenLogprobs) -> pb.TokenLogprob:
    return pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
                           rank=lp.rank)


def logprobs_to_pb(lps) -> list[pb.TokenLogprob]:
    return [logprob_to_pb(lp) for lp in lps if lp is not None]
