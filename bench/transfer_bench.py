"""KV transfer throughput between two processes on one host, per transport (NIXL, gloo), over
this machine's memory copy bandwidth.

    python bench/transfer_bench.py [--transports nixl gloo] [--prompts 10] [--tokens 2048]
                                   [--coalesce 8 1] [--nixl-slots N] [--trace]
                                   [--shape smollm2|demo]
                                   [--output bench/results/transfer.json]

One receiver process per transport (this script with `--role receiver`) owns a paged KV cache
of the model's shape and a `KVReceiver` whose sink copies every layer into it, as a decode
worker does; the NIXL one has a NIXL agent and offers its landing pool. This process is the
prefill side: one `KVSender` (with a NIXL agent when NIXL is compared, so a receiver without a
pool gets gloo from the same sender, as in a worker), sending each prompt's KV layer by layer
and waiting for the DONE marker to be sent. Prompts alternate between the transports, and a
memory copy is timed before each round, so every ratio is taken against the same moment's
machine; so is one kernel copy of the prompt's bytes between two processes, layer by layer
(`cma_ceiling`: what UCX's CMA path does, and the most a same-host NIXL transfer can reach
here), and the ratio to it is printed too. Throughput = payload bytes / time from the first
`send_layer` to the resolved future.

`--coalesce` compares senders that put up to N ready layers in one message
(`TransferConfig.coalesce_max_parts`; 1 = one message per layer as before wire version 7,
though with its framing: the baseline, in the same run); `--nixl-slots` sets the receivers'
landing slots per pair (the window). `--trace` adds where the time goes per layer,
stage by stage, on both sides (`stage_trace`: wall time inside the named functions, waits
included); use it with one `--coalesce` value, since the stages add up over all variants.

Shapes (2048 tokens, fp32): `smollm2` (the default model: 30 layers x 128 blocks of 16 tokens x
3 KV heads x 64 dims, 3 MiB per layer, 90 MiB per prompt), `demo` (12 layers x 4 heads: 48 MiB).
The processes talk over a pipe in JSON lines (address and pool descriptor out, stats on request).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cma_ceiling import CmaCopy  # noqa: E402
from bench.common import memcpy_bandwidth, print_table, write_json  # noqa: E402
from bench.stage_trace import StageTrace  # noqa: E402
from decode_worker.kv_sink import copy_blocks  # noqa: E402
from kv_store.transfer import KVReceiver, KVSender, TransferConfig  # noqa: E402
from kv_store.transfer.nixl_agent import NixlAgent  # noqa: E402
from pdserve.demo_model import DemoModelConfig  # noqa: E402
from pdserve.engine.huge_pages import huge_page_zeros  # noqa: E402

BLOCK_SIZE = 16
_DEMO = DemoModelConfig()
SHAPES = {  # name: (layers, KV heads, head dim)
    "smollm2": (30, 3, 64),  # SmolLM2-135M-Instruct, the default model
    "demo": (_DEMO.num_hidden_layers, _DEMO.num_key_value_heads, _DEMO.resolved_head_dim),
}


def kv_shape(shape: str, tokens: int) -> tuple[int, ...]:
    """Shape of one layer's blocks for a `tokens`-long prompt."""
    _, heads, dim = SHAPES[shape]
    return (-(-tokens // BLOCK_SIZE), 2, heads, BLOCK_SIZE, dim)


class CacheSink:
    """The receiver's sink: copies each layer into its paged cache, like a decode worker (and,
    like it, reads a same-host NIXL sender's staged payloads straight into the cache)."""

    reads_in_place = True

    def __init__(self, layers: int, shape: tuple[int, ...]) -> None:
        # allocated as the engine allocates its CPU cache (`KVLayout.new_caches`)
        self.cache = [huge_page_zeros((2 * shape[0], *shape[1:]), torch.float32)
                      for _ in range(layers)]

    def on_layer(self, request_id, layer, block_ids, kv):
        copy_blocks(self.cache[layer], block_ids, kv)  # the decode worker's own copy

    def on_done(self, request_id, body):
        pass

    def on_failed(self, request_id, reason):
        print(json.dumps({"failed": request_id, "reason": reason}), file=sys.stderr, flush=True)


def receiver_config(slots: int, pairs: int) -> TransferConfig:
    """The defaults, or `slots` landing slots per pair; the pool holds every compared
    variant's pair (mapped lazily: the unused part costs nothing)."""
    base = TransferConfig()
    slots = slots or base.nixl_slots_per_pair
    return TransferConfig(nixl_slots_per_pair=slots,
                          nixl_pool_bytes=max(base.nixl_pool_bytes,
                                              pairs * slots * base.nixl_slot_bytes))


SENDER_STAGES = (
    "kv_store.transfer.sender:KVSender.send_layer",        # the caller: queue one layer
    "kv_store.transfer.sender_pair:SenderPair._send",      # the pair thread: one message
    "kv_store.transfer.nixl_path:NixlSend._take",          # waiting for a landing slot
    "kv_store.transfer.nixl_path:NixlSend._await_credit",  # of which reading the counter
    "kv_store.transfer.nixl_agent:NixlAgent.register",
    "kv_store.transfer.nixl_agent:NixlAgent.write",        # the NIXL write itself
    "kv_store.transfer.nixl_path:NixlSend._flush",         # per message (a read pair: copies)
    "kv_store.transfer.channel:Channel.send_frame",        # headers (and inline payloads)
    "kv_store.transfer.channel:Channel.post",              # headers not waited for
    "kv_store.transfer.channel:Channel._settle",           # waiting for a posted header
)
RECEIVER_STAGES = (
    "kv_store.transfer.channel:Channel.recv_header",       # includes waiting for the sender
    "kv_store.transfer.channel:Channel.recv_payload",      # inline payloads
    "kv_store.transfer.receiver:KVReceiver.on_message",    # ticket, record, sink
    "__main__:CacheSink.on_layer",                         # the copy into the paged cache
    "kv_store.transfer.nixl_agent:NixlAgent.read",         # of which a NIXL read (read pairs)
    "kv_store.transfer.nixl_path:NixlReceive.release",     # the credit counter
)


def run_receiver(transport: str, shape: str, tokens: int, trace: bool, slots: int,
                 pairs: int) -> None:
    torch.set_num_threads(1)
    agent = NixlAgent("127.0.0.1") if transport == "nixl" else None
    sink = CacheSink(SHAPES[shape][0], kv_shape(shape, tokens))
    stages = StageTrace()
    with (stages.wrapping(RECEIVER_STAGES if trace else ()),
          KVReceiver("127.0.0.1", 0, sink, receiver_config(slots, pairs), nixl=agent,
                     nixl_destinations=sink.cache) as receiver):
        receiver.start()
        print(json.dumps({"address": receiver.address,
                          "peer": receiver.nixl_descriptor.hex()}), flush=True)
        for line in sys.stdin:  # one line per request; EOF ends the receiver
            if line.strip() == "stats":
                print(json.dumps({**receiver.stats(), "stages": stages.snapshot()}),
                      flush=True)
            elif line.strip() == "reset":
                stages.reset()
    if agent is not None:
        agent.close()


class Receiver:
    """A receiver child process for one transport."""

    def __init__(self, transport: str, args) -> None:
        self.transport = transport
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--role", "receiver", "--transports", transport,
             "--shape", args.shape, "--tokens", str(args.tokens),
             "--nixl-slots", str(args.nixl_slots),
             "--pairs", str(len(args.coalesce) * len(args.nixl_modes)),
             *(["--trace"] if args.trace else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self.proc.stdout.readline())
        self.address, self.peer = hello["address"], bytes.fromhex(hello["peer"])

    def stats(self) -> dict:
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def reset_trace(self) -> None:
        self.proc.stdin.write("reset\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def send_prompt(sender: KVSender, rx: Receiver, rid: str, kvs: list[torch.Tensor],
                staged: bool = False) -> tuple[float, int]:
    """Seconds to send the prompt's layers and have the DONE sent, and its bytes. `staged`:
    each layer is first gathered into the sender's staging slots (`KVSender.stage`, what the
    prefill's layer hook does for a same-host reader) instead of a tensor of its own; that
    copy, like the gather of the other variants, happens before the clock starts."""
    blocks = list(range(kvs[0].shape[0]))
    if staged:
        kvs = [stage_copy(sender, rx.address, kv) for kv in kvs]
    t0 = time.perf_counter()
    for layer, kv in enumerate(kvs):
        sender.send_layer(rx.address, rid, layer, blocks, kv)
    result = sender.finish(rx.address, rid, b"").result(120)
    return time.perf_counter() - t0, result.bytes_sent


def stage_copy(sender: KVSender, address: str, kv: torch.Tensor) -> torch.Tensor:
    out = sender.stage(address, kv.shape, kv.dtype)
    return kv if out is None else out.copy_(kv)


def variant(transport: str, cap: int, mode: str) -> str:
    return f"{transport}{'-' + mode if transport == 'nixl' else ''} <={cap}/msg"


def measure(args) -> dict:
    agent = NixlAgent("127.0.0.1") if "nixl" in args.transports else None
    receivers = [Receiver(t, args) for t in args.transports]
    gen = torch.Generator().manual_seed(0)
    kvs = [torch.randn(kv_shape(args.shape, args.tokens), generator=gen)
           for _ in range(SHAPES[args.shape][0])]
    modes = args.nixl_modes
    runs = [(c, m, rx) for c in args.coalesce for m in modes for rx in receivers
            if rx.transport == "nixl" or m == modes[0]]  # gloo: once per coalesce value
    seconds = {variant(rx.transport, c, m): [] for c, m, rx in runs}
    copies, cma, nbytes, stages = [], [], 0, StageTrace()
    layer_bytes = kvs[0].numel() * kvs[0].element_size()
    kernel_copy = CmaCopy(layer_bytes * len(kvs), layer_bytes)
    senders = {(c, m): KVSender(TransferConfig(coalesce_max_parts=c, nixl_reads=m != "write"),
                                nixl=agent)
               for c in args.coalesce for m in modes}
    try:
        for cap, mode, rx in runs:
            sender = senders[cap, mode]
            sender.add_peer(rx.address, rx.peer)
            send_prompt(sender, rx, f"warm-{variant(rx.transport, cap, mode)}", kvs,
                        mode == "staged")  # opens the pair
        for rx in receivers:
            rx.reset_trace()
        with stages.wrapping(SENDER_STAGES if args.trace else ()):
            for i in range(args.prompts):
                copies.append(memcpy_bandwidth(256 * 2**20))
                cma.append(kernel_copy.measure())
                for cap, mode, rx in runs:
                    name = variant(rx.transport, cap, mode)
                    dt, nbytes = send_prompt(senders[cap, mode], rx, f"p{i}-{name}", kvs,
                                             mode == "staged")
                    seconds[name].append(dt)
        sender_stats = {f"c{c}-{m}": s.stats() for (c, m), s in senders.items()}
        receiver_stats = {rx.transport: rx.stats() for rx in receivers}
    finally:
        kernel_copy.close()
        for sender in senders.values():
            sender.close()
        for rx in receivers:
            rx.close()
        if agent is not None:
            agent.close()
    return {"seconds": seconds, "memcpy": copies, "cma": cma, "bytes": nbytes,
            "sender_stats": sender_stats, "receiver_stats": receiver_stats,
            "sender_stages": stages.snapshot()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", nargs="+", default=["nixl", "gloo"],
                        choices=["nixl", "gloo"])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--shape", default="smollm2", choices=list(SHAPES))
    parser.add_argument("--coalesce", nargs="+", type=int, default=[8, 1],
                        help="coalesce_max_parts of each sender compared (1: one layer per "
                             "message, the baseline)")
    parser.add_argument("--nixl-modes", nargs="+", default=["staged", "read", "write"],
                        choices=["staged", "read", "write"],
                        help="NIXL pairs compared: the receiver reads payloads gathered "
                             "into the sender's staging slots (staged: one copy, as the "
                             "prefill's layer hook does), or copied into them by the pair "
                             "(read: two), or the sender writes into its landing pool "
                             "(write: two, the baseline)")
    parser.add_argument("--nixl-slots", type=int, default=0,
                        help="landing slots per NIXL pair (0: TransferConfig's default)")
    parser.add_argument("--trace", action="store_true",
                        help="time each stage of the path on both sides (per layer)")
    parser.add_argument("--output", default="bench/results/transfer.json")
    parser.add_argument("--role", choices=["sender", "receiver"], default="sender")
    parser.add_argument("--pairs", type=int, default=1, help=argparse.SUPPRESS)  # receiver
    args = parser.parse_args()
    if args.role == "receiver":
        run_receiver(args.transports[0], args.shape, args.tokens, args.trace, args.nixl_slots,
                     args.pairs)
        return
    torch.set_num_threads(1)
    report(args, measure(args))


def report(args, m: dict) -> None:
    nbytes, copy_bw = m["bytes"], statistics.median(m["memcpy"])
    cma = m["cma"] if all(m["cma"]) else []  # a None: the kernel refused, no CMA column
    rows = []
    for t, secs in m["seconds"].items():
        ratios = [nbytes / s / c for s, c in zip(secs, m["memcpy"], strict=True)]
        row = {"variant": t, "MiB/prompt": nbytes / 2**20,
               "s/prompt": statistics.median(secs),
               "GB/s median": nbytes / statistics.median(secs) / 1e9,
               "GB/s best": nbytes / min(secs) / 1e9, "memcpy GB/s": copy_bw / 1e9,
               "ratio to memcpy": statistics.median(ratios)}
        if cma:
            row["CMA GB/s"] = statistics.median(cma) / 1e9
            row["ratio to CMA"] = statistics.median(
                nbytes / s / c for s, c in zip(secs, cma, strict=True))
        rows.append(row)
    layers = SHAPES[args.shape][0]
    print(f"\nKV transfer, {args.shape} shape, {args.tokens} tokens ({layers} layers), "
          f"{args.prompts} prompts per transport, load average {os.getloadavg()[0]:.1f}")
    print_table(rows, list(rows[0]))
    stage_rows = trace_rows(args, m) if args.trace else []
    if stage_rows:
        print("\nwhere the time goes, per layer sent (wall time inside each stage, any thread)")
        print_table(stage_rows, list(stage_rows[0]))
    path = write_json(args.output, {
        "bench": "transfer", "shape": args.shape, "tokens": args.tokens,
        "load_average_1_5_15m": list(os.getloadavg()),  # the machine is shared: context
        "kv_shape_per_layer": list(kv_shape(args.shape, args.tokens)), "dtype": "float32",
        "bytes_per_prompt": nbytes, "rows": rows, "seconds_per_prompt": m["seconds"],
        "memcpy_bytes_per_s": m["memcpy"], "cma_read_bytes_per_s": m["cma"],
        "sender_stats": m["sender_stats"],
        "receiver_stats": m["receiver_stats"], "coalesce": args.coalesce,
        "nixl_slots_per_pair": args.nixl_slots or TransferConfig().nixl_slots_per_pair,
        "stages_per_layer": stage_rows,
    })
    print(f"wrote {path}")


def trace_rows(args, m: dict) -> list[dict]:
    layers = SHAPES[args.shape][0] * args.prompts * len(args.coalesce)
    rows = []
    sides = [("sender", m["sender_stages"], len(args.transports))]
    sides += [(f"receiver {t}", s["stages"], 1) for t, s in m["receiver_stats"].items()]
    for side, stages, share in sides:
        for stage, v in stages.items():
            rows.append({"side": side, "stage": stage,
                         "calls/layer": v["calls"] / (layers * share),
                         "ms/layer": 1e3 * v["seconds"] / (layers * share)})
    return rows


if __name__ == "__main__":
    main()
