"""Command-line options every worker shares, parsed into one frozen dataclass."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.config import EngineConfig
from pdserve.serving.security import ClientSecurity, InternalSecurity
from pdserve.serving.security import args as security_args

REDIS_URL_ENV = "PDSERVE_REDIS_URL"
"""Where `--redis` defaults from: a URL with a password is better kept out of command lines
(visible to every local user in the process table)."""
REDIS_CA_ENV = "PDSERVE_REDIS_CA"
"""Where `--redis-ca` defaults from: the CA of a `rediss://` server."""


@dataclass(frozen=True)
class WorkerOptions:
    role: str
    """prefill | decode."""
    engine: EngineConfig
    host: str = "127.0.0.1"
    """Address the gRPC server and the KV receiver bind to."""
    port: int = 0
    """gRPC port (0 = any free port; the bound port is announced on stdout)."""
    kv_port: int = 0
    """Port of the KV transfer rendezvous store (decode workers)."""
    worker_id: str = ""
    threads: int = 0
    """torch intra-op threads (0 = leave torch's default)."""
    metrics_port: int = 0
    """Port of the Prometheus `/metrics` server, bound to `metrics_host` (0 = any free port,
    announced as `metrics_address`; -1 = no metrics server)."""
    metrics_host: str = ""
    """Bind address of `/metrics` ("" = `host`)."""
    redis_url: str = field(default="", repr=False)
    """Redis KV index (`redis://[user]:password@host:port/db`): the worker registers there
    under its gRPC address and publishes its prefix-cache changes ("" = none: the router
    reads them from `GetStats`). Carries the password: never logged, never in a repr."""
    drain_timeout_s: float = 30.0
    """On SIGTERM: longest wait for the calls in flight (and KV transfers) to finish before
    the worker exits (`--drain-timeout`; `worker_base.DrainConfig.grace_s`)."""
    redis_ca: str = ""
    """PEM CA file of a `rediss://` server ("" = the system's roots)."""
    security: InternalSecurity = field(default_factory=InternalSecurity, repr=False,
                                       hash=False)
    """TLS, the cluster secret and metrics tokens (`pdserve.serving.security`)."""
    extra: dict[str, Any] = field(default_factory=dict, hash=False)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--kv-port", type=int, default=0)
    p.add_argument("--worker-id", default="")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics port (0 = any free port, -1 = off)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-gb", type=float, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--speculative-config", default=None, help="JSON, vLLM style")
    p.add_argument("--model-id", default="")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks of this worker")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE models: each TP rank holds whole experts instead of a slice of "
                        "every expert")
    p.add_argument("--kv-host-gb", type=float, default=0.0,
                   help="host-memory KV tier, GiB (0 = off)")
    p.add_argument("--kv-ssd-dir", default=None,
                   help="SSD KV tier directory; this worker uses DIR/<worker id>")
    p.add_argument("--kv-ssd-gb", type=float, default=0.0, help="SSD KV tier, GiB (0 = off)")
    p.add_argument("--kv-ssd-persist", action="store_true",
                   help="keep the SSD tier across restarts (needs a stable --worker-id: the "
                        "tier lives in DIR/<worker id>)")
    p.add_argument("--redis", default=os.environ.get(REDIS_URL_ENV, ""), metavar="URL",
                   help="publish this worker's KV blocks to the Redis KV index at URL "
                        f"(redis://:password@host:port/db; default: ${REDIS_URL_ENV})")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, longest wait in seconds for requests in flight to finish "
                        "before exiting (default 30)")
    p.add_argument("--redis-ca", default=os.environ.get(REDIS_CA_ENV, ""), metavar="FILE",
                   help=f"CA of a rediss:// index server (default: ${REDIS_CA_ENV})")
    security_args.add_tls_args(p, server_name=True)
    security_args.add_secret_args(p)
    security_args.add_metrics_args(p)


def options_from_args(role: str, a: argparse.Namespace) -> WorkerOptions:
    spec = json.loads(a.speculative_config) if a.speculative_config else None
    if a.kv_ssd_persist and not (a.kv_ssd_dir and a.worker_id):
        raise ValueError("--kv-ssd-persist needs --kv-ssd-dir and a stable --worker-id (the "
                         "tier is kept in DIR/<worker id>; a default id changes every start)")
    worker_id = a.worker_id or f"{role}-{os.getpid()}"
    # Workers started with the same flags must not share (and wipe) one segment directory.
    ssd_dir = os.path.join(a.kv_ssd_dir, worker_id) if a.kv_ssd_dir else None
    engine = EngineConfig(
        model=a.model, dtype=a.dtype, device=a.device, block_size=a.block_size,
        num_gpu_blocks=a.num_gpu_blocks, kv_cache_memory_gb=a.kv_cache_memory_gb,
        max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len, enable_prefix_caching=not a.no_prefix_caching,
        attention_backend=a.attention_backend, quantization=a.quantization,
        kv_cache_dtype=a.kv_cache_dtype, speculative_config=spec, model_id=a.model_id,
        tensor_parallel_size=a.tp, enable_expert_parallel=a.enable_expert_parallel,
        kv_host_gb=a.kv_host_gb, kv_ssd_dir=ssd_dir,
        kv_ssd_gb=a.kv_ssd_gb, kv_ssd_persist=a.kv_ssd_persist)
    if not 0 <= a.drain_timeout <= 3600:
        raise ValueError(f"--drain-timeout must be in [0, 3600] seconds, got {a.drain_timeout}")
    if not -1 <= a.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be -1 (off), 0 (any free port) or a port "
                         f"number, got {a.metrics_port}")
    return WorkerOptions(role=role, engine=engine, host=a.host, port=a.port,
                         kv_port=a.kv_port, worker_id=worker_id, threads=a.threads,
                         metrics_port=a.metrics_port, metrics_host=a.metrics_host,
                         redis_url=a.redis, redis_ca=a.redis_ca,
                         security=security_from_args(a), drain_timeout_s=a.drain_timeout)


def security_from_args(a: argparse.Namespace) -> InternalSecurity:
    """The worker's internal plane from its TLS, secret and metrics flags (`ValueError`
    naming the flag or file when they cannot work)."""
    secret = security_args.cluster_secret(a)
    return InternalSecurity(
        tls=security_args.server_tls(a),
        client=ClientSecurity(security_args.worker_client_tls(a), secret), secret=secret,
        metrics_tokens=security_args.metrics_tokens(a))
