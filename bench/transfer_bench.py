"""KV transfer throughput over gloo on loopback vs this machine's memory copy bandwidth.

    python bench/transfer_bench.py [--prompts 10] [--tokens 2048]
                                   [--output bench/results/transfer.json]

A receiver process (this script with `--role receiver`) owns a paged KV cache of the demo model's
shape and a `KVReceiver` whose sink copies every layer into it, as a decode worker does. This
process is the prefill side: for each prompt it sends the prompt's KV layer by layer (12 layers
x 128 blocks of 16 tokens x 4 KV heads x 64 dims, fp32: 4 MiB per layer, 48 MiB per prompt) and
waits for the DONE marker to be sent. Throughput = payload bytes / time from the first
`send_layer` to the resolved future. The ratio compares it with a large `torch` tensor copy.
The two processes talk over a pipe in JSON lines (address out, stats on request).
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

from bench.common import memcpy_bandwidth, print_table, write_json  # noqa: E402
from kv_store.transfer import KVReceiver, KVSender, TransferConfig  # noqa: E402
from pdserve.demo_model import DemoModelConfig  # noqa: E402

BLOCK_SIZE = 16


def kv_shape(tokens: int) -> tuple[int, ...]:
    """Shape of one layer's blocks for a `tokens`-long prompt of the demo model."""
    model = DemoModelConfig()
    blocks = -(-tokens // BLOCK_SIZE)
    return (blocks, 2, model.num_key_value_heads, BLOCK_SIZE, model.resolved_head_dim)


class CacheSink:
    """The receiver's sink: copies each layer into its paged cache, like a decode worker."""

    def __init__(self, layers: int, shape: tuple[int, ...]) -> None:
        self.cache = [torch.zeros((2 * shape[0], *shape[1:])) for _ in range(layers)]

    def on_layer(self, request_id, layer, block_ids, kv):
        self.cache[layer][block_ids] = kv

    def on_done(self, request_id, body):
        pass

    def on_failed(self, request_id, reason):
        print(json.dumps({"failed": request_id, "reason": reason}), file=sys.stderr, flush=True)


def run_receiver(tokens: int) -> None:
    torch.set_num_threads(1)
    sink = CacheSink(DemoModelConfig().num_hidden_layers, kv_shape(tokens))
    with KVReceiver("127.0.0.1", 0, sink, TransferConfig()) as receiver:
        receiver.start()
        print(json.dumps({"address": receiver.address}), flush=True)
        for line in sys.stdin:  # one line per stats request; EOF ends the receiver
            if line.strip() == "stats":
                print(json.dumps(receiver.stats()), flush=True)


def send_prompts(address: str, tokens: int, prompts: int) -> tuple[list[float], int, dict]:
    """Send `prompts` prompts (after one warm-up that opens the pair); seconds per prompt."""
    layers = DemoModelConfig().num_hidden_layers
    shape = kv_shape(tokens)
    gen = torch.Generator().manual_seed(0)
    kvs = [torch.randn(shape, generator=gen) for _ in range(layers)]
    blocks = list(range(shape[0]))
    seconds = []
    with KVSender(TransferConfig()) as sender:
        for i in range(prompts + 1):
            rid = f"bench-{i}"
            t0 = time.perf_counter()
            for layer, kv in enumerate(kvs):
                sender.send_layer(address, rid, layer, blocks, kv)
            result = sender.finish(address, rid, b"").result(120)
            if i:  # the first prompt pays for the pair's rendezvous
                seconds.append(time.perf_counter() - t0)
        stats = sender.stats()
    return seconds, result.bytes_sent, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--output", default="bench/results/transfer.json")
    parser.add_argument("--role", choices=["sender", "receiver"], default="sender")
    args = parser.parse_args()
    if args.role == "receiver":
        run_receiver(args.tokens)
        return
    torch.set_num_threads(1)
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "receiver", "--tokens", str(args.tokens)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        address = json.loads(child.stdout.readline())["address"]
        seconds, nbytes, sender_stats = send_prompts(address, args.tokens, args.prompts)
        child.stdin.write("stats\n")
        child.stdin.flush()
        receiver_stats = json.loads(child.stdout.readline())
    finally:
        child.stdin.close()
        child.wait(30)
    report(args, seconds, nbytes, sender_stats, receiver_stats)


def report(args, seconds: list[float], nbytes: int, sender_stats: dict,
           receiver_stats: dict) -> None:
    copy_bw = memcpy_bandwidth(256 * 2**20)
    median_bw = nbytes / statistics.median(seconds)
    best_bw = nbytes / min(seconds)
    shape = kv_shape(args.tokens)
    rows = [
        {"metric": "prompt tokens", "value": args.tokens},
        {"metric": "layers x blocks/layer", "value": f"{DemoModelConfig().num_hidden_layers} x "
                                                     f"{shape[0]}"},
        {"metric": "bytes per prompt (MiB)", "value": nbytes / 2**20},
        {"metric": "prompts timed", "value": len(seconds)},
        {"metric": "seconds per prompt (median)", "value": statistics.median(seconds)},
        {"metric": "transfer throughput median (GB/s)", "value": median_bw / 1e9},
        {"metric": "transfer throughput best (GB/s)", "value": best_bw / 1e9},
        {"metric": "memory copy bandwidth (GB/s)", "value": copy_bw / 1e9},
        {"metric": "ratio median / memcpy", "value": median_bw / copy_bw},
        {"metric": "load average (1 min)", "value": os.getloadavg()[0]},
    ]
    print_table(rows, ["metric", "value"])
    path = write_json(args.output, {
        "bench": "transfer",
        "load_average_1_5_15m": list(os.getloadavg()),  # the machine is shared: context
        "backend": "gloo",
        "kv_shape_per_layer": list(shape),
        "dtype": "float32",
        "bytes_per_prompt": nbytes,
        "seconds_per_prompt": seconds,
        "throughput_bytes_per_s": {"median": median_bw, "best": best_bw},
        "memcpy_bytes_per_s": copy_bw,
        "ratio_median_to_memcpy": median_bw / copy_bw,
        "sender_stats": sender_stats,
        "receiver_stats": receiver_stats,
    })
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
