"""`python -m decode_worker [--model PATH] [--host H] [--port P] [--kv-port K] [--redis URL]`

With `--redis` the worker registers in the cluster's registry, so a router in discovery mode
takes it into its decode pool on its own. SIGTERM drains it (`pdserve.serving.drain`): it leaves
the registry and says `draining` in its stats (routers send it nothing new), answers polls and
finishes the streams it has, then exits.
"""

from __future__ import annotations

import asyncio

from decode_worker.service import DecodeService, expire_loop
from kv_store.index.recorder import BlockRecorder
from kv_store.transfer import KVReceiver, KVSender
from pdserve.engine.engine import LLMEngine
from pdserve.proto import worker_pb
from pdserve.serving.drain import DrainConfig, drain
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.index_link import open_index_link, worker_info
from pdserve.serving.kv_transport import open_kv_transport
from pdserve.serving.ready import announce_ready, wait_for_signal
from pdserve.serving.worker_base import run_worker, start_telemetry, start_worker_server
from pdserve.serving.worker_options import WorkerOptions


async def serve(options: WorkerOptions) -> None:
    recorder = BlockRecorder(options.worker_id)
    link = await open_index_link(options, recorder)  # None without --redis
    engine = LLMEngine(options.engine, on_block_event=recorder.on_block_event,
                       tp_role="decode")
    loop = EngineLoop(engine, asyncio.get_running_loop(), name="decode-engine")
    service = DecodeService(options, loop, recorder)
    kv = open_kv_transport(options.kv_transport, options.host)
    # Signed pairs only; our own KV pushes listen on --host too; leases capped by ours.
    transfer = options.lease.transfer_config(host=options.host,
                                             auth_key=options.security.kv_key(),
                                             backend=kv.backend,
                                             nixl_reads=options.kv_nixl_reads)
    # Frames must carry the tag of the ticket their request was reserved with (`kv_sink`);
    # with NIXL, payloads land in a pool registered once, next to the paged cache.
    receiver = KVReceiver(options.host, options.kv_port, service.sink, transfer,
                          tickets=service.sink.ticket, nixl=kv.nixl,
                          nixl_device=engine.kv_caches[0].device,
                          nixl_destinations=engine.kv_caches)
    receiver.start()
    service.kv_receiver = receiver
    service.kv_sender = KVSender(transfer, nixl=kv.nixl)  # PushKV: others pull our prefixes
    size = engine.tp.size
    service.endpoints = [worker_pb.KVEndpoint(address=receiver.address, tp_rank=0, tp_size=size,
                                              nixl=receiver.nixl_descriptor),
                         *service.follower_endpoints()]
    loop.start()
    telemetry = start_telemetry(options, service)
    server = await start_worker_server(options, service, [telemetry.interceptor])
    expiry = asyncio.create_task(expire_loop(service))
    address = f"{options.host}:{server.port}"
    if link is not None:
        await link.attach(address, worker_info(options, engine, kv_address=receiver.address))
    announce_ready({"role": "decode", "worker_id": options.worker_id, "address": address,
                    "kv_address": receiver.address, "kv_transport": kv.name,
                    **telemetry.ready_info()})

    async def cleanup() -> None:
        # The receiver and the engine keep running while the streams in flight finish.
        pushing = lambda: service.kv_sender.stats()["transfers_active"] > 0  # noqa: E731
        await drain(server, service.gate, link, pushing, DrainConfig.of(options))
        expiry.cancel()
        receiver.close()
        await service.puller.close()
        service.kv_sender.close()
        loop.stop()
        engine.close()
        kv.close()
        telemetry.close()

    await wait_for_signal(cleanup)


def main(argv: list[str] | None = None) -> None:
    run_worker("decode", serve, argv)


if __name__ == "__main__":
    main()
