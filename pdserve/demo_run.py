"""`./dev demo`: start the local cluster on the embedded defaults, send one request, stop."""

from __future__ import annotations

import sys
import time

from pdserve.client import Client
from pdserve.demo_model import ensure_demo_model
from pdserve.launcher import ClusterSpec, LocalCluster

PROMPT = "The quick brown fox jumps over the lazy dog. Then the fox "


def main() -> int:
    t0 = time.perf_counter()
    model = ensure_demo_model()
    logs = model.parent / "logs"  # keep the workers' logs off the terminal
    print(f"demo model: {model}\nworker logs: {logs}", flush=True)
    with LocalCluster(ClusterSpec(model=str(model), port=0, log_dir=str(logs))) as cluster:
        print(f"cluster up in {time.perf_counter() - t0:.1f}s; router at {cluster.address}",
              flush=True)
        with Client(cluster.address) as client:
            t1 = time.perf_counter()
            print(f"prompt: {PROMPT!r}\ncompletion: ", end="", flush=True)
            last = None
            for chunk in client.stream(PROMPT * 4, max_tokens=32, temperature=0.0, timeout=120):
                print(chunk.text, end="", flush=True)
                last = chunk
            dt = time.perf_counter() - t1
        u = last.usage if last else None
        print(f"\n[finish={last.finish_reason if last else None} prompt_tokens="
              f"{u.prompt_tokens if u else '?'} completion_tokens="
              f"{u.completion_tokens if u else '?'} in {dt:.2f}s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
