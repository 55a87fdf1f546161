"""Router configuration (static worker lists, or discovery from the Redis registry)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.serving.security import ClientSecurity, TLSConfig
from router.admission import AdmissionConfig


@dataclass(frozen=True)
class RouterConfig:
    model: str
    """Checkpoint path (tokenizer and model card come from it): a Hugging Face directory, a
    .gguf file or a directory holding one."""
    prefill: tuple[str, ...] = ()
    """host:port of each prefill worker."""
    decode: tuple[str, ...] = ()
    """host:port of each decode worker."""
    host: str = "127.0.0.1"
    port: int = 50051
    grpc_front: bool = True
    """The public gRPC port is owned by `pdserve.serving.grpc_front`, which refuses an
    oversized message from its length prefix at once (False: grpc-core owns the port and
    refuses it ~100 ms later; `--no-grpc-front`)."""
    model_id: str = ""
    """Name served in ListModels (default: the checkpoint's, see `Checkpoint.model_id`)."""
    model_aliases: tuple[str, ...] = ()
    """More names the OpenAI API accepts for the model (vLLM's --served-model-name A B)."""
    chat_template: str = ""
    """A chat template (jinja text) replacing the model's own ("" = the model's)."""
    tool_call_parser: str | None = None
    """How tool calls are found in outputs with tool_choice auto (hermes, llama3_json)."""
    enable_auto_tool_choice: bool = False
    """Allow tool_choice auto (both APIs)."""
    routing: str = "kv"
    """kv (KV-aware, the default) or round-robin (a baseline for comparison)."""
    local_prefill_tokens: int = 32
    """Uncached prompts up to this many tokens are prefilled by the decode worker itself."""
    admission: AdmissionConfig = AdmissionConfig()
    """Admission control (`router/admission.py`): the in-flight cap comes from the pools."""
    shutdown_grace_s: float = 30.0
    """On SIGTERM: longest wait for the streams in flight to finish (`--shutdown-grace`)."""
    start_wait_s: float = 60.0
    """Static lists: longest start-up wait for one healthy worker in each pool."""
    default_timeout_s: float = 600.0
    """Deadline applied when the client sets none."""
    health_period_s: float = 1.0
    """How often each worker's stats are polled (its heartbeat)."""
    heartbeat_timeout_s: float = 3.0
    """A worker that has not answered a poll for this long leaves its pool, and the requests
    in flight on it move to another worker (detected within this plus half a period)."""
    migration_limit: int = 3
    """How many times one request may move to another worker (its decode worker died,
    stopped answering or ended it; its prefill worker was lost) before it fails."""
    auth_tokens: tuple[str, ...] = field(default=(), repr=False)
    """Bearer tokens accepted on the public API (empty = no auth)."""
    redis_url: str = field(default="", repr=False)
    """Redis KV index to follow (`redis://[user]:password@host:port/db`): workers' cached
    blocks come from its event stream instead of their stats ("" = from their stats)."""
    redis_ca: str = ""
    """PEM CA file of a `rediss://` server ("" = the system's roots)."""
    tls: TLSConfig | None = field(default=None, repr=False)
    """TLS of the public gRPC API (and of the HTTP API and metrics, through `HttpConfig`);
    `client_ca` set = clients need a certificate from it."""
    internal: ClientSecurity = field(default_factory=ClientSecurity, repr=False)
    """How the router calls workers: TLS to them, and the cluster secret."""
    metrics_host: str = ""
    """Bind address of a separate `/metrics` server ("" = `host`)."""
    metrics_port: int = -1
    """Port of a separate `/metrics` server (0 = any free port; -1 = `/metrics` is served on
    the HTTP API's port instead)."""
    metrics_tokens: tuple[str, ...] = field(default=(), repr=False)
    """Bearer tokens for `/metrics` (empty = the API's tokens: metrics follow the API's auth)."""
    discovery_period_s: float = 1.0
    """Discovery mode: how often the pools are reconciled with the worker registry."""
    discovery_wait_s: float = 5.0
    """Discovery mode: longest start-up wait for registered workers to answer (the router
    then starts with what it has, possibly no worker at all)."""

    @property
    def discover(self) -> bool:
        """Discovery mode: with a Redis URL and no static worker list, the pools follow the
        worker registry (`router.membership`) instead of `prefill`/`decode`."""
        return bool(self.redis_url) and not self.prefill and not self.decode
