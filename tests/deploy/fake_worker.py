"""A stand-in for a worker process: takes the worker flags, binds nothing, announces a READY
line that reports what it was given (its GPUs, thread count, Redis URL's presence), and waits
for SIGTERM. Lets placement tests run without loading a model."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading

READY_PREFIX = "PDSERVE_READY "


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--model", "--host", "--port", "--worker-id", "--tp", "--threads"):
        p.add_argument(flag, required=True)
    a, _ = p.parse_known_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    info = {"role": "fake", "address": f"{a.host}:1", "worker_id": a.worker_id, "tp": int(a.tp),
            "threads": int(a.threads),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "has_redis_url": bool(os.environ.get("PDSERVE_REDIS_URL"))}
    print(READY_PREFIX + json.dumps(info), flush=True)
    stop.wait()


if __name__ == "__main__":
    main()
