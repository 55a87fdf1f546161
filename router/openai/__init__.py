"""OpenAI-compatible HTTP API of the router: `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, `/health`, with SSE streaming. Runs on the router's asyncio loop and serves
through the same `Frontend` as the gRPC API.

    server.py       routes, auth, body limit, errors -> OpenAI error bodies
    schemas.py      request JSON -> typed, validated requests (SamplingParams)
    completions.py  /v1/completions handler and its response shapes
    chat.py         /v1/chat/completions handler and its response shapes
    generation.py   run a request: one JSON body, or an SSE stream; cancel on disconnect
    responses.py    usage, model cards, logprobs formats
    sse.py          JSON and server-sent-event encoding
    errors.py       ApiError, RequestError, gRPC status -> HTTP status
"""

from router.openai.schemas import ServedModel
from router.openai.server import HttpConfig, OpenAIServer

__all__ = ["HttpConfig", "OpenAIServer", "ServedModel"]
