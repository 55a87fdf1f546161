"""A follower rank of a tensor-parallel engine: `python -m pdserve.engine.tp.follower ...`.

It holds its shard of the weights and its KV heads, waits for rank 0's messages and runs the
same forward. A role plugin (`--role prefill|decode`) adds what the worker role needs on every
rank: the prefill plugin streams this rank's KV heads to the decode group; the decode plugin
receives this rank's heads. It exits on "stop", when the group breaks, or when its parent is
gone.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from pdserve.engine.config import EngineConfig
from pdserve.engine.tp.group import TPGroup, join_group
from pdserve.engine.tp.protocol import broadcast_message, decode_chunks
from pdserve.engine.tp.tiers import follow as follow_tiers

log = logging.getLogger("tp-follower")
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # an idle engine sends nothing; a dead rank 0 resets the socket
PLUGINS = {"engine": None, "prefill": "prefill_worker.tp_follower:PrefillFollower",
           "decode": "decode_worker.tp_follower:DecodeFollower"}


class FollowerPlugin:
    """What a worker role adds on follower ranks. Every hook runs on the follower's thread."""

    def __init__(self, engine, group: TPGroup, host: str) -> None:
        self.engine, self.group, self.host = engine, group, host

    def before_step(self, extra: dict):
        """The layer hook for this step (or None)."""
        return None

    def after_step(self, extra: dict) -> None:
        pass

    def on_message(self, msg: dict) -> None:
        """Messages other than setup/step/stop (e.g. the decode role's KV expectations)."""

    def close(self) -> None:
        pass


def _watch_parent() -> None:
    parent = int(os.environ.get("PDSERVE_TP_PARENT", "0"))
    while parent:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(3)


def _device(config: EngineConfig, rank: int) -> torch.device:
    if config.device in ("auto", "cuda") and torch.cuda.is_available():
        return torch.device(f"cuda:{rank % torch.cuda.device_count()}")
    return torch.device("cpu" if config.device == "auto" else config.device)


def _plugin_class(role: str):
    target = PLUGINS[role]
    if target is None:
        return FollowerPlugin
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def run(rank: int, size: int, host: str, store_port: int, config: EngineConfig,
        role: str = "engine") -> None:
    """Follow rank 0 until told to stop."""
    from pdserve.engine.engine import LLMEngine

    store = dist.TCPStore(host, store_port, None, False, timedelta(seconds=300))
    device = _device(config, rank)
    group = join_group(store, rank, size, host, device, IDLE_TIMEOUT_S)
    setup = broadcast_message(group.control, None, rank)
    if setup["op"] != "setup":
        raise RuntimeError(f"expected setup, got {setup['op']}")
    local = dataclasses.replace(config, num_gpu_blocks=int(setup["num_blocks"]),
                                speculative_config=None, device=str(device))
    engine = LLMEngine(local, tp=group.context)
    plugin = _plugin_class(role)(engine, group, host)
    try:
        while True:
            msg = broadcast_message(group.control, None, rank)
            # Tier operations first: they copy blocks out before this message may overwrite.
            follow_tiers(engine.tiers, group.control, msg)
            if msg["op"] == "stop":
                return
            if msg["op"] == "tier":
                continue  # answered (reduce / barrier) inside follow_tiers
            if msg["op"] == "copy_blocks":  # a fork's copy-on-write, before any step uses it
                engine.runner.copy_blocks([tuple(p) for p in msg["pairs"]])
                group.control.barrier().wait()
                continue
            if msg["op"] != "step":
                plugin.on_message(msg)
                group.control.barrier().wait()  # rank 0 waits until every rank handled it
                continue
            extra = msg.get("extra") or {}
            engine.runner.logits(decode_chunks(msg["chunks"]), plugin.before_step(extra))
            plugin.after_step(extra)
    finally:
        plugin.close()
        engine.close()  # this rank's tiers: pending SSD writes, segment files


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pdserve.engine.tp.follower")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--store-port", type=int, required=True)
    p.add_argument("--config", required=True, help="EngineConfig as JSON")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--role", choices=sorted(PLUGINS), default="engine")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s tp-rank-{a.rank} %(levelname)s %(message)s")
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1)
    threading.Thread(target=_watch_parent, daemon=True).start()
    config = EngineConfig(**json.loads(a.config))
    try:
        run(a.rank, a.size, a.host, a.store_port, config, a.role)
    except RuntimeError as exc:  # the group broke: rank 0 or a peer is gone
        log.warning("leaving the tensor-parallel group: %s", exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
