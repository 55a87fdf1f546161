"""pdserve's Python client SDK for the public gRPC API (`pdserve.v1.PDServe`).

    from pdserve.client import Client, AsyncClient, Completion, Chunk, PDServeError

`Client` (blocking) and `AsyncClient` (asyncio) offer `generate` (a whole `Completion`),
`generate_choices` (`n` of them), `stream` (`Chunk`s as they are produced, tagged with their
choice) and `list_models`. A prompt is text, token ids or a `Chat` (messages and tools,
rendered by the server's chat template); options cover sampling, `logit_bias`,
`allowed_token_ids`, `bad_words_token_ids`, `prompt_logprobs` and output constraints
(`json_schema`, `json_object`, `regex`, `choice`, `grammar`). Calls take an optional deadline,
retry UNAVAILABLE with jittered exponential backoff, send a bearer token when given one, and
raise `PDServeError` subclasses named after the gRPC status.

Layout: `sync_client` / `async_client` hold the call loops; `request` builds and validates
requests; `response` converts and assembles results; `retry` is the retry policy; `channel` and
`config` hold connection settings; `datatypes` and `errors` are the public types.
"""

from pdserve.client.async_client import AsyncClient
from pdserve.client.datatypes import (
    Chat,
    Chunk,
    Completion,
    ModelCard,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from pdserve.client.errors import (
    Cancelled,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    PDServeError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from pdserve.client.request import GenerateKwargs, GenerateOptions
from pdserve.client.sync_client import Client

__all__ = [
    "AsyncClient",
    "Cancelled",
    "Chat",
    "Chunk",
    "Client",
    "Completion",
    "DeadlineExceeded",
    "GenerateKwargs",
    "GenerateOptions",
    "Internal",
    "InvalidArgument",
    "ModelCard",
    "PDServeError",
    "ResourceExhausted",
    "TokenLogprob",
    "ToolCall",
    "TopLogprob",
    "Unauthenticated",
    "Unavailable",
    "Usage",
]
