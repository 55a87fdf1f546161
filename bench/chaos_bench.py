"""Chaos: what plain clients see when a worker dies or stalls, the router restarts, or the load
is far over capacity.

    python bench/chaos_bench.py [--rows decode-kill,prefill-kill,decode-stop,router-restart,
        overload,huge-prompt,burst,router-drain,decode-drain] [--model DIR] [--requests 200]
        [--concurrency 8]
        [--max-tokens 32] [--deadline 30]

Fault rows start a fresh supervised cluster (what `pdserve up` runs: a killed process is
started again on its port) of 2 prefill + 2 decode workers, send `--requests` greedy requests
through plain gRPC clients (no retries; a client whose request failed waits --fail-pause, 0.1 s,
before its next one, as a client with nothing to retry would) at fixed concurrency, and inject
the fault once 30% of them have completed:

    decode-kill     SIGKILL one decode worker
    prefill-kill    SIGKILL one prefill worker
    decode-stop     SIGSTOP one decode worker for --stop-s (20) seconds, then SIGCONT
    router-restart  SIGKILL the router (the supervisor starts it again on its port)

Drain rows (1 prefill worker; --drain-streams streams of --drain-tokens tokens, each already
streaming, then SIGTERM; the router runs with --shutdown-grace 60):

    router-drain    SIGTERM the router (1 decode worker)
    decode-drain    SIGTERM one of 2 decode workers; also the migrations the router counted
                    meanwhile (streams moved off the draining worker) and new attempts the
                    draining worker refused

Load rows use 1 prefill + 1 decode worker (the `pdserve up` default):

    overload     the cluster's capacity first: completions within --deadline of a closed loop
                 at the decode worker's batch size; then 5x that many requests at once, with
                 that deadline, admission on, and again with the router's --no-admission
                 (the baseline: what happened before admission control)
    burst        the same with 300 requests, max_tokens 64 and a 120 s deadline (issue 12)
    huge-prompt  a 50 MB and a 4 MB text prompt over gRPC and over the HTTP API: time until
                 refused, and the latency of health checks and of a small request sent
                 meanwhile

Per row: OK %, failures by status, OK outputs that differ from the single-process engine's
(greedy), p99 latency of OK requests and its ratio to the same load without a fault (measured
first, in the same run), recovery time: from the fault to the end of the last failed request
(0 when none failed), and for a killed process the time until it served again (back_s).
Prints a table; JSON to bench/results/chaos_bench.json.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from bench.common import print_table, write_json  # noqa: E402
from pdserve.demo_model import ensure_demo_model  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.checkpoint import open_checkpoint  # noqa: E402
from pdserve.launcher import ClusterSpec, LocalCluster  # noqa: E402
from pdserve.proto import pb, pb_grpc  # noqa: E402

FAULT_ROWS = ("decode-kill", "prefill-kill", "decode-stop", "router-restart")
LOAD_ROWS = ("overload", "burst", "huge-prompt")
DRAIN_ROWS = ("router-drain", "decode-drain")


@dataclass
class Outcome:
    index: int
    status: str = "OK"
    tokens: list[int] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    detail: str = ""


# -- load ------------------------------------------------------------------------------------


def request(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def one(stub, i: int, req: pb.GenerateRequest, timeout_s: float) -> Outcome:
    out = Outcome(i, start=time.monotonic())
    try:
        async for msg in stub.Generate(req, timeout=timeout_s):
            out.tokens.extend(msg.token_ids)
    except grpc.aio.AioRpcError as exc:
        out.status = exc.code().name
        out.detail = exc.details() or ""
    out.end = time.monotonic()
    return out


async def closed_loop(address: str, reqs: list[pb.GenerateRequest], concurrency: int,
                      timeout_s: float, on_done=None, fail_pause_s: float = 0.0
                      ) -> list[Outcome]:
    """Every request once, `concurrency` at a time; `on_done(n_done)` after each; a failed
    request holds its slot `fail_pause_s` longer."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = pb_grpc.PDServeStub(ch)
        sem, done = asyncio.Semaphore(concurrency), [0]

        async def run(i, r):
            async with sem:
                out = await one(stub, i, r, timeout_s)
                if out.status != "OK":
                    await asyncio.sleep(fail_pause_s)
            done[0] += 1
            if on_done is not None:
                await on_done(done[0])
            return out

        return list(await asyncio.gather(*(run(i, r) for i, r in enumerate(reqs))))


# -- graceful drain --------------------------------------------------------------------------


def drain_row(row: str, a, model: Path, logs: Path, reqs, expected) -> dict:
    """`--drain-streams` streams in flight (each has its first tokens), then SIGTERM to the
    router (`router-drain`) or to one of two decode workers (`decode-drain`): how many of
    them complete, how long the process took to exit, and (decode-drain) how many of them
    the router moved to the other worker meanwhile (0: the drain finished them itself) and
    how many new attempts the draining worker refused."""
    decode = 2 if row == "decode-drain" else 1
    cluster = start(model, logs / row, 1, decode, ("--shutdown-grace", "60"))
    counted = row == "decode-drain"  # the router's counters outlive only a worker's drain
    moved: dict[str, float | None] = {}
    try:
        victim = cluster.router if row == "router-drain" else cluster.workers("decode")[0]
        proc = victim.proc  # this process, not the one the supervisor starts after it
        signalled, exited = [0.0], [None]
        before = router_counters(cluster) if counted else {}

        async def main() -> list[Outcome]:
            async with grpc.aio.insecure_channel(cluster.address) as ch:
                stub = pb_grpc.PDServeStub(ch)
                outs = [Outcome(i) for i in range(len(reqs))]

                async def stream(o: Outcome, r) -> None:
                    o.start = time.monotonic()
                    try:
                        async for msg in stub.Generate(r, timeout=a.timeout):
                            o.tokens.extend(msg.token_ids)
                    except grpc.aio.AioRpcError as exc:
                        o.status, o.detail = exc.code().name, exc.details() or ""
                    o.end = time.monotonic()

                tasks = [asyncio.create_task(stream(o, r))
                         for o, r in zip(outs, reqs, strict=True)]
                while not all(o.tokens or t.done() for o, t in zip(outs, tasks, strict=True)):
                    await asyncio.sleep(0.02)
                signalled[0] = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                while proc.poll() is None and time.monotonic() < signalled[0] + 120:
                    await asyncio.sleep(0.05)
                exited[0] = time.monotonic() - signalled[0] if proc.poll() is not None \
                    else None
                await asyncio.gather(*tasks)
                return outs

        outs = asyncio.run(main())
        if counted:
            after = router_counters(cluster)
            moved = {k: after[k] - before[k] for k in after}
    finally:
        cluster.stop()
    return {**summarize(row, outs, expected, signalled[0]), "exit_s": exited[0],
            "migrations": moved.get("migrations"), "drain_refusals": moved.get("drain_refusals")}


def router_counters(cluster: LocalCluster) -> dict[str, float]:
    """The router's migration and drain-refusal counts so far."""
    names = {"migrations": "pdserve_router_migrations_total",
             "drain_refusals": "pdserve_router_drain_refusals_total"}
    return {k: router_gauge(cluster, name) or 0.0 for k, name in names.items()}


# -- clusters --------------------------------------------------------------------------------


def start(model: Path, logs: Path, prefill: int, decode: int, router_args=()) -> LocalCluster:
    spec = ClusterSpec(model=str(model), port=0, num_prefill=prefill, num_decode=decode,
                       threads_per_worker=1, worker_args=("--dtype", "float32"),
                       router_args=tuple(router_args), log_dir=str(logs),
                       env={"OMP_NUM_THREADS": "1"})
    return LocalCluster(spec).start(supervise=True)


def inject(cluster: LocalCluster, row: str, stop_s: float):
    """Inject the row's fault; returns the child killed (None for a stop)."""
    if row == "router-restart":
        cluster.router.proc.send_signal(signal.SIGKILL)
        return cluster.router
    role = "decode" if row.startswith("decode") else "prefill"
    victim = cluster.workers(role)[0]
    if row == "decode-stop":
        victim.proc.send_signal(signal.SIGSTOP)
        asyncio.get_running_loop().call_later(stop_s, victim.proc.send_signal, signal.SIGCONT)
        return None
    victim.proc.send_signal(signal.SIGKILL)
    return victim


def watch_back(child, fault_at: float, out: list) -> None:
    """Record in `out` the seconds from the fault until `child` (respawned by the
    supervisor) announced itself again."""
    def poll():
        end = fault_at + 300
        while time.monotonic() < end:
            if child.restarts > 0 and child.ready.is_set():
                out.append(time.monotonic() - fault_at)
                return
            time.sleep(0.05)

    threading.Thread(target=poll, daemon=True).start()


def fault_row(row: str, a, model: Path, logs: Path, reqs, expected) -> dict:
    cluster = start(model, logs / row, 2, 2)
    back: list[float] = []
    try:
        fault_at = [None]

        async def on_done(n: int) -> None:
            if fault_at[0] is None and n >= 0.3 * len(reqs):
                fault_at[0] = time.monotonic()
                killed = inject(cluster, row, a.stop_s)
                if killed is not None:
                    watch_back(killed, fault_at[0], back)

        outs = asyncio.run(closed_loop(cluster.address, reqs, a.concurrency, a.timeout,
                                       on_done, a.fail_pause))
        end = time.monotonic() + 120
        while row != "decode-stop" and not back and time.monotonic() < end:
            time.sleep(0.1)  # the load may end before the killed process is back
    finally:
        for c in cluster.children:  # a stopped worker must not outlive the row
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGCONT)
        cluster.stop()
    return {**summarize(row, outs, expected, fault_at[0]),
            "back_s": back[0] if back else None}


def baseline_row(a, model: Path, logs: Path, reqs, expected) -> dict:
    cluster = start(model, logs / "baseline", 2, 2)
    try:
        outs = asyncio.run(closed_loop(cluster.address, reqs, a.concurrency, a.timeout))
    finally:
        cluster.stop()
    return summarize("no fault", outs, expected, None)


def summarize(row: str, outs: list[Outcome], expected, fault_at: float | None) -> dict:
    ok = [o for o in outs if o.status == "OK"]
    failed = [o for o in outs if o.status != "OK"]
    lat = sorted(o.end - o.start for o in ok)
    return {
        "row": row, "requests": len(outs), "ok_pct": 100.0 * len(ok) / max(len(outs), 1),
        "failures": dict(collections.Counter(o.status for o in failed)),
        "failure_examples": {o.status: o.detail for o in failed},
        "wrong_outputs": sum(1 for o in ok if expected is not None
                             and o.tokens != expected[o.index]),
        "p99_s": percentile(lat, 0.99),
        "recovery_s": (max(o.end for o in failed) - fault_at
                       if failed and fault_at is not None else 0.0),
        # Lost while running (sent before the fault) vs refused while a process was away.
        "cut_in_flight": (sum(1 for o in failed if o.start < fault_at)
                          if fault_at is not None else 0),
    }


def percentile(sorted_values: list[float], q: float) -> float | None:
    if not sorted_values:
        return None
    return sorted_values[min(int(q * len(sorted_values)), len(sorted_values) - 1)]


# -- load rows -------------------------------------------------------------------------------


def capacity(address: str, prompts, max_tokens: int, deadline_s: float, concurrency: int
             ) -> int:
    """Requests a closed loop at `concurrency` completes within `deadline_s`."""
    async def main():
        end = time.monotonic() + deadline_s
        done = [0]
        async with grpc.aio.insecure_channel(address) as ch:
            stub = pb_grpc.PDServeStub(ch)

            async def worker(k):
                i = k
                while time.monotonic() < end:
                    out = await one(stub, i, request(prompts[i % len(prompts)], max_tokens),
                                    max(end - time.monotonic(), 0.01))
                    done[0] += out.status == "OK"
                    i += concurrency

            await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return done[0]

    return asyncio.run(main())


def burst(address: str, prompts, n: int, max_tokens: int, deadline_s: float) -> list[Outcome]:
    reqs = [request(prompts[i % len(prompts)], max_tokens) for i in range(n)]
    return asyncio.run(closed_loop(address, reqs, n, deadline_s))


def load_row(row: str, a, model: Path, logs: Path, prompts) -> list[dict]:
    n, max_tokens, deadline = (None, a.max_tokens, a.deadline) if row == "overload" else (
        a.burst_requests, 64, 120.0)
    rows = []
    for admission in (True, False):
        args = () if admission else ("--no-admission",)
        cluster = start(model, logs / f"{row}-{admission}", 1, 1, args)
        try:
            cap = capacity(cluster.address, prompts, max_tokens, deadline, a.capacity_concurrency)
            offered = 5 * cap if n is None else n
            slowdown = router_gauge(cluster, "pdserve_router_admission_slowdown")
            outs = burst(cluster.address, prompts, offered, max_tokens, deadline)
        finally:
            cluster.stop()
        s = summarize(f"{row} ({'admission' if admission else 'no admission'})", outs, None,
                      None)
        ok = sum(1 for o in outs if o.status == "OK")
        refused = [o.end - o.start for o in outs if o.status == "RESOURCE_EXHAUSTED"]
        s.update(offered=offered, capacity=cap, completed_vs_capacity=ok / max(min(cap, offered),
                                                                              1),
                 refusal_p99_s=percentile(sorted(refused), 0.99), slowdown=slowdown)
        rows.append(s)
    return rows


def router_gauge(cluster: LocalCluster, name: str) -> float | None:
    """One gauge of the router's /metrics (None without an HTTP API)."""
    if not cluster.http_address:
        return None
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def huge_prompt_row(model: Path, logs: Path) -> list[dict]:
    cluster = start(model, logs / "huge", 1, 1)
    try:
        rows = [asyncio.run(_huge(cluster.address, mb, "grpc")) for mb in (50, 4)]
        return rows + [asyncio.run(_huge(cluster.address, mb, "http", cluster.http_address))
                       for mb in (50, 4)]
    finally:
        cluster.stop()


async def _huge(address: str, mb: int, api: str, http_address: str | None = None) -> dict:
    """The huge request comes from another process (another client), over gRPC or the HTTP
    API; this one checks gRPC health and sends a small request meanwhile."""
    target = address if api == "grpc" else http_address
    sender = await asyncio.create_subprocess_exec(
        sys.executable, __file__, f"--huge-{api}-sender", target, str(mb),
        stdout=asyncio.subprocess.PIPE)
    async with grpc.aio.insecure_channel(address) as ch:
        stub, health = pb_grpc.PDServeStub(ch), health_pb2_grpc.HealthStub(ch)
        checks = []
        wait = asyncio.ensure_future(sender.communicate())
        while not wait.done():
            t0 = time.monotonic()
            await health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            checks.append(time.monotonic() - t0)
            await asyncio.sleep(0.005)
        small = await one(stub, 1, request([5, 6, 7], 2), 30)
    status, refused_s, serialize_s = wait.result()[0].decode().split()
    return {"row": f"huge-prompt {mb} MB {api}", "requests": 1, "failures": {status: 1},
            "refused_in_s": float(refused_s), "client_serialize_s": float(serialize_s),
            "health_checks": len(checks),
            "health_p99_s": percentile(sorted(checks), 0.99) if checks else None,
            "small_request_s": small.end - small.start, "ok_pct": 0.0}


def huge_sender(address: str, mb: int) -> None:
    """Send one `mb` MB text prompt; print its status, seconds until it ended, and the
    seconds this client spent serializing it."""
    req = pb.GenerateRequest(text="lorem ipsum " * (mb * 2**20 // 12))
    t0 = time.monotonic()
    req.SerializeToString()
    serialize_s = time.monotonic() - t0

    async def main():
        opts = [("grpc.max_send_message_length", 128 << 20)]
        async with grpc.aio.insecure_channel(address, options=opts) as ch:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            return await one(pb_grpc.PDServeStub(ch), 0, req, 60)

    out = asyncio.run(main())
    print(out.status, out.end - out.start, serialize_s)


def huge_http_sender(address: str, mb: int) -> None:
    """POST one `mb` MB completions body as a client does (Content-Length first, then the
    body), reading the response between chunks; print the status, seconds until it came, and
    the seconds spent building the body."""
    t0 = time.monotonic()
    body = json.dumps({"model": "m", "prompt": "lorem ipsum " * (mb * 2**20 // 12),
                       "max_tokens": 4}).encode()
    build_s = time.monotonic() - t0
    host, port = address.rsplit(":", 1)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {address}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        t0 = time.monotonic()
        sock.sendall(head.encode())
        status, sent = "no response", 0
        while True:
            # Once the whole body is out (or the server stopped taking it), wait for the
            # answer up to 60 s; until then only peek between chunks.
            done_sending = sent >= len(body)
            ready, _, _ = select.select([sock], [], [], 60 if done_sending else 0)
            if ready:
                line = sock.recv(256).split(b"\r\n", 1)[0].decode(errors="replace")
                status = f"HTTP_{line.split()[1]}" if line.count(" ") >= 1 else "closed"
                break
            if done_sending:
                break  # no answer within 60 s: "no response"
            try:
                sent += sock.send(body[sent:sent + (1 << 20)])
            except OSError:  # the server closed while we were still sending: read its answer
                sent = len(body)
    print(status, time.monotonic() - t0, build_s)


# -- main ------------------------------------------------------------------------------------


def engine_outputs(model: Path, prompts, max_tokens: int) -> list[list[int]]:
    llm = LLM(str(model), dtype="float32")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def main() -> None:
    if sys.argv[1:2] == ["--huge-grpc-sender"]:
        huge_sender(sys.argv[2], int(sys.argv[3]))
        return
    elif sys.argv[1:2] == ["--huge-http-sender"]:
        huge_http_sender(sys.argv[2], int(sys.argv[3]))
        return
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default=",".join(FAULT_ROWS + ("overload", "huge-prompt")))
    p.add_argument("--model", default=None, help="checkpoint dir (default: the demo model)")
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--timeout", type=float, default=120.0, help="fault rows' deadline")
    p.add_argument("--deadline", type=float, default=30.0, help="overload row's deadline")
    p.add_argument("--capacity-concurrency", type=int, default=128)
    p.add_argument("--burst-requests", type=int, default=300)
    p.add_argument("--stop-s", type=float, default=20.0)
    p.add_argument("--drain-streams", type=int, default=10,
                   help="drain rows: streams in flight at the SIGTERM")
    p.add_argument("--drain-tokens", type=int, default=96,
                   help="drain rows: max_tokens of each stream")
    p.add_argument("--fail-pause", type=float, default=0.1,
                   help="fault rows: a client's pause after a failed request")
    p.add_argument("--out", default="bench/results/chaos_bench.json")
    a = p.parse_args()
    rows = [r for r in a.rows.split(",") if r]
    unknown = set(rows) - set(FAULT_ROWS + LOAD_ROWS + DRAIN_ROWS)
    if unknown:
        p.error(f"unknown rows: {sorted(unknown)}")
    model = Path(a.model) if a.model else ensure_demo_model()
    vocab = open_checkpoint(str(model)).model_config.vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.choice((16, 64, 160)))]
               for _ in range(a.requests)]
    logs = Path(tempfile.mkdtemp(prefix="chaos-"))
    results = []
    faults = [r for r in rows if r in FAULT_ROWS]
    if faults:
        reqs = [request(pr, a.max_tokens) for pr in prompts]
        expected = engine_outputs(model, prompts, a.max_tokens)
        base = baseline_row(a, model, logs, reqs, expected)
        results.append(base)
        for row in faults:
            r = fault_row(row, a, model, logs, reqs, expected)
            r["p99_vs_no_fault"] = (r["p99_s"] / base["p99_s"]) if r["p99_s"] and base[
                "p99_s"] else None
            results.append(r)
    drains = [r for r in rows if r in DRAIN_ROWS]
    if drains:
        dprompts = prompts[:a.drain_streams]
        dreqs = [request(pr, a.drain_tokens) for pr in dprompts]
        dexpected = engine_outputs(model, dprompts, a.drain_tokens)
        results += [drain_row(row, a, model, logs, dreqs, dexpected) for row in drains]
    for row in ("overload", "burst"):
        if row in rows:
            results += load_row(row, a, model, logs, prompts)
    if "huge-prompt" in rows:
        results += huge_prompt_row(model, logs)
    print_table(results, ["row", "requests", "ok_pct", "failures", "wrong_outputs", "p99_s",
                          "p99_vs_no_fault", "recovery_s", "cut_in_flight", "back_s",
                          "exit_s", "migrations", "drain_refusals", "offered", "capacity",
                          "completed_vs_capacity", "refusal_p99_s", "slowdown", "refused_in_s",
                          "client_serialize_s", "health_p99_s", "small_request_s"])
    path = write_json(a.out, {"args": vars(a), "load_average": os.getloadavg(),
                              "rows": [dict(r) for r in results]})
    print(f"\nwrote {path} (logs in {logs})")


if __name__ == "__main__":
    main()
