"""`python -m router --model DIR --prefill H:P[,H:P] --decode H:P[,H:P] [--port 50051]`"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from pdserve.engine.model_config import ModelConfig
from pdserve.proto import pb, pb_grpc
from pdserve.serving.grpc_server import start_server
from pdserve.serving.worker_base import announce_ready, wait_for_signal
from pdserve.tokenizer import Tokenizer
from router.auth import BearerAuthInterceptor
from router.config import RouterConfig
from router.frontend import Frontend
from router.pool import WorkerPool
from router.service import PDServeService

log = logging.getLogger("router")


async def serve(cfg: RouterConfig) -> None:
    tokenizer = Tokenizer.from_pretrained(cfg.model)
    model_cfg = ModelConfig.from_pretrained(cfg.model)
    prefill = WorkerPool("prefill", cfg.prefill, cfg.health_period_s, cfg.health_misses)
    decode = WorkerPool("decode", cfg.decode, cfg.health_period_s, cfg.health_misses)
    await asyncio.gather(prefill.start(), decode.start())
    await asyncio.gather(prefill.wait_healthy(60), decode.wait_healthy(60))
    infos = [w.info for w in decode.workers + prefill.workers if w.info is not None]
    max_len = min((i.max_model_len for i in infos), default=model_cfg.max_position_embeddings)
    model_id = cfg.model_id or (infos[0].model_id if infos else os.path.basename(cfg.model))
    frontend = Frontend(cfg, tokenizer, prefill, decode)
    service = PDServeService(frontend, model_cfg.vocab_size, max_len, model_id)
    interceptors = [BearerAuthInterceptor(cfg.auth_tokens)] if cfg.auth_tokens else []
    server = await start_server(cfg.host, cfg.port,
                                lambda s: pb_grpc.add_PDServeServicer_to_server(service, s),
                                [pb.DESCRIPTOR.services_by_name["PDServe"].full_name],
                                interceptors=interceptors)
    announce_ready({"role": "router", "address": f"{cfg.host}:{server.port}"})

    async def cleanup() -> None:
        await server.set_serving(False)
        await server.server.stop(grace=2)
        await asyncio.gather(prefill.close(), decode.close())

    await wait_for_signal(cleanup)


def parse(argv: list[str] | None = None) -> RouterConfig:
    p = argparse.ArgumentParser(prog="router")
    p.add_argument("--model", required=True)
    p.add_argument("--prefill", default="", help="comma-separated host:port list")
    p.add_argument("--decode", required=True, help="comma-separated host:port list")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--model-id", default="")
    p.add_argument("--local-prefill-tokens", type=int, default=32)
    p.add_argument("--max-inflight", type=int, default=1024)
    a = p.parse_args(argv)
    tokens = tuple(t for t in os.environ.get("PDSERVE_AUTH_TOKENS", "").split(",") if t)
    return RouterConfig(
        model=a.model, prefill=tuple(x for x in a.prefill.split(",") if x),
        decode=tuple(x for x in a.decode.split(",") if x), host=a.host, port=a.port,
        model_id=a.model_id, local_prefill_tokens=a.local_prefill_tokens,
        max_inflight=a.max_inflight, auth_tokens=tokens)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s router %(levelname)s %(message)s")
    asyncio.run(serve(parse(argv)))


if __name__ == "__main__":
    main()
