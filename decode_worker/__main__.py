"""`python -m decode_worker --model DIR [--host H] [--port P] [--kv-port K]`"""

from __future__ import annotations

import argparse
import asyncio

from decode_worker.service import DecodeService, expire_loop
from kv_store.index.recorder import BlockRecorder
from kv_store.transfer import KVReceiver, TransferConfig
from pdserve.engine.engine import LLMEngine
from pdserve.proto import worker_pb, worker_pb_grpc
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.grpc_server import start_server
from pdserve.serving.worker_base import (
    announce_ready,
    configure_process,
    start_telemetry,
    wait_for_signal,
)
from pdserve.serving.worker_options import WorkerOptions, add_worker_args, options_from_args


async def serve(options: WorkerOptions) -> None:
    recorder = BlockRecorder(options.worker_id)
    engine = LLMEngine(options.engine, on_block_event=recorder.on_block_event,
                       tp_role="decode")
    loop = EngineLoop(engine, asyncio.get_running_loop(), name="decode-engine")
    service = DecodeService(options, loop, recorder)
    receiver = KVReceiver(options.host, options.kv_port, service.sink, TransferConfig())
    receiver.start()
    size = engine.tp.size
    service.endpoints = [worker_pb.KVEndpoint(address=receiver.address, tp_rank=0, tp_size=size),
                         *service.follower_endpoints()]
    loop.start()
    telemetry = start_telemetry(options, service)
    server = await start_server(
        options.host, options.port,
        lambda s: worker_pb_grpc.add_WorkerServicer_to_server(service, s),
        [worker_pb.DESCRIPTOR.services_by_name["Worker"].full_name],
        interceptors=[telemetry.interceptor])
    expiry = asyncio.create_task(expire_loop(service))
    announce_ready({"role": "decode", "worker_id": options.worker_id,
                    "address": f"{options.host}:{server.port}", "kv_address": receiver.address,
                    **telemetry.ready_info()})

    async def cleanup() -> None:
        expiry.cancel()
        await server.set_serving(False)
        await server.server.stop(grace=2)
        receiver.close()
        loop.stop()
        engine.close()
        telemetry.close()

    await wait_for_signal(cleanup)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decode_worker")
    add_worker_args(parser)
    options = options_from_args("decode", parser.parse_args(argv))
    configure_process(options)
    asyncio.run(serve(options))


if __name__ == "__main__":
    main()
