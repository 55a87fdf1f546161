"""What the gRPC API adds to plain generation: chat prompts (`GenerateRequest.chat`: the
conversation rendered with the chat template, tools included, into token ids, the tool
choice's constraint into `sampling.structured`), each choice's output split into text and
tool calls, and the stream of several choices (`n`) as `GenerateResponse`s.

The OpenAI API's own modules do the work (`router.openai.messages`, `.tools`,
`.tool_parsers`): both APIs read tools and find calls the same way.

    GenerateRequest{chat} ─► prepare() ─► GenerateRequest{token_ids, sampling.structured}
                                          + ToolChoice   (then the usual validation)
    each choice's chunks ─► ChoiceTools.shape(chunk) ─► text without calls; on its last
                                          chunk tool_calls and FINISH_REASON_TOOL_CALLS
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.proto import pb
from pdserve.serving.convert import finish_to_pb, structured_to_pb
from pdserve.tokenizer import Tokenizer
from router.frontend import Frontend, OutputChunk, UsageTotal
from router.openai import constraints
from router.openai.errors import RequestError
from router.openai.messages import parse_messages
from router.openai.tool_parsers import normalised_arguments
from router.openai.tools import (
    ToolCallStream,
    ToolChoice,
    ToolConfig,
    ToolMode,
    constraint,
    output_parser,
    parse_tools,
    template_messages,
)
from router.tokenize import TokenizerPool
from router.validation import ValidRequest

MAX_CHOICES = 128
"""Most outputs (`n`) one request may ask for."""


async def prepare_request(request: pb.GenerateRequest, tokens: TokenizerPool,
                          config: ToolConfig) -> tuple[pb.GenerateRequest, ToolChoice | None]:
    """A chat request as token ids (on the tokenizer pool, off the event loop: TokenizerBusy
    when too many wait); others as they are. ValueError."""
    if request.n > MAX_CHOICES:
        raise RequestError(f"n must be at most {MAX_CHOICES}, got {request.n}", "n")
    if request.WhichOneof("prompt") != "chat":
        return request, None
    return await tokens.run(prepare, request, tokens.tokenizer, config)


async def check_constraint(req: ValidRequest) -> None:
    """An invalid schema / regex / grammar is a ValueError that says why."""
    if req.params.structured is not None:
        await constraints.check(req.params.structured)


async def stream_choices(frontend: Frontend, req: ValidRequest, n: int, public_id: str,
                         tools: ToolChoice | None, config: ToolConfig,
                         timeout_s: float | None) -> AsyncIterator[pb.GenerateResponse]:
    """The request's `n` choices as GenerateResponses (each tagged with its index); the very
    last message carries the usage of all of them. Raises FlowError."""
    n = max(1, n)
    usage = UsageTotal(n)
    shaper = ChoiceTools(tools, config) if tools is not None and tools.calls_expected else None
    async for chunk in frontend.generate_choices([req], n, timeout_s):
        if chunk.usage is not None:  # the request's last message carries the total
            usage.add(chunk.usage, chunk.index)
            chunk = dataclasses.replace(
                chunk, usage=usage.total() if usage.finished == n else None)
        calls, called = [], False
        if shaper is not None:
            text, calls, called = shaper.shape(chunk)
            chunk = dataclasses.replace(chunk, text=text)
        msg = to_pb(public_id, chunk)
        msg.tool_calls.extend(calls)
        if called:
            msg.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        yield msg


def to_pb(rid: str, c: OutputChunk) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=rid, token_ids=c.token_ids, text=c.text,
                              logprobs=c.logprobs, finish_reason=finish_to_pb(c.finish_reason),
                              index=c.index, prompt_logprobs=c.prompt_logprobs or [])
    if c.usage is not None:
        msg.usage.CopyFrom(pb.Usage(prompt_tokens=c.usage.prompt_tokens,
                                    completion_tokens=c.usage.completion_tokens,
                                    cached_tokens=c.usage.cached_tokens))
    return msg


def prepare(request: pb.GenerateRequest, tokenizer: Tokenizer, config: ToolConfig
            ) -> tuple[pb.GenerateRequest, ToolChoice]:
    """The request with its chat rendered into token ids (ValueError naming what is wrong);
    runs the chat template: call it off the event loop."""
    chat = request.chat
    messages, _ = parse_messages([_message(m) for m in chat.messages])
    tools = _tool_choice(chat, config)
    try:
        kwargs = json.loads(chat.chat_template_kwargs_json or "{}")
    except ValueError:
        raise ValueError("chat.chat_template_kwargs_json is not JSON") from None
    if not isinstance(kwargs, dict):
        raise ValueError("chat.chat_template_kwargs_json must be a JSON object")
    gen = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
    if gen and chat.continue_final_message:
        raise ValueError("chat: continue_final_message and add_generation_prompt cannot both "
                         "be true")
    try:
        ids = tokenizer.encode_chat(template_messages(messages), gen,
                                    chat.continue_final_message,
                                    list(tools.definitions) or None, **kwargs)
    except ValueError as exc:
        raise ValueError(f"chat: {exc}") from None
    out = pb.GenerateRequest()
    out.CopyFrom(request)
    out.token_ids.ids.extend(ids)  # replaces the chat in the prompt oneof
    spec = constraint(tools)
    if spec is not None:
        if out.sampling.HasField("structured"):
            raise ValueError("chat.tool_choice required / a named tool cannot be combined "
                             "with sampling.structured")
        out.sampling.structured.CopyFrom(structured_to_pb(spec))
    return out, tools


@dataclass
class ChoiceTools:
    """One request's tool-call parsing, per choice."""

    choice: ToolChoice
    config: ToolConfig
    _streams: dict[int, ToolCallStream | None] = field(default_factory=dict)

    def shape(self, c: OutputChunk) -> tuple[str, list[pb.ToolCall], bool]:
        """(text to send, tool calls for the choice's last message, whether it called)."""
        stream = self._stream(c.index)
        if stream is None:
            return c.text, [], False
        final = c.finish_reason is not None
        content, _ = stream.feed(c.text, final)
        if not final:
            return content, [], False
        parsed = stream.parser.parse(stream.text, final=True)
        calls = [pb.ToolCall(id=stream.ids[i] if i < len(stream.ids) else "",
                             name=call.name, arguments_json=normalised_arguments(call))
                 for i, call in enumerate(parsed.calls)
                 if call.name is not None and call.complete]
        called = bool(calls) and self.choice.mode is not ToolMode.NAMED and \
            c.finish_reason == "stop"
        return content, calls, called

    def _stream(self, index: int) -> ToolCallStream | None:
        if index not in self._streams:
            parser = output_parser(self.choice, self.config)
            self._streams[index] = ToolCallStream(parser) if parser is not None else None
        return self._streams[index]


def _message(m: pb.ChatMessage) -> dict:
    out: dict = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments_json}}
                             for c in m.tool_calls]
    return out


def _tool_choice(chat: pb.ChatPrompt, config: ToolConfig) -> ToolChoice:
    tools = []
    for t in chat.tools:
        try:
            params = json.loads(t.parameters_json) if t.parameters_json else None
        except ValueError:
            raise ValueError(f"chat.tools: {t.name}'s parameters_json is not JSON") from None
        fn = {"name": t.name, "description": t.description}
        if params is not None:
            fn["parameters"] = params
        tools.append({"type": "function", "function": fn})
    fields: dict = {"tools": tools or None}
    if chat.tool_choice in ("none", "auto", "required"):
        fields["tool_choice"] = chat.tool_choice
    elif chat.tool_choice:
        fields["tool_choice"] = {"type": "function", "function": {"name": chat.tool_choice}}
    try:
        return parse_tools(fields, config)
    except RequestError as exc:
        raise ValueError(f"chat: {exc}") from None
