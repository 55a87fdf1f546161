"""Endpoints vLLM serves beside the OpenAI API: `/tokenize`, `/detokenize`,
`/tokenizer_info`, `/version`, `/load`, `/ping`, `/invocations` (SageMaker's entry point).

`/tokenize` takes a prompt or chat messages (rendered with the chat template, tools
included) and answers vLLM's shape: `{"count", "max_model_len", "tokens", "token_strs"}`.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from aiohttp import web

from router.openai import chat, completions, fields, sse
from router.openai.body import read_json
from router.openai.errors import RequestError, model_not_found
from router.openai.generation import ApiContext
from router.openai.generation import tokenize as tokenize_job
from router.openai.messages import parse_messages
from router.openai.schemas import ChatRequest, OutputOptions, template_options
from router.openai.tools import ToolChoice, ToolMode, tool_definitions
from router.validation import check_text


def version() -> str:
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


async def tokenize(request: web.Request, ctx: ApiContext) -> web.Response:
    body = await read_json(request, ctx.body)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_model(body, ctx)
    tokenizer = ctx.frontend.tokenizer
    as_strs = fields.boolean(body, "return_token_strs", False)
    if body.get("messages") is not None:
        messages, _ = parse_messages(body["messages"])
        check_text("\n".join(m["content"] for m in messages) or " ", ctx.model.limits,
                   "messages")  # bounded before the template renders them, as in chat
        req = ChatRequest(messages, None, OutputOptions(),  # type: ignore[arg-type]
                          tools=ToolChoice(ToolMode.NONE,
                                           definitions=tool_definitions(body.get("tools"))),
                          template=template_options(body))
        try:
            ids = await tokenize_job(ctx, chat.encode_chat, tokenizer, req)
        except ValueError as exc:
            raise RequestError(f"messages: {exc}", "messages") from None
    elif isinstance(body.get("prompt"), str):
        special = fields.boolean(body, "add_special_tokens", True)
        check_text(body["prompt"], ctx.model.limits, "prompt")
        ids = await tokenize_job(ctx, tokenizer.encode, body["prompt"], special)
    else:
        raise RequestError("give prompt (a string) or messages", "prompt")
    strs = tokenizer.convert_ids_to_tokens(ids) if as_strs else None
    return _json({"count": len(ids), "max_model_len": ctx.model.max_model_len, "tokens": ids,
                  "token_strs": strs})


async def detokenize(request: web.Request, ctx: ApiContext) -> web.Response:
    body = await read_json(request, ctx.body)
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    _check_model(body, ctx)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(fields.is_int(t) for t in tokens):
        raise RequestError("tokens must be a list of token ids", "tokens")
    bad = [t for t in tokens if not 0 <= t < ctx.model.vocab_size]
    if bad:
        raise RequestError(f"tokens contains token ids out of vocabulary: {bad[:5]}", "tokens")
    text = ctx.frontend.tokenizer.decode(tokens, skip_special_tokens=False)
    return _json({"prompt": text})


async def tokenizer_info(request: web.Request, ctx: ApiContext) -> web.Response:
    t = ctx.frontend.tokenizer
    return _json({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": t.bos_token,
                  "eos_token": t.eos_token, "chat_template": t.chat_template,
                  "model_max_length": ctx.model.max_model_len,
                  "vocab_size": t.vocab_size})


async def invocations(request: web.Request, ctx: ApiContext) -> web.StreamResponse:
    """SageMaker's single entry point: a chat body (with `messages`) or a completion."""
    body = await read_json(request, ctx.body)
    request["pdserve_body"] = body  # the handlers read the body once; hand it over
    if isinstance(body, dict) and "messages" in body:
        return await chat.handle(request, ctx)
    return await completions.handle(request, ctx)


def load(ctx: ApiContext) -> web.Response:
    return _json({"server_load": ctx.frontend.inflight})


def _check_model(body: dict[str, Any], ctx: ApiContext) -> None:
    name = body.get("model")
    if name is not None and name not in ctx.model.names:
        raise model_not_found(str(name), ctx.model.id)


def _json(obj: Any) -> web.Response:
    return web.json_response(obj, dumps=sse.dumps)
