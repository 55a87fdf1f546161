"""`python -m prefill_worker [--model PATH] [--host H] [--port P] [--redis URL]`

With `--redis` the worker registers in the cluster's registry, so a router in discovery mode
takes it into its prefill pool on its own. SIGTERM drains it (`pdserve.serving.drain`): it leaves
the registry and says `draining` in its stats, finishes the prefills it has and their KV
transfers while answering polls, then exits.
"""

from __future__ import annotations

import asyncio
import dataclasses

from kv_store.index.recorder import BlockRecorder
from kv_store.transfer import KVSender
from pdserve.engine.engine import LLMEngine
from pdserve.serving.drain import DrainConfig, drain
from pdserve.serving.engine_loop import EngineLoop
from pdserve.serving.index_link import open_index_link, worker_info
from pdserve.serving.kv_transport import open_kv_transport
from pdserve.serving.ready import announce_ready, wait_for_signal
from pdserve.serving.worker_base import run_worker, start_telemetry, start_worker_server
from pdserve.serving.worker_options import WorkerOptions
from prefill_worker.kv_streamer import KVStreamer
from prefill_worker.service import PrefillService


async def serve(options: WorkerOptions) -> None:
    # A prefill worker samples one token per request: a draft model would never be used.
    recorder = BlockRecorder(options.worker_id)
    link = await open_index_link(options, recorder)  # None without --redis
    engine = LLMEngine(dataclasses.replace(options.engine, speculative_config=None),
                       on_block_event=recorder.on_block_event, tp_role="prefill")
    kv = open_kv_transport(options.kv_transport, options.host)
    sender = KVSender(options.lease.transfer_config(  # signed pairs, gloo bound to --host
        host=options.host, auth_key=options.security.kv_key(), backend=kv.backend,
        nixl_reads=options.kv_nixl_reads),
        nixl=kv.nixl)
    streamer = KVStreamer(sender, engine.kv_caches, engine.config.block_size,
                          engine.kv_layout, 0, engine.tp.size)
    loop = EngineLoop(engine, asyncio.get_running_loop(), name="prefill-engine")
    service = PrefillService(options, loop, streamer, recorder)
    service.kv_sender = sender  # serves PushKV too: decode workers pull our prefixes
    loop.set_step_fn(service.step)
    loop.start()
    telemetry = start_telemetry(options, service)
    server = await start_worker_server(options, service, [telemetry.interceptor])
    address = f"{options.host}:{server.port}"
    if link is not None:
        await link.attach(address, worker_info(options, engine))
    announce_ready({"role": "prefill", "worker_id": options.worker_id,
                    "address": address, "kv_transport": kv.name, **telemetry.ready_info()})

    async def cleanup() -> None:
        # A prefill answers before its KV has reached the decode worker: wait for that too.
        await drain(server, service.gate, link, lambda: sender.stats()["transfers_active"] > 0,
                    DrainConfig.of(options))
        loop.stop()
        engine.close()
        sender.close()
        kv.close()
        telemetry.close()

    await wait_for_signal(cleanup)


def main(argv: list[str] | None = None) -> None:
    run_worker("prefill", serve, argv)


if __name__ == "__main__":
    main()
