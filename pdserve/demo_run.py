"""`./dev demo`: start the local cluster on the embedded default model, ask it one chat
question through the OpenAI-compatible API (streamed), print the answer with timings, stop."""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Iterator

from pdserve.default_model import MODEL_ID, cache_root, ensure_default_model
from pdserve.launcher import ClusterSpec, LocalCluster

QUESTION = "What is the capital of France?"


def main() -> int:
    t0 = time.perf_counter()
    model = ensure_default_model()
    t_model = time.perf_counter() - t0
    logs = cache_root() / "logs"  # keep the workers' logs off the terminal
    print(f"model: {MODEL_ID} ({model}, ready in {t_model:.1f}s)\nworker logs: {logs}",
          flush=True)
    with LocalCluster(ClusterSpec(model=str(model), port=0, log_dir=str(logs))) as cluster:
        print(f"cluster up in {time.perf_counter() - t0 - t_model:.1f}s: router "
              f"grpc://{cluster.address}, http://{cluster.http_address}/v1", flush=True)
        print(f"user: {QUESTION}\nassistant: ", end="", flush=True)
        t1 = time.perf_counter()
        first = None
        usage: dict = {}
        for event in _chat_stream(cluster.http_address, QUESTION):
            for choice in event.get("choices", []):
                text = choice.get("delta", {}).get("content") or ""
                if text and first is None:
                    first = time.perf_counter() - t1
                print(text, end="", flush=True)
            usage = event.get("usage") or usage
        total = time.perf_counter() - t1
    ttft = f"{first * 1000:.0f} ms" if first is not None else "n/a"
    print(f"\n[{usage.get('completion_tokens', '?')} tokens; first token {ttft}, answer "
          f"{total:.2f}s; whole demo {time.perf_counter() - t0:.1f}s]", flush=True)
    return 0


def _chat_stream(http_address: str, question: str) -> Iterator[dict]:
    """The server-sent events of a streamed greedy chat completion."""
    body = json.dumps({
        "model": MODEL_ID, "messages": [{"role": "user", "content": question}],
        "max_tokens": 64, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://{http_address}/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[len("data: "):])


if __name__ == "__main__":
    sys.exit(main())
