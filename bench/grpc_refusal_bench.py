"""How long a gRPC server takes to refuse a message over its receive limit, with and without
pdserve's front (`pdserve.serving.grpc_front`), side by side in one run: an echo service
started by `pdserve.serving.grpc_server.start_server`, grpc-core owning the port
(`front=False`, the baseline) or the front owning it (`front=True`, the router's default).

    .venv/bin/python bench/grpc_refusal_bench.py [--limit-kb 230] [--repeats 8]
        [--output bench/results/grpc_refusal.json]

Rows per server: one accepted message just under the limit (a normal call of that size),
then messages of 1 MB, 4 MB and 50 MB over it, each sent `--repeats` times on one warm
channel; the time from the call to its RESOURCE_EXHAUSTED as the client sees it (median, best,
worst). A refusal that costs the same at 1 MB as at 50 MB is the server's refusal path, not
the bytes on the wire. The client runs in this process, on the same event loop as the front.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import grpc
from grpc import aio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from pdserve.serving.grpc_server import start_server  # noqa: E402

METHOD = "/bench.Refusal/Echo"


async def _echo(request: bytes, context) -> bytes:
    return b"ok"


async def measure(limit: int, repeats: int, front: bool) -> list[dict]:
    handler = grpc.method_handlers_generic_handler(
        "bench.Refusal", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)})
    server = await start_server("127.0.0.1", 0, lambda s: s.add_generic_rpc_handlers((handler,)),
                                ["bench.Refusal"], max_receive_bytes=limit, front=front)
    port = server.port
    sizes = [("accepted", limit - 4096)] + [(f"{mb} MB", mb << 20) for mb in (1, 4, 50)]
    rows = []
    try:
        opts = [("grpc.max_send_message_length", 128 << 20)]
        async with aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as channel:
            call = channel.unary_unary(METHOD)
            await call(b"warm")
            for name, size in sizes:
                payload = b"x" * size
                times, codes = [], set()
                for _ in range(repeats):
                    t0 = time.monotonic()
                    try:
                        await call(payload, timeout=30)
                        codes.add("OK")
                    except grpc.RpcError as exc:
                        codes.add(exc.code().name)
                    times.append(time.monotonic() - t0)
                rows.append({"server": "front" if front else "grpc-core", "message": name,
                             "bytes": size, "status": "/".join(sorted(codes)),
                             "median_ms": 1e3 * statistics.median(times),
                             "best_ms": 1e3 * min(times), "worst_ms": 1e3 * max(times)})
    finally:
        await server.stop(0)
    return rows


async def measure_both(limit: int, repeats: int) -> list[dict]:
    base = await measure(limit, repeats, front=False)
    guarded = await measure(limit, repeats, front=True)
    for b, g in zip(base, guarded, strict=True):
        g["median_vs_grpc_core"] = g["median_ms"] / b["median_ms"]
    return base + guarded


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit-kb", type=int, default=230,
                    help="the server's receive limit (the router's is ~230 KB on the demo model)")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--output", default="bench/results/grpc_refusal.json")
    a = ap.parse_args()
    rows = asyncio.run(measure_both(a.limit_kb * 1000, a.repeats))
    print(f"grpcio {grpc.__version__}: an echo server, receive limit {a.limit_kb} KB")
    print_table(rows, ["server", "message", "bytes", "status", "median_ms", "best_ms",
                       "worst_ms", "median_vs_grpc_core"])
    out = write_json(a.output, {"grpcio": grpc.__version__, "args": vars(a), "rows": rows})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
