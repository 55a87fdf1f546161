"""The Ray actors a deployment's controller places, as plain classes (`ray.remote` is applied
by `deploy.controller`, so this module imports without Ray).

`ProcessActor` supervises one pdserve process (router or worker) on the node Ray placed it
on: it starts the process with the GPUs of the worker's whole placement group, reads its READY
line, answers `stats()` by asking the worker itself over gRPC (GetStats), serves the tail of
its log, and stops it. It never restarts a process: `poll()` reports an exit and the controller
replaces it. It runs threaded (`MAX_CONCURRENCY`), so `stop`, `poll` and `tail` answer while
`start` waits for a model load.

`RankHolder` holds the bundle of one extra TP rank (ranks 1..tp-1) so Ray accounts for that
rank's GPU; it only tells which GPU Ray gave it. Every method takes and returns plain
str / int / float / list / dict.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from pdserve.deploy.process import TAIL_LINES, ManagedProcess, ProcessState

MAX_CONCURRENCY = 4
"""Threads of a ProcessActor: start (blocking on the READY line) plus stop / poll / stats."""


def node_info() -> dict:
    """This node's address as the rest of the Ray cluster reaches it, and its Ray node id."""
    import ray

    try:  # the address this node registered with (`ray start --node-ip-address`)
        ip = ray._private.worker.global_worker.node_ip_address  # noqa: SLF001
    except AttributeError:
        ip = ray.util.get_node_ip_address()
    return {"ip": ip, "node_id": ray.get_runtime_context().get_node_id()}


def own_gpu_ids() -> list[str]:
    import ray

    return [str(g) for g in ray.get_gpu_ids()]


def default_log_dir() -> str:
    """`pdserve/` under this Ray session's log directory (where `ray logs` looks too)."""
    try:
        import ray

        node = ray._private.worker.global_worker.node  # noqa: SLF001 — no public accessor
        return str(Path(node.get_logs_dir_path()) / "pdserve")
    except Exception:  # noqa: BLE001 — any Ray internals change: a plain temp dir
        return str(Path(tempfile.gettempdir()) / "pdserve-logs")


class RankHolder:
    """Keeps one TP rank's bundle reserved; the worker process itself runs in rank 0's actor."""

    def gpu_ids(self) -> list[str]:
        return own_gpu_ids()


class ProcessActor:
    def __init__(self, name: str, log_dir: str = "") -> None:
        self.name = name
        self.log_dir = log_dir or default_log_dir()
        self.process: ManagedProcess | None = None
        self._env: dict[str, str] = {}

    def node(self) -> dict:
        return node_info()

    def start(self, module: str, args: list[str], env: dict[str, str],
              extra_gpu_ids: list[str], timeout_s: float) -> dict:
        """Run `python -m module args...` and return its READY fields (plus `pid`, `gpus`,
        `log`). The child sees the GPUs of every rank of its placement group (this actor's and
        the holders'), and nothing of Ray's own environment decides that. A failed start
        raises with the last lines of the child's stderr."""
        if self.process is not None:
            raise RuntimeError(f"{self.name}: already started")
        gpus = sorted(set(own_gpu_ids()) | set(extra_gpu_ids), key=_gpu_order)
        # Only the GPUs reserved for it ("" = none: a CPU pool on a GPU node stays off them),
        # unless the deployment's env says otherwise.
        # Ray's own token (RAY_AUTH_TOKEN) stays with Ray: pdserve processes never call it.
        inherited = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_TOKEN"}
        child_env = {**inherited, "CUDA_VISIBLE_DEVICES": ",".join(gpus), **env}
        self._env = dict(env)  # its cluster secret and TLS files, to call it (stats)
        log = Path(self.log_dir) / f"{self.name}.log"
        self.process = ManagedProcess([sys.executable, "-m", module, *args], child_env,
                                      name=self.name, log_path=log)
        info = self.process.wait_ready(timeout_s)
        return {**info, "pid": self.process.pid, "gpus": gpus, "log": str(log)}

    def poll(self) -> dict:
        """{"state": starting | ready | exited | stopped, and for an exit "error": what it
        said}."""
        if self.process is None:
            return {"state": ProcessState.STOPPED.value}
        state = self.process.state
        out = {"state": state.value}
        if state is ProcessState.EXITED:
            out["error"] = self.process.exit_summary()
        return out

    def tail(self, lines: int = TAIL_LINES) -> dict:
        """The process's log file and the last `lines` lines of its stderr."""
        if self.process is None:
            return {"log": "", "lines": []}
        return {"log": self.process.log_path, "lines": self.process.tail(lines)}

    def stats(self, timeout_s: float = 5.0) -> dict:
        """The worker's load as it reports it (GetStats), as a plain dict; {"error": why}
        when it does not answer (a worker that cannot answer is not an actor failure)."""
        import grpc

        if self.process is None or "address" not in self.process.info:
            return {"error": f"{self.name}: not running"}
        try:
            return worker_stats(self.process.info["address"], timeout_s, self._env)
        except grpc.RpcError as exc:
            return {"error": f"{self.name}: GetStats: {exc.code().name}"}

    def stop(self, grace_s: float) -> int:
        """Stop the process (SIGTERM, then SIGKILL after `grace_s`); its exit code."""
        if self.process is None:
            return 0
        return self.process.stop(grace_s)


def worker_stats(address: str, timeout_s: float, env: dict[str, str] | None = None) -> dict:
    """GetStats of the worker at `address`, as the load figures the autoscaler uses;
    authenticated like the worker itself is configured in `env` (the cluster secret, and its
    TLS files: `PDSERVE_TLS_CA` and its certificate as a client certificate)."""
    from pdserve.proto import worker_pb, worker_pb_grpc
    from pdserve.serving.security import ClientSecurity, ClientTLS, load_cluster_secret

    env = env or {}
    tls = None
    if env.get("PDSERVE_TLS_CA"):
        tls = ClientTLS.from_files(env["PDSERVE_TLS_CA"], env.get("PDSERVE_TLS_CERT") or None,
                                   env.get("PDSERVE_TLS_KEY") or None,
                                   env.get("PDSERVE_TLS_SERVER_NAME", ""))
    security = ClientSecurity(tls, load_cluster_secret(env))
    with security.channel(address) as channel:
        s = worker_pb_grpc.WorkerStub(channel).GetStats(worker_pb.StatsRequest(),
                                                        timeout=timeout_s)
    return {"num_running": s.num_running, "num_waiting": s.num_waiting,
            "queued_prefill_tokens": s.queued_prefill_tokens,
            "kv_blocks_used": s.kv_blocks_used, "kv_blocks_total": s.kv_blocks_total}


def _gpu_order(gpu_id: str) -> tuple[int, str]:
    return (int(gpu_id), "") if gpu_id.isdigit() else (sys.maxsize, gpu_id)
