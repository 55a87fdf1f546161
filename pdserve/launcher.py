"""Starting a local cluster as real processes: decode workers, prefill workers, then the router.

Each child announces `PDSERVE_READY {json}` on stdout once bound; the launcher waits for that
line (never guesses ports), and stops every child on exit: SIGTERM, then SIGKILL after a grace.
Used by `pdserve up` and by the end-to-end tests.

Once a child has announced its ports they are pinned (`--port`, and the router's
`--http-port`), so `respawn(child)` brings it back where the others expect it. With
`supervise=True` (what `pdserve up` does) a `Supervisor` thread respawns any child that exits,
with backoff (`pdserve/supervisor.py`); only `stop()` ends the cluster.

With a Redis URL the router runs in discovery mode (no worker lists): its pools follow the
registry, so the cluster scales while it runs — `add_worker(role)` starts one more worker,
`stop_worker(child)` drains one (SIGTERM: it leaves the registry, finishes its requests, exits).
A worker started by hand with the same `--redis` (`pdserve decode-worker --model DIR --redis
URL`) joins the same way.

Security: every cluster gets a cluster secret (the spec's, else `$PDSERVE_CLUSTER_SECRET` or
its file, else a fresh one), handed to each child in its environment, never on a command line;
internal calls without it are refused. With `tls` the launcher also creates a throwaway CA and
a certificate per process (`security.certs`): workers require client certificates from it
(mTLS), the router serves TLS and calls the workers over mTLS. `security` and
`root_certificates` tell a test or a tool how to call the cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.serving.ready import READY_PREFIX
from pdserve.serving.security import (
    CLUSTER_SECRET_ENV,
    ClientSecurity,
    ClientTLS,
    ClusterSecret,
    generate_secret,
    load_cluster_secret,
)
from pdserve.serving.security.args import TLS_ENV
from pdserve.serving.security.secret import CLUSTER_SECRET_FILE_ENV
from pdserve.serving.worker_options import REDIS_URL_ENV
from pdserve.supervisor import RestartPolicy, Supervisor


@dataclass(frozen=True)
class ClusterSpec:
    model: str = ""
    """Checkpoint path for every process ("" = the embedded default model, prepared once by
    the launcher before any child starts)."""
    host: str = "127.0.0.1"
    port: int = 50051
    num_prefill: int = 1
    num_decode: int = 1
    threads_per_worker: int = 0
    """0 = split this machine's cores evenly between workers."""
    worker_args: tuple[str, ...] = ()
    """Extra flags for every worker (engine options)."""
    prefill_tp: int = 1
    """Tensor-parallel ranks of each prefill worker."""
    decode_tp: int = 1
    """Tensor-parallel ranks of each decode worker."""
    router_args: tuple[str, ...] = ()
    """Extra router flags, e.g. ("--http-port", "8080"). Without --http-port, a cluster on any
    free gRPC port (port=0) puts the HTTP API on any free port too, so clusters never collide."""
    log_dir: str | None = None
    """Where children's stderr goes (default: inherit)."""
    env: dict[str, str] = field(default_factory=dict, hash=False)
    redis_url: str = field(default="", repr=False)
    """Redis KV index for the router and every worker ("" = the in-process default). Handed
    to the children as $PDSERVE_REDIS_URL (the default of their `--redis`), so its password
    never shows in a command line."""
    discover: bool = True
    """With `redis_url`: the router discovers the workers from the registry (False: it gets
    the started workers as static lists and uses Redis for the KV index only)."""
    tls: bool = False
    """TLS everywhere from a throwaway CA (`pdserve up --tls auto`): the router's APIs, and
    mTLS between router and workers."""
    cluster_secret: str = field(default="", repr=False)
    """"" = `$PDSERVE_CLUSTER_SECRET` (or its file), else a fresh random one."""


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    info: dict = field(default_factory=dict)
    module: str = ""
    args: list[str] = field(default_factory=list)
    """Its command line after `python -m module` (ports pinned once it announced them)."""
    ready: threading.Event = field(default_factory=threading.Event)
    """Set when this process (the latest one, after a respawn) announced itself."""
    restarts: int = 0


class LocalCluster:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.children: list[Child] = []
        self.router: Child | None = None
        self._started = {"prefill": 0, "decode": 0}  # workers ever started, for unique ids
        self.supervisor: Supervisor | None = None
        self._model = spec.model
        secret = (ClusterSecret(spec.cluster_secret.encode()) if spec.cluster_secret
                  else load_cluster_secret())
        self._secret = secret or ClusterSecret(generate_secret().encode())
        self._tls_dir: str | None = None
        self._ca = None  # security.certs.ThrowawayCA with `spec.tls`
        self._client_cert = None

    @property
    def model(self) -> str:
        """The checkpoint path the children serve (the default model prepared on first use)."""
        if not self._model:
            from pdserve.default_model import ensure_default_model

            self._model = str(ensure_default_model())
        return self._model

    @property
    def security(self) -> ClientSecurity:
        """How to call this cluster's workers directly (tests, tools): its CA and a client
        certificate from it (with `tls`), and the cluster secret."""
        tls = None
        if self._ca is not None:
            c = self._client_cert
            tls = ClientTLS.from_files(self._ca.ca_path, c.cert, c.key)
        return ClientSecurity(tls, self._secret)

    @property
    def root_certificates(self) -> bytes | None:
        """PEM roots for clients of the router (the SDK's `root_certificates`); None
        without TLS."""
        if self._ca is None:
            return None
        with open(self._ca.ca_path, "rb") as f:
            return f.read()

    @property
    def ca_path(self) -> str | None:
        return self._ca.ca_path if self._ca is not None else None

    @property
    def address(self) -> str:
        assert self.router is not None
        return self.router.info["address"]

    @property
    def http_address(self) -> str | None:
        """host:port of the router's OpenAI HTTP API; None when it runs without one."""
        assert self.router is not None
        return self.router.info.get("http_address")

    def workers(self, role: str) -> list[Child]:
        return [c for c in self.children if c.info.get("role") == role]

    def start(self, timeout_s: float = 180.0, supervise: bool = False,
              restart: RestartPolicy | None = None) -> LocalCluster:
        """Start every child and wait until each serves; `supervise`: respawn any that exits
        from then on (until `stop`), waiting as `restart` says."""
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise
        if supervise:
            self.supervisor = Supervisor(self, restart or RestartPolicy())
            self.supervisor.start()
        return self

    def respawn(self, child: Child) -> None:
        """Start `child` again with the same command line (its ports pinned); returns at once:
        `child.ready` is set when it serves again."""
        if child.proc.poll() is None:
            raise RuntimeError(f"{child.name} is still running")
        new = self._spawn(child.name, child.module, child.args)
        child.proc, child.ready, child.restarts = new.proc, new.ready, child.restarts + 1
        self._watch_ready(child)

    def _start(self, timeout_s: float) -> None:
        s = self.spec
        if s.tls and self._ca is None:
            from pdserve.serving.security.certs import ThrowawayCA  # cryptography when used

            self._tls_dir = tempfile.mkdtemp(prefix="pdserve-tls-")
            self._ca = ThrowawayCA(self._tls_dir)
            self._client_cert = self._ca.issue("client", (s.host,))
        pending = [self._spawn_worker("decode") for _ in range(s.num_decode)]
        pending += [self._spawn_worker("prefill") for _ in range(s.num_prefill)]
        self.children.extend(pending)
        for child in pending:
            self._wait_ready(child, timeout_s)
        if s.redis_url and s.discover:
            workers = []  # the router finds them in the registry
        else:
            workers = ["--decode", ",".join(c.info["address"] for c in self.workers("decode")),
                       "--prefill", ",".join(c.info["address"] for c in self.workers("prefill"))]
        http_set = s.port != 0 or any(x.startswith("--http-port") for x in s.router_args)
        http = [] if http_set else ["--http-port", "0"]
        self.router = self._spawn("router", "router", [
            "--model", self.model, "--host", s.host, "--port", str(s.port), *workers, *http,
            *self._tls_args("router", ("--tls-cert", "--tls-key", "--internal-tls-ca")),
            *s.router_args])
        self._wait_ready(self.router, timeout_s)

    def add_worker(self, role: str, timeout_s: float = 180.0) -> Child:
        """Start one more `role` worker and wait until it serves. A router in discovery mode
        takes it in within a second or two (static routers never see it)."""
        child = self._spawn_worker(role)
        self.children.append(child)
        try:
            self._wait_ready(child, timeout_s)
        except BaseException:
            self.stop_worker(child, grace_s=0.0)
            raise
        return child

    def stop_worker(self, child: Child, grace_s: float = 60.0) -> int:
        """Drain one worker (SIGTERM: it leaves the registry, finishes what it has, exits),
        SIGKILL after `grace_s`; it leaves `children`. Returns its exit code."""
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
        try:
            child.proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
        if child in self.children:
            self.children.remove(child)
        return child.proc.returncode

    def _spawn_worker(self, role: str) -> Child:
        if role not in self._started:
            raise ValueError(f"role must be 'prefill' or 'decode', got {role!r}")
        s = self.spec
        ranks = s.num_prefill * s.prefill_tp + s.num_decode * s.decode_tp
        threads = s.threads_per_worker or max(1, (os.cpu_count() or 1) // max(1, ranks))
        name = f"{role}-{self._started[role]}"
        self._started[role] += 1
        tp = s.decode_tp if role == "decode" else s.prefill_tp
        return self._spawn(name, f"{role}_worker", [
            "--model", self.model, "--host", s.host, "--threads", str(threads), *s.worker_args,
            "--worker-id", name, "--tp", str(tp),
            *self._tls_args(name, ("--tls-cert", "--tls-key", "--tls-ca"))])

    def _tls_args(self, name: str, flags: tuple[str, str, str]) -> list[str]:
        """The TLS flags of one child: its own certificate and key, and the cluster CA."""
        if self._ca is None:
            return []
        issued = self._ca.issue(name, (self.spec.host,))
        return [flags[0], issued.cert, flags[1], issued.key, flags[2], self._ca.ca_path]

    def log_path(self, child: Child) -> Path | None:
        """The file `child`'s stderr goes to (None: it is inherited)."""
        return Path(self.spec.log_dir) / f"{child.name}.log" if self.spec.log_dir else None

    def log_tail(self, child: Child, max_bytes: int = 4096) -> str:
        """The end of `child`'s log ("" without a log dir): why a process exited, for the
        supervisor's message."""
        path = self.log_path(child)
        if path is None:
            return ""
        try:
            with open(path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - max_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def _spawn(self, name: str, module: str, args: list[str]) -> Child:
        """Start a child process; nothing waits for it here."""
        stderr = None
        if self.spec.log_dir:
            Path(self.spec.log_dir).mkdir(parents=True, exist_ok=True)
            stderr = open(Path(self.spec.log_dir) / f"{name}.log", "ab")  # noqa: SIM115
        # Always set: "" must mean "no Redis" even if this process's environment names one.
        # TLS comes from flags only, the secret from the environment only.
        inherited = {k: v for k, v in os.environ.items()
                     if k not in TLS_ENV and k != CLUSTER_SECRET_FILE_ENV}
        env = {**inherited, **self.spec.env, REDIS_URL_ENV: self.spec.redis_url,
               CLUSTER_SECRET_ENV: self._secret.value.decode()}
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=stderr,
            env=env, start_new_session=True)
        return Child(name, proc, module=module, args=list(args))

    def _watch_ready(self, child: Child) -> None:
        """Read the child's stdout on a thread: on READY, record its info, pin its ports and
        set `child.ready`."""
        proc, found = child.proc, child.ready

        def read() -> None:
            for raw in proc.stdout:  # keeps draining after READY so the pipe never fills
                line = raw.decode(errors="replace").rstrip()
                if line.startswith(READY_PREFIX) and not found.is_set():
                    child.info = json.loads(line[len(READY_PREFIX):])
                    child.args = pin_ports(child.args, child.info)
                    found.set()

        threading.Thread(target=read, name=f"{child.name}-stdout", daemon=True).start()

    def _wait_ready(self, child: Child, timeout_s: float) -> None:
        self._watch_ready(child)
        found = child.ready
        end = time.monotonic() + timeout_s
        while not found.wait(0.1):
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} "
                                   "before it was ready")
            if time.monotonic() > end:
                raise TimeoutError(f"{child.name} was not ready after {timeout_s:.0f}s")

    def kill(self, child: Child, sig: int = signal.SIGKILL) -> None:
        child.proc.send_signal(sig)
        child.proc.wait(timeout=30)

    def stop(self, grace_s: float = 10.0) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()  # first: nothing stopped below may be respawned
        everyone = ([self.router] if self.router else []) + self.children
        for c in everyone:
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + grace_s
        for c in everyone:
            try:
                c.proc.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        if self._tls_dir is not None:
            shutil.rmtree(self._tls_dir, ignore_errors=True)
            self._tls_dir, self._ca = None, None

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def pin_ports(args: list[str], info: dict) -> list[str]:
    """`args` with `--port` (and, for a router, `--http-port`) set to the ports the child
    announced in `info`, so a respawned child binds where the others know it."""
    pins = {"--port": info.get("address")}
    if info.get("role") == "router":
        pins["--http-port"] = info.get("http_address")
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        flag = a.split("=", 1)[0]
        if flag in pins and pins[flag]:
            skip = "=" not in a  # drop the flag and its value
            continue
        out.append(a)
    for flag, address in pins.items():
        if address:
            out += [flag, address.rsplit(":", 1)[1]]
    return out
