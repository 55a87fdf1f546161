"""A stand-in for a worker or router process: takes the worker flags, binds nothing, announces
a READY line that reports what it was given (its GPUs, thread count, Redis URL's presence),
and waits for SIGTERM. Lets placement and controller tests run without loading a model.

Its environment can make it misbehave like a real process does:
  FAKE_READY_DELAY_FILE=F  announce READY only after the seconds written in file F (a slow
                           model load; a test changes it between starts)
  FAKE_FAIL=TEXT           print TEXT on stderr and exit 1 before READY (a failed start)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading

from pdserve.serving.ready import announce_ready


def main() -> None:
    p = argparse.ArgumentParser()
    for flag in ("--model", "--host", "--port", "--worker-id", "--tp", "--threads"):
        p.add_argument(flag, required=True)
    a, _ = p.parse_known_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    if os.environ.get("FAKE_FAIL"):
        print("starting", a.worker_id, file=sys.stderr, flush=True)
        print(os.environ["FAKE_FAIL"], file=sys.stderr, flush=True)
        sys.exit(1)
    delay_file = os.environ.get("FAKE_READY_DELAY_FILE")
    delay = float(open(delay_file).read() or 0) if delay_file else 0.0
    if stop.wait(delay):
        return
    info = {"role": "fake", "address": f"{a.host}:1", "worker_id": a.worker_id, "tp": int(a.tp),
            "threads": int(a.threads), "metrics_address": f"{a.host}:2",
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "has_redis_url": bool(os.environ.get("PDSERVE_REDIS_URL"))}
    announce_ready(info)
    stop.wait()


if __name__ == "__main__":
    main()
