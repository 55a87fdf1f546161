"""Structured outputs in the engine: every constrained output is in its grammar (greedy and
sampled, with speculation on and off, with chunked prefill and preemption), a draft the
grammar refuses is rejected, a matcher rebuilt from the spec and the output tokens (the P->D
hand-off) continues exactly, and bad specs are refused before anything is added."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from pdserve.engine import LLM, SamplingParams
from pdserve.engine.sampler import apply_token_bitmask
from pdserve.engine.structured import ConstraintKind, StructuredOutput
from pdserve.engine.structured.grammar import InvalidConstraint, build_grammar
from tests.helpers.engine import assert_idle, random_prompts

SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 999},
    "colour": {"enum": ["red", "green", "blue"]},
    "ok": {"type": "boolean"}}, "required": ["n", "colour", "ok"]}
JSON_SCHEMA = StructuredOutput(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
REGEX = r"[a-c]{2}-\d{3}"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=128)


@pytest.fixture(scope="module")
def llm_spec(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=128, speculative_config=NGRAM)


def _params(structured, temperature=0.0, seed=0, max_tokens=48):
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                          structured=structured)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate_with_and_without_speculation(llm, llm_spec, temperature):
    prompts = random_prompts([5, 23, 40], 512, seed=4) + [[94, 5, 68, 469, 94, 5, 68]]
    params = [_params(JSON_SCHEMA, temperature, seed=i) for i in range(len(prompts))]
    plain = llm.generate(prompts, params)
    spec = llm_spec.generate(prompts, params)
    for a, b in zip(plain, spec, strict=True):
        jsonschema.validate(json.loads(b.text), SCHEMA)
        assert b.finish_reason == "stop"
        if temperature == 0.0:
            assert a.token_ids == b.token_ids  # greedy: speculation changes nothing
    assert_idle(llm)
    assert_idle(llm_spec)
    assert llm.engine.structured.num_active == 0


def test_regex_choice_grammar_and_json_object(llm):
    cases = [
        (StructuredOutput(ConstraintKind.REGEX, REGEX), lambda t: re.fullmatch(REGEX, t)),
        (StructuredOutput(ConstraintKind.CHOICE, choices=("yes", "no", "maybe")),
         lambda t: t in ("yes", "no", "maybe")),
        (StructuredOutput(ConstraintKind.GRAMMAR, 'root ::= "SELECT " ("a" | "b") ";"'),
         lambda t: t in ("SELECT a;", "SELECT b;")),
        (StructuredOutput(ConstraintKind.JSON_OBJECT),
         lambda t: isinstance(json.loads(t), dict)),
    ]
    for spec, check in cases:
        for seed in range(2):
            out = llm.generate([[5, 6, 7, 8]], _params(spec, 1.0, seed, max_tokens=64))[0]
            if out.finish_reason == "stop":  # json_object may run out of tokens: never invalid
                assert check(out.text), (spec.kind, out.text)
            else:
                assert spec.kind is ConstraintKind.JSON_OBJECT


def test_constrained_requests_survive_chunked_prefill_and_preemption(tiny_llama):
    prompts = random_prompts([30, 41, 52, 33], 512, seed=8)
    params = _params(JSON_SCHEMA, 0.8, seed=5)
    ref = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=128).generate(prompts, params)
    tight = LLM(str(tiny_llama), dtype="float32", num_gpu_blocks=14, max_num_batched_tokens=16)
    outs = tight.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert_idle(tight)


def test_a_rebuilt_matcher_continues_from_the_output_tokens(llm):
    """The decode worker builds its matcher from the spec alone and catches up on P's first
    token: the masks it computes equal those of the matcher that saw every step."""
    compiler = llm.engine.structured.compiler
    out = llm.generate([[9, 10, 11]], _params(JSON_SCHEMA))[0]
    from pdserve.engine.structured.state import GrammarState

    live = GrammarState(compiler.matcher(JSON_SCHEMA))
    for i in range(1, len(out.token_ids)):
        rebuilt = GrammarState(compiler.matcher(JSON_SCHEMA))
        assert rebuilt.sync(out.token_ids[:i])
        assert live.sync(out.token_ids[:i])
        masks = torch.zeros((2, -(-512 // 32)), dtype=torch.int32)
        live.fill(masks, 0)
        rebuilt.fill(masks, 1)
        assert torch.equal(masks[0], masks[1])


def test_a_draft_the_grammar_refuses_is_masked_at_its_position(llm):
    compiler = llm.engine.structured.compiler
    from pdserve.engine.structured.state import GrammarState

    state = GrammarState(compiler.matcher(StructuredOutput(ConstraintKind.REGEX, "ab+")))
    tok = llm.tokenizer
    a, b, z = (tok.encode(c, add_special_tokens=False)[0] for c in "abz")
    masks = torch.zeros((4, -(-512 // 32)), dtype=torch.int32)
    state.fill(masks, 0, drafts=[a, z, b])  # "a" fits, "z" does not
    logits = torch.zeros(4, 512)
    apply_token_bitmask(logits, masks, [0, 1, 2, 3])
    assert logits[0, a] == 0 and logits[0, z] == float("-inf")
    assert logits[1, b] == 0 and logits[1, z] == float("-inf")  # rejects the draft "z" here
    assert state.num_accepted == 0  # tentative drafts were rolled back


@pytest.mark.parametrize("spec, why", [
    (StructuredOutput(ConstraintKind.REGEX, "[.*"), "regex"),
    (StructuredOutput(ConstraintKind.JSON_SCHEMA, '{"properties": {"foo": "bar"}}'),
     "json_schema"),
    (StructuredOutput(ConstraintKind.JSON_SCHEMA, "{not json"), "not JSON"),
    (StructuredOutput(ConstraintKind.GRAMMAR, "root ::= undefined_rule"), "undefined_rule"),
])
def test_invalid_specs_are_refused_with_the_reason(llm, spec, why):
    with pytest.raises(InvalidConstraint, match=re.escape(why)):
        build_grammar(spec)
    with pytest.raises(ValueError, match=re.escape(why)):
        llm.engine.add_request("bad", [1, 2, 3], _params(spec))
    assert "bad" not in llm.engine.scheduler.requests


def test_compiles_are_cached(llm):
    compiler = llm.engine.structured.compiler
    spec = StructuredOutput(ConstraintKind.REGEX, "x{2,5}")
    before = compiler.compiles
    for _ in range(3):
        llm.engine.compile_grammar(_params(spec))
    assert compiler.compiles == before + 1
