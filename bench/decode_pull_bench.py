"""What a decode pull buys: TTFT of a conversation's second turn on the decode worker that
does not hold the conversation's prefix.

    python bench/decode_pull_bench.py [--prefix 2048] [--tail 16] [--repeats 5]

One cluster (demo model, float32, 1 prefill + 2 decode workers, one thread each). Every repeat
starts a fresh conversation (random token ids, so no cache helps by accident): turn 1
(`--prefix` tokens) is prefilled by decode worker D0 itself, which then holds its KV; turn 2
is turn 1 + its answer + `--tail` new tokens. Turn 2 is then run three ways, in this order:

  pull        Decode on D1 with local_prefill and kv_source = D0: D1 pulls the prefix
              through the transfer engine (D0's PushKV) and computes the short rest.
  same        Decode on D0 with local_prefill: a device prefix hit (the lower bound).
  recompute   what the cluster does without a pull: the router's remote-prefill path, driven
              by hand (Decode handshake on D1, then Prefill on the prefill worker P, which never
              saw the conversation and recomputes the whole prompt). TTFT is the router's:
              until P answers with the first token (the KV transfer to D is not in it).

Why recompute goes through P rather than `local_prefill` without kv_source on D1: without the
pull, a prompt whose uncached part exceeds `--local-prefill-tokens` goes to a prefill worker,
so that is the alternative a user would see. The pull exists for exactly the case where P no
longer holds the prefix (its cache churns through every prompt) while a decode worker still
does, so P starts cold here; turn 1 is prefilled on D0 to keep it so. It also leaves D1 cold
for the pull (a local recompute on D1 would have to come first and warm D1's cache). One
flattering detail for recompute: D1 holds the prompt by then (from the pull), so P sends only
the last block instead of streaming the whole prompt's KV while it computes; on a CPU that
stream would compete with P's compute, so the gain shown here is, if anything, understated.
The defaults leave 24 tokens for D1 to compute (answer + tail), within the router's default
`--local-prefill-tokens` (32): a case where the router itself would send kv_source.

The workers are driven through their gRPC stubs, not the router, so each mode lands where it
must. Reported: median TTFT per mode, the ratios pull/recompute and pull/same, blocks and
bytes pulled per turn (D1's `kv_pulled_blocks` times the KV bytes of one block), and pull -
same, the TTFT the pull adds over a local hit. No pull bandwidth: the workers count no pull
time. Greedy outputs of the three modes must be equal; a warning is printed if not.
A short unmeasured conversation first opens the transfer pairs (D0->D1, P->D1).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.common import print_table, write_json  # noqa: E402
from pdserve.demo_model import ensure_demo_model  # noqa: E402
from pdserve.engine.checkpoint import open_checkpoint  # noqa: E402
from pdserve.launcher import ClusterSpec, LocalCluster  # noqa: E402
from pdserve.proto import pb, worker_pb, worker_pb_grpc  # noqa: E402

MODES = ("pull", "same", "recompute")
WARMUP_PREFIX = 128
RPC_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Turn:
    """One measured Decode (or handshake + Prefill) of a prompt."""

    tokens: list[int]
    ttft_s: float
    cached_tokens: int
    """Prompt tokens not computed by whoever produced the first token."""


@dataclass(frozen=True)
class Workers:
    """Stubs of the three workers, on channels kept open for the whole run."""

    d0: worker_pb_grpc.WorkerStub  # holds each conversation's prefix
    d1: worker_pb_grpc.WorkerStub  # where the second turn lands
    p: worker_pb_grpc.WorkerStub
    d0_address: str
    block_size: int
    vocab_size: int


def _sampling(max_tokens: int) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def _decode_request(rid: str, prompt: list[int], max_tokens: int, local: bool,
                    source: worker_pb.KVSource | None = None) -> worker_pb.DecodeRequest:
    return worker_pb.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=_sampling(max_tokens), seed=1,
        local_prefill=local, deadline_unix_s=time.time() + RPC_TIMEOUT_S, kv_source=source)


def _drain(events, t0: float, first: list[int], ttft_s: float | None) -> Turn:
    """Read a Decode stream to its end; TTFT is the first tokens event unless given."""
    tokens = list(first)
    for ev in events:
        kind = ev.WhichOneof("event")
        if kind == "tokens":
            if ttft_s is None:
                ttft_s = time.perf_counter() - t0
            tokens += ev.tokens.token_ids
        elif kind == "finished":
            if ttft_s is None:
                raise RuntimeError("decode stream finished without a token")
            return Turn(tokens, ttft_s, ev.finished.cached_tokens)
    raise RuntimeError("decode stream ended without a finished event")


def decode_local(stub, rid: str, prompt: list[int], max_tokens: int,
                 source: worker_pb.KVSource | None = None) -> Turn:
    """D prefills the prompt itself (after pulling from `source`, if set)."""
    t0 = time.perf_counter()
    events = stub.Decode(_decode_request(rid, prompt, max_tokens, True, source),
                         timeout=RPC_TIMEOUT_S)
    return _drain(events, t0, [], None)


def decode_remote(w: Workers, rid: str, prompt: list[int], max_tokens: int) -> Turn:
    """The router's remote-prefill path: handshake with D1, then P computes the prompt."""
    t0 = time.perf_counter()
    events = w.d1.Decode(_decode_request(rid, prompt, max_tokens, False), timeout=RPC_TIMEOUT_S)
    ready = next(events)
    if ready.WhichOneof("event") != "ready":
        raise RuntimeError("decode worker skipped the handshake")
    target = worker_pb.KVTarget(endpoints=ready.ready.endpoints,
                                block_ids=ready.ready.block_ids,
                                skip_blocks=ready.ready.cached_blocks,
                                lease_s=ready.ready.kv_lease_s,
                                kv_ticket=ready.ready.kv_ticket)
    resp = w.p.Prefill(worker_pb.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=_sampling(max_tokens), seed=1,
        target=target, deadline_unix_s=time.time() + RPC_TIMEOUT_S), timeout=RPC_TIMEOUT_S)
    ttft_s = time.perf_counter() - t0
    turn = _drain(events, t0, [resp.token_id], ttft_s)
    return Turn(turn.tokens, ttft_s, resp.cached_tokens)  # P's hits: what P did not compute


def counters(stub) -> dict[str, float]:
    return dict(stub.GetStats(worker_pb.StatsRequest(), timeout=10).counters)


def conversation(w: Workers, tag: str, rng: random.Random, a: argparse.Namespace,
                 prefix: int) -> dict:
    """Turn 1 on D0, then turn 2 in every mode; returns each mode's Turn and what D1 pulled."""
    turn1 = [rng.randrange(4, w.vocab_size) for _ in range(prefix)]
    out1 = decode_local(w.d0, f"{tag}-turn1", turn1, a.turn1_tokens).tokens
    turn2 = turn1 + out1 + [rng.randrange(4, w.vocab_size) for _ in range(a.tail)]
    # What the router's index would say D0 holds: every full block whose KV D0 computed
    # (the last sampled token has none).
    held = (len(turn1) + len(out1) - 1) // w.block_size
    before = counters(w.d1)
    turns = {"pull": decode_local(w.d1, f"{tag}-pull", turn2, a.max_tokens,
                                  worker_pb.KVSource(address=w.d0_address, blocks=held))}
    after = counters(w.d1)
    # Order matters: `same` before `recompute`, so D0 still holds only turn 1 when D1 pulls,
    # and P's cold prefill targets D1 (whose cache does not change what P computes).
    turns["same"] = decode_local(w.d0, f"{tag}-same", turn2, a.max_tokens)
    turns["recompute"] = decode_remote(w, f"{tag}-recompute", turn2, a.max_tokens)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0)
             for k in ("kv_pulls", "kv_pulled_blocks", "kv_pull_failures", "kv_pull_s",
                       "kv_pulled_bytes")}
    return {"turns": turns, "prompt_tokens": len(turn2), "held_blocks": held, **delta}


def outputs_differ(run: dict) -> list[str]:
    """Modes whose greedy output is not the pull's."""
    t = run["turns"]
    return [m for m in ("same", "recompute") if t[m].tokens != t["pull"].tokens]


def check(run: dict, i: int) -> list[str]:
    """Warnings for one repeat: outputs that differ, a pull that did not fully land."""
    t = run["turns"]
    warnings = [f"repeat {i}: {m} output {t[m].tokens} != pull output {t['pull'].tokens}"
                for m in outputs_differ(run)]
    if run["kv_pulled_blocks"] != run["held_blocks"] or run["kv_pull_failures"]:
        warnings.append(f"repeat {i}: pulled {run['kv_pulled_blocks']:.0f} of "
                        f"{run['held_blocks']} blocks ({run['kv_pull_failures']:.0f} failures)")
    return warnings


def block_bytes(model: Path, block_size: int, dtype_bytes: int = 4) -> int:
    """KV bytes of one block over all layers (K and V), as the transfer engine moves them."""
    c = open_checkpoint(model).model_config
    return c.num_layers * 2 * c.num_kv_heads * block_size * c.head_dim * dtype_bytes


def summarise(runs: list[dict], bytes_per_block: int) -> tuple[list[dict], dict]:
    rows = []
    for mode in MODES:
        ttft = [r["turns"][mode].ttft_s * 1e3 for r in runs]
        computed = [r["prompt_tokens"] - r["turns"][mode].cached_tokens for r in runs]
        rows.append({"mode": mode, "ttft_median_ms": statistics.median(ttft),
                     "ttft_min_ms": min(ttft), "ttft_max_ms": max(ttft),
                     "tokens_computed": statistics.median(computed), "runs": len(runs)})
    med = {r["mode"]: r["ttft_median_ms"] for r in rows}
    blocks = statistics.median(r["kv_pulled_blocks"] for r in runs)
    summary = {"pull_over_recompute": med["pull"] / med["recompute"],
               "pull_over_same": med["pull"] / med["same"],
               "pull_minus_same_ms": med["pull"] - med["same"],
               "pulled_blocks": blocks, "pulled_MiB": blocks * bytes_per_block / 2**20,
               # D1's own measure: PushKV call to the last part landed, over the bytes moved.
               "pull_GB_s": statistics.median(r["kv_pulled_bytes"] / r["kv_pull_s"] / 1e9
                                              for r in runs if r["kv_pull_s"] > 0) if any(
                   r["kv_pull_s"] > 0 for r in runs) else None}
    return rows, summary


def connect(cluster: LocalCluster, stack: list[grpc.Channel]) -> Workers:
    def stub(address: str) -> worker_pb_grpc.WorkerStub:
        stack.append(cluster.security.channel(address))
        return worker_pb_grpc.WorkerStub(stack[-1])

    d0, d1 = (c.info["address"] for c in cluster.workers("decode"))
    p = cluster.workers("prefill")[0].info["address"]
    info = stub(d0).GetInfo(worker_pb.InfoRequest(), timeout=10)
    vocab = open_checkpoint(cluster.spec.model).model_config.vocab_size
    return Workers(stub(d0), stub(d1), stub(p), d0, info.block_size, vocab)


def measure(a: argparse.Namespace, logs: str) -> tuple[list[dict], int]:
    """Start the cluster, warm it up, run the repeats; returns them and one block's KV bytes."""
    model = ensure_demo_model()
    # Room for a few conversations per worker (16-token blocks, the workers' default), so LRU
    # eviction only ever takes earlier conversations and memory stays small.
    blocks = 4 * -(-(a.prefix + a.turn1_tokens + a.tail) // 16) + 64
    spec = ClusterSpec(model=str(model), port=0, num_prefill=1, num_decode=2,
                       threads_per_worker=1, log_dir=logs, env={"OMP_NUM_THREADS": "1"},
                       worker_args=("--dtype", "float32", "--num-gpu-blocks", str(blocks)))
    channels: list[grpc.Channel] = []
    runs = []
    with LocalCluster(spec) as cluster:
        try:
            w = connect(cluster, channels)
            # String seeds: Random(-n) would replay Random(n)'s conversation.
            conversation(w, "warmup", random.Random("warmup"), a, min(a.prefix, WARMUP_PREFIX))
            for i in range(a.repeats):
                rng = random.Random(f"{a.seed}:{i}")
                runs.append(conversation(w, f"r{i}", rng, a, a.prefix))
                print(f"repeat {i}: " + ", ".join(
                    f"{m} {runs[-1]['turns'][m].ttft_s * 1e3:.0f} ms" for m in MODES),
                    flush=True)
        finally:
            for ch in channels:
                ch.close()
        return runs, block_bytes(model, w.block_size)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefix", type=int, default=2048, help="turn 1 prompt tokens")
    ap.add_argument("--turn1-tokens", type=int, default=8, help="tokens generated in turn 1")
    ap.add_argument("--tail", type=int, default=16, help="new user tokens in turn 2")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated in turn 2")
    ap.add_argument("--repeats", type=int, default=5, help="conversations measured")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="bench/results/decode_pull.json")
    a = ap.parse_args()
    for name in ("prefix", "turn1_tokens", "tail", "max_tokens", "repeats"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(a, name)}")
    if a.prefix < 16:
        ap.error(f"--prefix must hold at least one 16-token block, got {a.prefix}")
    return a


def main() -> None:
    a = parse_args()
    with tempfile.TemporaryDirectory() as logs:
        runs, bytes_per_block = measure(a, logs)
    warnings = [msg for i, r in enumerate(runs) for msg in check(r, i)]
    rows, summary = summarise(runs, bytes_per_block)
    print(f"\nSecond turn of a conversation ({a.prefix}-token turn 1 + {a.turn1_tokens} "
          f"answer + {a.tail} new tokens) on the decode worker without its prefix; "
          f"{a.repeats} conversations")
    print_table(rows, ["mode", "ttft_median_ms", "ttft_min_ms", "ttft_max_ms",
                       "tokens_computed", "runs"])
    print()
    print_table([summary], list(summary))
    for msg in warnings:
        print(f"WARNING: {msg}")
    detail = [{"prompt_tokens": r["prompt_tokens"], "held_blocks": r["held_blocks"],
               "kv_pulled_blocks": r["kv_pulled_blocks"],
               "kv_pull_failures": r["kv_pull_failures"],
               **{f"{m}_ttft_ms": r["turns"][m].ttft_s * 1e3 for m in MODES},
               **{f"{m}_cached_tokens": r["turns"][m].cached_tokens for m in MODES},
               **{f"{m}_tokens": r["turns"][m].tokens for m in MODES}} for r in runs]
    path = write_json(a.output, {"config": vars(a), "rows": rows, "summary": summary,
                                 "kv_bytes_per_block": bytes_per_block, "runs": detail,
                                 "outputs_equal": not any(outputs_differ(r) for r in runs),
                                 "warnings": warnings})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
