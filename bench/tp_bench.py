"""Tensor parallelism on this machine: prefill throughput at TP=1 vs TP=2, and the KV bytes a
prefill moves to the decode worker with and without re-sharding.

    python bench/tp_bench.py [--prompt-tokens 1024] [--prompts 4]

Prefill throughput: `LLM(tensor_parallel_size=N)` prefilling the same prompts (max_tokens=1),
with the same total thread budget (TP=1: all cores in one process; TP=2: one per rank).
Bytes moved: what the prefill workers' streaming code (`KVStreamer.layer_hook`, run for every
prefill rank against a counting stand-in for the transfer engine) sends for one prompt over all
(prefill rank, decode rank) pairs, for several degree pairs — re-sharding must not move more
bytes, only split them differently.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from bench.common import print_table, write_json  # noqa: E402
from pdserve.demo_model import ensure_demo_model  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402


def prompts(n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(4, 4000) for _ in range(length)] for _ in range(n)]


def prefill_tps(model: str, tp: int, ps: list[list[int]]) -> float:
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // tp))
    params = SamplingParams(max_tokens=1, temperature=0.0)
    with LLM(model, dtype="float32", tensor_parallel_size=tp, enable_prefix_caching=False,
             max_num_batched_tokens=2048) as llm:
        llm.generate(ps[:1], params)  # warm-up
        t0 = time.perf_counter()
        llm.generate(ps, params)
        return sum(len(p) for p in ps) / (time.perf_counter() - t0)


class _CountingSender:
    """Stands in for the transfer engine: counts the bytes each (sender, receiver) pair gets."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}

    def send_layer(self, address, request_id, layer, block_ids, kv, head_start=0, lease_s=None,
                   ticket=b"") -> None:
        self.bytes[address] = self.bytes.get(address, 0) + kv.numel() * kv.element_size()


def kv_bytes(prefill_tp: int, decode_tp: int, prompt_tokens: int) -> dict:
    """Bytes every prefill rank's real streaming code sends for one prompt (demo model shape:
    12 layers, 4 KV heads, head_dim 64, fp32, block 16), summed over all pairs."""
    from pdserve.engine.kv_layout import KVLayout
    from pdserve.engine.quant.kv_format import KVCacheFormat
    from prefill_worker.kv_streamer import BlockSend, KVStreamer

    layers, kv_heads, head_dim, bs = 12, 4, 64, 16
    layout = KVLayout.gqa(layers, kv_heads, head_dim, bs, KVCacheFormat(torch.float32))
    blocks = -(-prompt_tokens // bs)
    endpoints = [(f"decode-rank-{r}", r, decode_tp) for r in range(decode_tp)]
    send = BlockSend("r", endpoints, list(range(blocks)), list(range(blocks)), True, 60.0,
                     b"t" * 16)
    total, pairs = 0, 0
    for rank in range(prefill_tp):
        caches = layout.new_caches(blocks, prefill_tp, torch.device("cpu"))
        sender = _CountingSender()
        hook = KVStreamer(sender, caches, bs, layout, rank, prefill_tp).layer_hook([send])
        for layer in range(layers):
            hook(layer)
        total += sum(sender.bytes.values())
        pairs += len(sender.bytes)
    return {"prefill_tp": prefill_tp, "decode_tp": decode_tp, "pairs": pairs,
            "kv_bytes": total}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--output", default="bench/results/tp.json")
    a = ap.parse_args()
    model = str(ensure_demo_model())
    ps = prompts(a.prompts, a.prompt_tokens)
    tps = {tp: prefill_tps(model, tp, ps) for tp in (1, 2)}
    rows = [{"tp": tp, "prefill_tok_s": v, "vs_tp1": v / tps[1]} for tp, v in tps.items()]
    print(f"\nPrefill throughput, {a.prompts} x {a.prompt_tokens}-token prompts, "
          f"{os.cpu_count()} cores in total")
    print_table(rows, ["tp", "prefill_tok_s", "vs_tp1"])
    moved = [kv_bytes(ptp, dtp, a.prompt_tokens)
             for ptp, dtp in ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4))]
    base = moved[0]["kv_bytes"] or 1
    for m in moved:
        m["vs_no_resharding"] = m["kv_bytes"] / base
    print(f"\nKV bytes moved for one {a.prompt_tokens}-token prompt (all pairs)")
    print_table(moved, ["prefill_tp", "decode_tp", "pairs", "kv_bytes", "vs_no_resharding"])
    print(f"\nwrote {write_json(a.output, {'prefill': rows, 'kv_bytes': moved})}")


if __name__ == "__main__":
    main()
