"""Command-line options every worker shares, parsed into one frozen dataclass."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.config import INT4_KERNELS, LM_HEAD_DTYPES, EngineConfig
from pdserve.engine.host_malloc import HOST_MALLOC_MODES
from pdserve.serving.kv_lease import LeaseConfig
from pdserve.serving.kv_transport import (
    KV_TRANSPORTS,
    check_kv_transport,
    default_kv_transport,
    default_nixl_reads,
)
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
    the worker exits (`--drain-timeout`; `pdserve.serving.drain.DrainConfig.grace_s`)."""
    redis_ca: str = ""
    """PEM CA file of a `rediss://` server ("" = the system's roots)."""
    lease: LeaseConfig = field(default_factory=LeaseConfig)
    """The leases of this worker's KV hand-offs (`pdserve.serving.kv_lease`)."""
    kv_transport: str = "nixl"
    """What carries KV payloads: nixl | nccl | gloo (`pdserve.serving.kv_transport`)."""
    kv_nixl_reads: bool = True
    """NIXL pairs on one host read the sender's staging slots (`--kv-nixl-reads`)."""
    security: InternalSecurity = field(default_factory=InternalSecurity, repr=False,
                                       hash=False)
    """TLS, the cluster secret and metrics tokens (`pdserve.serving.security`)."""
    extra: dict[str, Any] = field(default_factory=dict, hash=False)


def add_worker_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="HF checkpoint dir, FILE.gguf or a dir holding one (default: the "
                        "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the gRPC server and the KV receiver bind to")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0 = any free port)")
    p.add_argument("--kv-port", type=int, default=0,
                   help="KV transfer rendezvous port (0 = any free port)")
    p.add_argument("--worker-id", default="", help="unique id (default: role-pid)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0 = torch's default)")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="Prometheus /metrics port (0 = any free port, -1 = off)")
    add_engine_args(p)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV blocks to allocate (default: sized from --kv-cache-memory-gb)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV cache budget, GiB (default: 1 on CPU, 80%% of free GPU memory)")
    p.add_argument("--kv-cache-prefault", action="store_true",
                   help="CPU: map the whole KV cache at start, so that no request pays its "
                        "page faults (the worker starts later and holds all of it at once)")
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching",
                   action="store_false", help="the same as --no-enable-prefix-caching")
    p.add_argument("--attention-backend", default="auto",
                   choices=["auto", "torch", "cpu", "triton"],
                   help="auto: triton on CUDA; on the CPU the C++ paged-attention kernels "
                        "(built on first use), or torch where they cannot be built")
    p.add_argument("--compile-decode", default="off", choices=["off", "inductor", "cuda_graphs"],
                   help="decode steps eager (off), through torch.compile (inductor: compiles "
                        "at the first decode step), or as CUDA graphs (cuda_graphs)")
    p.add_argument("--lm-head-dtype", default="auto", choices=LM_HEAD_DTYPES,
                   help="the LM head's precision: auto (the quantisation's default), model, "
                        "bf16, int8 or int4")
    p.add_argument("--int4-kernel", default="auto", choices=INT4_KERNELS,
                   help="the W4A16 matmul: auto, cpu (fp32 activations), cpu-invariant (one "
                        "kernel at every batch size), cpu-torch (torch's, bf16 activations), "
                        "triton (CUDA) or reference")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a token's numbers independent of the batch it runs in (int4 models on "
                        "the CPU; slower): a seeded request samples the same tokens under load")
    p.add_argument("--host-malloc", default="retain", choices=HOST_MALLOC_MODES,
                   help="on the CPU: retain (glibc keeps freed activation pages mapped, no "
                        "page faults per layer) or system (glibc's defaults)")
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
    p.add_argument("--kv-lease-s", type=float, default=LeaseConfig.kv_lease_s, metavar="S",
                   help="lease of a prefill-to-decode KV transfer: from the decode worker's "
                        "reservation until all of it landed (then it fails and the router "
                        "moves the request on)")
    p.add_argument("--kv-pull-lease-s", type=float, default=LeaseConfig.pull_lease_s,
                   metavar="S", help="lease of a decode worker's pull of a prefix another "
                                     "worker holds (then it recomputes)")
    p.add_argument("--kv-transport", choices=KV_TRANSPORTS, default=default_kv_transport(),
                   help="what carries KV payloads between workers: nixl (default; gloo where "
                        "NIXL does not load), nccl (CUDA KV) or gloo (default: "
                        "$PDSERVE_KV_TRANSPORT, else nixl)")
    p.add_argument("--kv-nixl-reads", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="with NIXL, a receiver on the sender's host reads the KV from the "
                        "sender's staging slots (one copy); --no-kv-nixl-reads: it is written "
                        "into the receiver's landing pool, as across hosts (default: "
                        "$PDSERVE_KV_NIXL_READS, else on)")
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


def add_engine_args(p: argparse.ArgumentParser, defaults: bool = True) -> None:
    """The engine flags vLLM users know, under vLLM's names; `pdserve up` takes the same
    flags (defaults=False: unset ones are not passed on, so the workers' defaults apply)."""
    d = (lambda v: v) if defaults else (lambda v: None)
    p.add_argument("--dtype", default=d("auto"),
                   help="weights/activations dtype: auto (the checkpoint's), float32, "
                        "bfloat16, float16")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence, prompt + output (default: the model's, at most "
                        "32768)")
    p.add_argument("--block-size", type=int, default=d(16), help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=d(128),
                   help="most requests in one engine step's batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=d(1024),
                   help="token budget of one engine step (also the prefill chunk size)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d(True), help="reuse the KV blocks of identical prompt prefixes")
    p.add_argument("--quantization", "-q", default=None,
                   help="weight quantisation: fp8 (E4M3 weights, per-token activations), int4 "
                        "(4-bit weights, W4A16), or none (dense: a 4-bit GGUF, which runs as "
                        "int4 by default, dequantised)")
    p.add_argument("--kv-cache-dtype", default=d("auto"), choices=("auto", "fp8"),
                   help="KV cache storage: auto (the model's dtype) or fp8")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding, JSON as in vLLM: {"method": "ngram", '
                        '"num_speculative_tokens": 4} or {"model": DIR, ...}')
    p.add_argument("--served-model-name", "--model-id", dest="model_id", nargs="+",
                   default=d([]), metavar="NAME",
                   help="the name the model is served (and its KV blocks hashed) under; "
                        "default: the checkpoint directory's name")


def options_from_args(role: str, a: argparse.Namespace) -> WorkerOptions:
    spec = json.loads(a.speculative_config) if a.speculative_config else None
    if a.kv_ssd_persist and not (a.kv_ssd_dir and a.worker_id):
        raise ValueError("--kv-ssd-persist needs --kv-ssd-dir and a stable --worker-id (the "
                         "tier is kept in DIR/<worker id>; a default id changes every start)")
    worker_id = a.worker_id or f"{role}-{os.getpid()}"
    # Workers started with the same flags must not share (and wipe) one segment directory.
    ssd_dir = os.path.join(a.kv_ssd_dir, worker_id) if a.kv_ssd_dir else None
    model = a.model
    if model is None:
        from pdserve.default_model import ensure_default_model

        model = str(ensure_default_model())
    engine = EngineConfig(
        model=model, dtype=a.dtype, device=a.device, block_size=a.block_size,
        num_gpu_blocks=a.num_gpu_blocks, kv_cache_memory_gb=a.kv_cache_memory_gb,
        kv_cache_prefault=a.kv_cache_prefault,
        max_num_batched_tokens=a.max_num_batched_tokens, max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len, enable_prefix_caching=a.enable_prefix_caching,
        attention_backend=a.attention_backend, compile_decode=a.compile_decode,
        quantization=a.quantization, lm_head_dtype=a.lm_head_dtype,
        int4_kernel=a.int4_kernel, batch_invariant=a.batch_invariant,
        kv_cache_dtype=a.kv_cache_dtype, speculative_config=spec,
        model_id=a.model_id[0] if a.model_id else "",
        tensor_parallel_size=a.tp, enable_expert_parallel=a.enable_expert_parallel,
        kv_host_gb=a.kv_host_gb, kv_ssd_dir=ssd_dir,
        kv_ssd_gb=a.kv_ssd_gb, kv_ssd_persist=a.kv_ssd_persist, host_malloc=a.host_malloc)
    if not 0 <= a.drain_timeout <= 3600:
        raise ValueError(f"--drain-timeout must be in [0, 3600] seconds, got {a.drain_timeout}")
    if not -1 <= a.metrics_port <= 65535:
        raise ValueError(f"--metrics-port must be -1 (off), 0 (any free port) or a port "
                         f"number, got {a.metrics_port}")
    lease = LeaseConfig(kv_lease_s=a.kv_lease_s, pull_lease_s=a.kv_pull_lease_s)
    return WorkerOptions(role=role, engine=engine, host=a.host, port=a.port,
                         kv_port=a.kv_port, worker_id=worker_id, threads=a.threads,
                         metrics_port=a.metrics_port, metrics_host=a.metrics_host,
                         redis_url=a.redis, redis_ca=a.redis_ca, lease=lease,
                         kv_transport=check_kv_transport(a.kv_transport),
                         kv_nixl_reads=(default_nixl_reads() if a.kv_nixl_reads is None
                                        else a.kv_nixl_reads),
                         security=security_from_args(a), drain_timeout_s=a.drain_timeout)


def security_from_args(a: argparse.Namespace) -> InternalSecurity:
    """The worker's internal plane from its TLS, secret and metrics flags (`ValueError`
    naming the flag or file when they cannot work)."""
    secret = security_args.cluster_secret(a)
    return InternalSecurity(
        tls=security_args.server_tls(a),
        client=ClientSecurity(security_args.worker_client_tls(a), secret), secret=secret,
        metrics_tokens=security_args.metrics_tokens(a))
