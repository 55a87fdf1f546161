"""Routing decision latency: `PrefixIndex.match` + a KV-aware cost over 64 workers.

    python bench/routing_bench.py [--workers 64] [--queries 3000] [--seed 0]
                                  [--output bench/results/routing.json]

Synthetic cluster state with many shared prefixes (block size 16): 40 system prompts of 32
blocks; 2,200 cached conversations = a system prompt + one of 400 documents (24 blocks) + a
private tail (24 blocks); 8 long documents of 1,024 blocks. Each conversation is cached on 1-3
workers, each long document on 16; a worker holds a conversation in device (60%), host (30%)
or SSD (10%) memory. About 100k distinct block hashes are indexed.

A decision (decide_*) = `match(hashes)` (also timed alone: match_*) + for every worker:
cost = uncached prompt tokens (blocks in host or SSD memory count as 0.2 / 0.5 of a recompute)
+ queued tokens, then the argmin. Hashing the prompt is timed separately (the router does it
once per request, whatever the index). Query kinds: "shared" (a new conversation on a cached
system prompt + document), "repeat" (a cached conversation plus one new turn), "long" (a cached
1,024-block document, fully matched on 16 workers), "miss" (nothing cached). A naive per-worker
walk (O(workers x blocks)) is timed on every tenth query for reference. The machine's load
average is recorded: on a shared machine the absolute numbers move with it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from kv_store.index import PrefixIndex, PrefixMatch, Tier  # noqa: E402
from pdserve.block_hash import chain_hashes  # noqa: E402

BLOCK = 16
HOST_COST, SSD_COST = 0.2, 0.5  # loading a block from host / SSD, as a share of recomputing it


VOCAB = range(32_000)


def tokens(rng: random.Random, blocks: int) -> list[int]:
    return rng.choices(VOCAB, k=blocks * BLOCK)


class Workload:
    """Prompts (token lists) and which worker caches which, in which tier."""

    def __init__(self, rng: random.Random, workers: int) -> None:
        self.systems = [tokens(rng, 32) for _ in range(40)]
        self.docs = [tokens(rng, 24) for _ in range(400)]
        self.convs = [rng.choice(self.systems) + rng.choice(self.docs) + tokens(rng, 24)
                      for _ in range(2200)]
        self.longs = [tokens(rng, 1024) for _ in range(8)]
        self.placement: list[tuple[int, list[bytes], Tier]] = []
        tiers = [Tier.DEVICE] * 6 + [Tier.HOST] * 3 + [Tier.SSD]
        for conv in self.convs:
            hashes = chain_hashes(conv, BLOCK)
            for w in rng.sample(range(workers), rng.randint(1, 3)):
                self.placement.append((w, hashes, rng.choice(tiers)))
        for doc in self.longs:
            hashes = chain_hashes(doc, BLOCK)
            for w in rng.sample(range(workers), 16):
                self.placement.append((w, hashes, Tier.DEVICE))

    def query(self, kind: str, rng: random.Random) -> list[int]:
        if kind == "shared":
            return rng.choice(self.systems) + rng.choice(self.docs) + tokens(rng, 24)
        if kind == "repeat":
            return rng.choice(self.convs) + tokens(rng, 8)
        if kind == "long":
            return rng.choice(self.longs)
        return tokens(rng, 80)


def decide(matches: dict[str, PrefixMatch], prompt_blocks: int,
           queued: dict[str, int]) -> str:
    """Cheapest worker: tokens still to compute (tier-weighted) + queued tokens."""
    best, best_cost = "", float("inf")
    for w, load in queued.items():
        m = matches.get(w)
        if m is None:
            cost = prompt_blocks * BLOCK + load
        else:
            device, host, blocks = m.leading  # leading runs: device, host or better, any tier
            redo = (prompt_blocks - blocks) + HOST_COST * (host - device) + SSD_COST * (
                blocks - host)
            cost = redo * BLOCK + load
        if cost < best_cost:
            best, best_cost = w, cost
    return best


def naive_match(held: dict[str, set[bytes]], hashes: list[bytes]) -> dict[str, int]:
    out = {}
    for w, blocks in held.items():
        n = 0
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        if n:
            out[w] = n
    return out


def percentile(sorted_us: list[float], q: float) -> float:
    return sorted_us[min(len(sorted_us) - 1, int(q * len(sorted_us)))]


def measure(index: PrefixIndex, held: dict[str, set[bytes]], queries: list[list[int]],
            queued: dict[str, int], naive_every: int = 10) -> dict:
    hash_us, match_us, decide_us, naive_us, matched = [], [], [], [], []
    for i, q in enumerate(queries):
        t0 = time.perf_counter_ns()
        hashes = chain_hashes(q, BLOCK)
        t1 = time.perf_counter_ns()
        matches = index.match(hashes)
        t_match = time.perf_counter_ns()
        decide(matches, len(hashes), queued)
        t2 = time.perf_counter_ns()
        hash_us.append((t1 - t0) / 1e3)
        match_us.append((t_match - t1) / 1e3)
        decide_us.append((t2 - t1) / 1e3)
        matched.append(max((m.blocks for m in matches.values()), default=0))
        if i % naive_every == 0:  # the slow reference, on a sample of the same queries
            t3 = time.perf_counter_ns()
            naive_match(held, hashes)
            naive_us.append((time.perf_counter_ns() - t3) / 1e3)
    decide_us.sort()
    return {
        "prompt_blocks": round(statistics.mean(len(q) // BLOCK for q in queries)),
        "best_hit_blocks": round(statistics.mean(matched), 1),
        "match_p50_us": statistics.median(match_us),
        "decide_p50_us": percentile(decide_us, 0.50),
        "decide_p99_us": percentile(decide_us, 0.99),
        "naive_match_p50_us": statistics.median(naive_us),
        "hash_p50_us": statistics.median(hash_us),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--queries", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="bench/results/routing.json")
    args = parser.parse_args()
    rng = random.Random(args.seed)

    load = Workload(rng, args.workers)
    index = PrefixIndex()
    held: dict[str, set[bytes]] = {f"w{w}": set() for w in range(args.workers)}
    t0 = time.perf_counter()
    for w, hashes, tier in load.placement:
        index.store(f"w{w}", hashes, tier)
    build_s = time.perf_counter() - t0
    entries = sum(len(h) for _, h, _ in load.placement)
    for w, hashes, _ in load.placement:
        held[f"w{w}"].update(hashes)
    queued = {f"w{w}": rng.randrange(0, 8192) for w in range(args.workers)}

    rows = []
    for kind in ("shared", "repeat", "long", "miss"):
        queries = [load.query(kind, rng) for _ in range(args.queries)]
        rows.append({"query": kind, **measure(index, held, queries, queued)})
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; "
          f"{args.workers} workers, {index.num_blocks():,} distinct blocks indexed, "
          f"{entries:,} (worker, block) entries, built in {build_s:.2f}s "
          f"({entries / build_s / 1e6:.2f}M hashes/s)\n")
    columns = ["query", "prompt_blocks", "best_hit_blocks", "match_p50_us", "decide_p50_us",
               "decide_p99_us",
               "naive_match_p50_us", "hash_p50_us"]
    print_table(rows, columns)
    path = write_json(args.output, {
        "bench": "routing", "workers": args.workers, "distinct_blocks": index.num_blocks(),
        "entries": entries, "build_s": build_s, "load_avg_1m": os.getloadavg()[0],
        "queries_per_kind": args.queries, "block_size": BLOCK, "results": rows})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
