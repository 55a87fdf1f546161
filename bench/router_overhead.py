"""What the router adds: the same requests sent through the router and straight to the decode
worker's internal `Decode` RPC (local prefill, the path the router itself takes for short
prompts), in one run, alternating.

    python bench/router_overhead.py [--requests 40] [--prompt-tokens 24] [--max-tokens 32]
                                    [--tls] [--front]

Per request: TTFT and end-to-end latency on both paths, and its inter-token latency (mean
over requests, and median: robust to a noisy neighbour).
The router's added latency is the difference of the paired medians (p50) and of the 99th
percentiles; its share of ITL is (ITL via router − ITL direct) / ITL direct. With `--tls`
a second cluster runs with `--tls auto` (TLS from the client to the router, mTLS from the
router and from this script to the decode worker); both clusters are measured in one run,
request by request in turn, and the last row is what TLS adds to the router's cost. With
`--front` a second cluster's router runs with `--no-grpc-front` (grpc-core owning the public
port), and the last row is what the gRPC front (`pdserve.serving.grpc_front`) adds.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from pdserve.client import Client  # noqa: E402
from pdserve.demo_model import ensure_demo_model  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402
from pdserve.launcher import ClusterSpec, LocalCluster  # noqa: E402
from pdserve.proto import worker_pb, worker_pb_grpc  # noqa: E402
from pdserve.serving.convert import params_to_pb  # noqa: E402


def timed(events) -> tuple[float, float, list[float]]:
    """(ttft, e2e, token arrival times) of an iterator of token batches."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    for n in events:
        arrivals.extend([time.perf_counter()] * n)
    return arrivals[0] - t0, arrivals[-1] - t0, arrivals


def via_router(client: Client, prompt, max_tokens):
    return timed(len(c.token_ids) for c in client.stream(
        prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, timeout=120)
        if c.token_ids)


def direct(stub, prompt, max_tokens, i):
    req = worker_pb.DecodeRequest(
        request_id=f"direct-{i}", prompt_token_ids=prompt, seed=0, local_prefill=True,
        sampling=params_to_pb(SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                             ignore_eos=True)))
    return timed(len(ev.tokens.token_ids) for ev in stub.Decode(req, timeout=120)
                 if ev.WhichOneof("event") == "tokens")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(runs, max_tokens: int) -> dict[str, float]:
    itl = [(e2e - ttft) / (max_tokens - 1) for ttft, e2e, _ in runs]
    return {"ttft_p50_ms": pct([r[0] for r in runs], 0.5) * 1e3,
            "ttft_p99_ms": pct([r[0] for r in runs], 0.99) * 1e3,
            "e2e_p50_ms": pct([r[1] for r in runs], 0.5) * 1e3,
            "e2e_p99_ms": pct([r[1] for r in runs], 0.99) * 1e3,
            "itl_mean_ms": statistics.mean(itl) * 1e3,
            "itl_p50_ms": pct(itl, 0.5) * 1e3}


METRICS = ["ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "itl_mean_ms",
           "itl_p50_ms"]


def open_paths(cluster: LocalCluster, stack: contextlib.ExitStack):
    """(router client, decode worker stub) of one cluster, closed with `stack`."""
    client = stack.enter_context(Client(cluster.address,
                                        root_certificates=cluster.root_certificates))
    ch = stack.enter_context(cluster.security.channel(
        cluster.workers("decode")[0].info["address"]))
    return client, worker_pb_grpc.WorkerStub(ch)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tls", action="store_true",
                    help="also a cluster with --tls auto (mTLS to the workers, TLS to the "
                         "router), measured in the same run, alternating with plaintext")
    ap.add_argument("--front", action="store_true",
                    help="also a cluster whose router runs --no-grpc-front, measured in the "
                         "same run: what the gRPC front costs")
    ap.add_argument("--output", default=None)
    a = ap.parse_args()
    output = a.output or ("bench/results/router_overhead_tls.json" if a.tls
                          else "bench/results/router_overhead_front.json" if a.front
                          else "bench/results/router_overhead.json")
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 4000) for _ in range(a.prompt_tokens)]
               for _ in range(a.requests)]
    modes = ["plaintext"] + (["tls"] if a.tls else []) + (["no-front"] if a.front else [])
    res = {(m, path): [] for m in modes for path in ("router", "direct")}
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        paths = {}
        for m in modes:
            spec = ClusterSpec(model=str(ensure_demo_model()), port=0, num_prefill=0,
                               log_dir=f"{logs}/{m}", worker_args=("--dtype", "float32"),
                               tls=m == "tls",
                               router_args=("--no-grpc-front",) if m == "no-front" else ())
            paths[m] = open_paths(stack.enter_context(LocalCluster(spec)), stack)
        for client, stub in paths.values():
            via_router(client, prompts[0], 4)
            direct(stub, prompts[0], 4, -1)
        for i, p in enumerate(prompts):  # alternate, so load drifts hit every path
            for m, (client, stub) in paths.items():
                res[m, "router"].append(via_router(client, p, a.max_tokens))
                res[m, "direct"].append(direct(stub, p, a.max_tokens, f"{m}-{i}"))
    rows, added = [], {}
    for m in modes:
        r, d = summarize(res[m, "router"], a.max_tokens), summarize(res[m, "direct"],
                                                                   a.max_tokens)
        added[m] = {k: r[k] - d[k] for k in METRICS}
        rows += [{"mode": m, "path": "router", **r}, {"mode": m, "path": "direct", **d},
                 {"mode": m, "path": "router adds", **added[m]}]
        added[m]["itl_share"] = added[m]["itl_mean_ms"] / d["itl_mean_ms"]
    if a.tls:
        rows.append({"mode": "tls - plaintext", "path": "router adds",
                     **{k: added["tls"][k] - added["plaintext"][k] for k in METRICS}})
    if a.front:
        rows.append({"mode": "plaintext - no-front", "path": "router adds",
                     **{k: added["plaintext"][k] - added["no-front"][k] for k in METRICS}})
    print(f"\nRouter overhead, {a.requests} requests x {a.prompt_tokens}-token prompts, "
          f"{a.max_tokens} new tokens")
    print_table(rows, ["mode", "path", *METRICS])
    for m in modes:
        print(f"router share of ITL ({m}): {added[m]['itl_share']:.2%}")
    print(f"\nwrote {write_json(output, {'rows': rows, 'added': added})}")


if __name__ == "__main__":
    main()
