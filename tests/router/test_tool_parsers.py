"""Tool calls in model outputs: every parser, complete and cut anywhere (streaming), and the
OpenAI deltas they stream; the constraint required / named calls are generated under."""

from __future__ import annotations

import json

import pytest

from router.openai.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    NamedParser,
    RequiredParser,
    normalised_arguments,
    parser_for,
)
from router.openai.tools import ToolCallStream, ToolChoice, ToolMode, constraint

HERMES = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": '
          '"Pa\\"ris", "days": [1, 2], "x": {"y": "}"}}}\n</tool_call>\n'
          '<tool_call>{"name": "now", "arguments": {}}</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; ' \
        '{"name": "now", "parameters": {}}'
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, ' \
           '{"name": "now", "parameters": {}}]'
CASES = [(HermesParser(), HERMES), (Llama3JsonParser(), LLAMA), (RequiredParser(), REQUIRED)]


@pytest.mark.parametrize("parser, text", CASES)
def test_complete_outputs_give_names_and_arguments(parser, text):
    parsed = parser.parse(text, final=True)
    assert [c.name for c in parsed.calls] == ["get_weather", "now"]
    assert json.loads(parsed.calls[0].arguments)["city"] in ("Paris", 'Pa"ris')
    assert json.loads(parsed.calls[1].arguments) == {}


@pytest.mark.parametrize("parser, text", CASES)
def test_every_prefix_only_grows_towards_the_final_parse(parser, text):
    final = parser.parse(text, final=True)
    for k in range(len(text) + 1):
        part = parser.parse(text[:k], final=False)
        assert final.content.startswith(part.content)
        for c, f in zip(part.calls, final.calls, strict=False):
            assert c.name in (None, f.name)
            assert f.arguments.startswith(c.arguments)


def test_hermes_content_holds_back_what_may_open_a_call():
    p = HermesParser()
    assert p.parse("hello <tool", final=False).content == "hello "
    assert p.parse("hello <tool", final=True).content == "hello <tool"
    assert p.parse("no calls at all", final=False).content == "no calls at all"
    assert HermesParser().parse(HERMES, True).content == "Let me check. "


def test_llama3_json_text_is_content():
    assert Llama3JsonParser().parse("It is sunny.", final=True).content == "It is sunny."
    assert Llama3JsonParser().parse("<|python", final=False).content == ""


@pytest.mark.parametrize("parser, text", CASES + [(NamedParser("get_weather"),
                                                    '{"city": "Paris", "n": [1]}')])
def test_streamed_deltas_add_up_to_the_calls(parser, text):
    stream = ToolCallStream(parser)
    content, calls = "", {}
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    for j, piece in enumerate(pieces):
        c, deltas = stream.feed(piece, final=j == len(pieces) - 1)
        content += c
        for d in deltas:
            entry = calls.setdefault(d["index"], {"name": None, "args": ""})
            if "id" in d:
                assert d["type"] == "function" and d["id"].startswith("call_")
                entry["name"] = d["function"]["name"]
            entry["args"] += d["function"]["arguments"]
    final = parser.parse(text, final=True)
    assert content == final.content
    assert [v["name"] for _, v in sorted(calls.items())] == [c.name for c in final.calls]
    assert [json.loads(v["args"]) for _, v in sorted(calls.items())] == [
        json.loads(c.arguments) for c in final.calls]
    assert stream.called


def test_arguments_are_normalised_when_whole_and_kept_when_cut():
    (call,) = RequiredParser().parse('[{"name": "f", "parameters": {"a":  1}}]', True).calls
    assert normalised_arguments(call) == '{"a": 1}'
    (cut,) = NamedParser("f").parse('{"a": ', True).calls
    assert normalised_arguments(cut) == '{"a":'


def test_unknown_parser_names_are_refused():
    with pytest.raises(ValueError, match="hermes"):
        parser_for("mistral")


def test_required_and_named_constraints():
    tools = ({"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}},
        "$defs": {"X": {"type": "integer"}}}}},
             {"type": "function", "function": {"name": "b"}})
    required = json.loads(constraint(ToolChoice(ToolMode.REQUIRED, definitions=tools)).spec)
    assert required["minItems"] == 1 and "maxItems" not in required
    names = [case["properties"]["name"]["enum"] for case in required["items"]["anyOf"]]
    assert names == [["a"], ["b"]] and required["$defs"] == {"X": {"type": "integer"}}
    single = constraint(ToolChoice(ToolMode.REQUIRED, definitions=tools, parallel=False))
    assert json.loads(single.spec)["maxItems"] == 1
    named = json.loads(constraint(ToolChoice(ToolMode.NAMED, "b", tools)).spec)
    assert named == {"type": "object", "properties": {}}
    assert constraint(ToolChoice(ToolMode.AUTO, definitions=tools)) is None
