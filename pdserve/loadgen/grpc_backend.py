"""`GrpcBackend`: benchmark requests through the public gRPC API (`pdserve.client`).

Each Generate stream message carrying token ids is one arrival of that many tokens. The SDK's
automatic retries are off: a benchmark counts a refused request as an error instead of hiding
it (and its latency) behind a retry.
"""

from __future__ import annotations

import asyncio

from pdserve.client import AsyncClient, PDServeError
from pdserve.loadgen.backend import SendOptions, ServerInfo
from pdserve.loadgen.datasets import BenchRequest
from pdserve.loadgen.records import Recorder, RequestResult


class GrpcBackend:
    def __init__(self, target: str, options: SendOptions) -> None:
        tls = options.tls
        self._client = AsyncClient(
            target, token=options.token, max_retries=0,
            root_certificates=tls.ca if tls is not None else None,
            private_key=tls.private_key if tls is not None else None,
            certificate_chain=tls.cert_chain if tls is not None else None)
        self._options = options

    async def server_info(self) -> ServerInfo:
        cards = await self._client.list_models(timeout=30)
        card = next((c for c in cards if c.id == self._options.model), cards[0])
        return ServerInfo(card.id, card.max_model_len)

    async def send(self, request: BenchRequest) -> RequestResult:
        rec = Recorder(request.kind, len(request.prompt))
        try:
            stream = self._client.stream(
                request.prompt, max_tokens=request.output_len,
                temperature=self._options.temperature, ignore_eos=True,
                model=self._options.model, timeout=self._options.timeout_s)
            async for chunk in stream:
                rec.tokens(len(chunk.token_ids))
                if chunk.usage is not None:
                    rec.usage_tokens = chunk.usage.completion_tokens
                    rec.cached_tokens = chunk.usage.cached_tokens
        except PDServeError as exc:
            rec.fail(exc.code.name, exc.message)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any other failure is this request's result
            rec.fail(type(exc).__name__, str(exc))
        return rec.result()

    async def close(self) -> None:
        await self._client.close()
