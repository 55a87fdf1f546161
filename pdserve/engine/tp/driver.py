"""Rank 0's side of a tensor-parallel engine: starts the follower processes, forms the group,
and broadcasts every step before running its own share of the forward."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.parallel import ParallelContext
from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.tp.group import TPGroup, join_group, listen_store
from pdserve.engine.tp.protocol import broadcast_message, encode_chunks

JOIN_TIMEOUT_S = 300.0


def check_divisible(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Refuse a TP degree the model cannot be split over, before any process starts.
    KV heads may be fewer than ranks (they are then replicated) if they divide the degree
    (an MLA latent is replicated on every rank); MoE experts split as
    `MoEConfig.check_split` says."""
    if cfg.num_heads % size:
        raise ValueError(f"{cfg.num_heads} attention heads do not split over TP={size}")
    if cfg.mla is None and cfg.num_kv_heads % size and size % cfg.num_kv_heads:
        raise ValueError(f"{cfg.num_kv_heads} KV heads neither split nor replicate over TP={size}")
    has_dense_mlp = cfg.moe is None or len(cfg.moe.sparse_layers) < cfg.num_layers
    if has_dense_mlp and cfg.intermediate_size % size:
        raise ValueError(f"intermediate size {cfg.intermediate_size} does not split over "
                         f"TP={size}")
    if cfg.moe is not None:
        cfg.moe.check_split(size, expert_parallel)


class TPDriver:
    def __init__(self, config: EngineConfig, device: torch.device, host: str = "127.0.0.1",
                 follower_args: Sequence[str] = ()) -> None:
        size = config.tensor_parallel_size
        # KV tier operations waiting to ride in front of the next control message.
        self._tier_ops: list[list[Any]] = []
        store, port = listen_store(host, JOIN_TIMEOUT_S)
        cfg = json.dumps(dataclasses.asdict(config))
        threads = str(max(1, torch.get_num_threads()))
        self.followers = [
            subprocess.Popen([sys.executable, "-m", "pdserve.engine.tp.follower",
                              "--rank", str(r), "--size", str(size), "--host", host,
                              "--store-port", str(port), "--config", cfg, "--threads", threads,
                              *follower_args],
                             env={**os.environ, "PDSERVE_TP_PARENT": str(os.getpid())})
            for r in range(1, size)]
        try:
            self.group: TPGroup = join_group(store, 0, size, host, device, JOIN_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        self._closed = False

    @property
    def context(self) -> ParallelContext:
        return self.group.context

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.followers)

    def setup(self, num_blocks: int) -> None:
        self._send({"op": "setup", "num_blocks": num_blocks})

    def step(self, chunks: Sequence[ScheduledChunk], extra: dict | None = None) -> None:
        """Called by the model runner right before rank 0's forward."""
        self._send({"op": "step", "chunks": encode_chunks(chunks), "extra": extra or {}})

    def call(self, message: dict) -> None:
        """Deliver a role message (e.g. a KV expectation) to every follower and wait until
        each has handled it: a barrier follows the broadcast."""
        self._send(message)
        self.group.control.barrier().wait()

    def queue_tier_op(self, op: list[Any]) -> None:
        """Queue a KV tier operation (wire form) for the followers: it travels in front of
        the next control message, so they run it before that message's forward or receive."""
        self._tier_ops.append(op)

    def flush_tier_ops(self) -> None:
        """Send the queued tier operations now (e.g. when idle) instead of with the next step."""
        if self._tier_ops:
            self._send({"op": "tier"})

    def post(self, message: dict) -> None:
        """Deliver a message to every follower without waiting for them; a collective that
        both sides run next (see pdserve.engine.tp.tiers) is how an answer comes back."""
        self._send(message)

    @property
    def control(self):
        """The control group (gloo, CPU tensors) the messages travel on."""
        return self.group.control

    def close(self) -> None:
        if getattr(self, "_closed", True) is False:
            self._closed = True
            try:
                if self.alive():
                    self._send({"op": "stop"})
            except RuntimeError:
                pass  # a follower already died; the processes are reaped below
        for p in self.followers:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def _send(self, message: dict) -> None:
        if self._tier_ops:
            message = {**message, "tier_ops": self._tier_ops}
            self._tier_ops = []
        broadcast_message(self.group.control, message, 0)
