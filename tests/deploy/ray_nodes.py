"""A real Ray cluster of one or more raylets on this host, as an operator starts one:
`ray start --head` and `ray start --address ...`, each node with its own CPUs and custom
resources, all on loopback, with token authentication (`RAY_AUTH_MODE=token`, a token file of
the test's own).

    with RayNodes(tmp_path) as ray_nodes:
        ray_nodes.add(num_cpus=2, resources={"decode_node": 1})   # the first one is the head
        env = ray_nodes.env()          # what a `pdserve ray ...` child needs to connect
        ray_nodes.stop_node(1)         # that raylet (and what runs on it) goes away

Each node is a `ray start --block` child in its own session, every port chosen free, its own
temp dir: nothing collides with another Ray on the machine, and stopping a node (SIGTERM to
its `ray start`, SIGKILL to its session after a grace) never touches anyone else's (this never
runs `ray stop`, which stops every Ray on the host).
"""

from __future__ import annotations

import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"
TOKEN = secrets.token_hex(32)
"""One token for every cluster this process starts: Ray caches the token it first reads, so a
driver that connects to a second cluster must find the same one."""

HEALTH_CHECKS = {"RAY_health_check_initial_delay_ms": "1000",
                 "RAY_health_check_period_ms": "1000",
                 "RAY_health_check_timeout_ms": "3000",
                 "RAY_health_check_failure_threshold": "4"}
"""The GCS calls a raylet dead after ~4 s of failed checks, not Ray's default ~15-30 s: a
test that crashes a node waits that long for the cluster to notice. The timeout per check
stays generous: a raylet on a loaded 2-core machine may answer late, not never."""


class DriverError(RuntimeError):
    """The cluster's driver did not answer (not connected yet, gone, or too slow)."""


_DRIVER_CODE = """
import json, sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    try:
        print(json.dumps({"value": eval(json.loads(line))}), flush=True)
    except Exception as exc:
        print(json.dumps({"error": repr(exc)}), flush=True)
"""


class _Driver:
    """A Ray driver in a process of its own that evaluates the test's expressions, one JSON
    line each way."""

    def __init__(self, address: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _DRIVER_CODE, address], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self._buffer = b""
        self._ready = False

    def ask(self, expression: str, timeout_s: float):
        end = time.monotonic() + timeout_s
        if not self._ready:
            self._line(end)
            self._ready = True
        try:
            self.proc.stdin.write(json.dumps(expression).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise DriverError(f"the driver is gone: {exc}") from None
        answer = json.loads(self._line(end))
        if "error" in answer:
            raise DriverError(f"{expression!r} failed in the driver: {answer['error']}")
        return answer["value"]

    def _line(self, end: float) -> bytes:
        while b"\n" not in self._buffer:
            left = end - time.monotonic()
            if left <= 0:
                raise DriverError("the driver did not answer in time")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16) if ready else None
            if chunk == b"":
                raise DriverError(f"the driver exited ({self.proc.wait()})")
            self._buffer += chunk or b""
        line, self._buffer = self._buffer.split(b"\n", 1)
        # Whatever else lands on stdout (Ray's own notices) is not an answer.
        return line if line.startswith(b'{"') else self._line(end)

    def close(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def ray_binary() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


@dataclass
class RayNode:
    index: int
    proc: subprocess.Popen
    resources: dict[str, float]
    log: Path
    node_manager_port: int
    node_id: str = ""
    """Ray's id of this raylet (known once it has joined)."""


class RayNodes:
    def __init__(self, tmp_dir: Path, startup_timeout_s: float = 90.0) -> None:
        # Ray's unix socket paths must stay short (108 bytes): a short temp root of our own.
        self.dir = Path(tmp_dir)
        self.temp = Path(f"/tmp/pdray-{secrets.token_hex(3)}")
        self.temp.mkdir()
        self.token = self.dir / "ray-token"
        self.token.write_text(TOKEN)
        self.token.chmod(0o600)
        self.gcs_port = free_port()
        self.nodes: list[RayNode] = []
        self.startup_timeout_s = startup_timeout_s
        self._driver: _Driver | None = None

    @property
    def address(self) -> str:
        return f"{HOST}:{self.gcs_port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a process that talks to this cluster (a `pdserve ray` CLI)."""
        # No memory monitor: on a shared test machine Ray would kill this cluster's actors for
        # memory that other processes use (it judges the whole host).
        return {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token),
                "RAY_ADDRESS": self.address, "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_memory_monitor_refresh_ms": "0", **HEALTH_CHECKS, **extra}

    def add(self, num_cpus: float, resources: dict[str, float] | None = None,
            num_gpus: int = 0) -> RayNode:
        """Start one more raylet (the first is the head) and wait until the cluster sees it.
        One at a time: two raylets joining at once on a 2-core machine timed one of them
        out (its node-info RPC ran past Ray's 30 s)."""
        index = len(self.nodes)
        resources = dict(resources or {})
        manager_port = free_port()
        argv = [ray_binary(), "start", "--block", "--node-ip-address", HOST,
                f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
                f"--resources={json.dumps(resources)}", "--disable-usage-stats",
                f"--node-manager-port={manager_port}", f"--object-manager-port={free_port()}",
                f"--dashboard-agent-listen-port={free_port()}",
                f"--dashboard-agent-grpc-port={free_port()}",
                f"--runtime-env-agent-port={free_port()}",
                f"--metrics-export-port={free_port()}", "--object-store-memory=100000000"]
        if index == 0:
            argv += ["--head", f"--port={self.gcs_port}", "--include-dashboard=false",
                     f"--ray-client-server-port={free_port()}", f"--temp-dir={self.temp}"]
        else:
            argv += [f"--address={self.address}"]
        log = self.dir / f"ray-node-{index}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                    env=self.env(), start_new_session=True)
        node = RayNode(index, proc, resources, log, manager_port)
        self.nodes.append(node)
        self._wait_joined()
        return node

    def _wait_joined(self) -> None:
        """Wait until every raylet still running is alive in the GCS, and record each one's
        node id: one driver process per look (a few seconds each), not one to see the node
        and another to learn its id."""
        end = time.monotonic() + self.startup_timeout_s
        while True:
            running = [n for n in self.nodes if n.proc.poll() is None]
            for n in self.nodes:
                if not n.node_id and n.proc.poll() is not None:
                    raise RuntimeError(f"ray start (node {n.index}) exited "
                                       f"{n.proc.returncode}:\n{n.log.read_text()[-3000:]}")
            ids = self._alive_ids()
            if ids is not None and all(n.node_manager_port in ids for n in running):
                for n in running:
                    n.node_id = ids[n.node_manager_port]
                return
            if time.monotonic() > end:
                late = [n for n in running if ids is None or n.node_manager_port not in ids]
                raise RuntimeError(f"node {late[0].index} did not join:\n"
                                   f"{late[0].log.read_text()[-3000:]}")
            time.sleep(0.5)

    def _alive_ids(self) -> dict[int, str] | None:
        """{node manager port: node id} of the raylets the GCS counts as alive; None while it
        does not answer yet (or a loaded machine timed the driver out): the caller polls."""
        try:
            rows = self.query(
                "[[n['NodeManagerPort'], n['NodeID']] for n in ray.nodes() if n['Alive']]",
                timeout_s=30)
        except DriverError:
            return None
        return {port: nid for port, nid in rows}

    def query(self, expression: str, timeout_s: float = 120.0):
        """`expression` evaluated by this cluster's driver, as JSON. The driver is one process
        of its own, started while only the head runs, so it is attached to the head and no
        node a test stops takes it along; one look costs milliseconds, not the seconds a
        fresh driver's import and connect cost. One that fails or times out is closed and
        the next look starts another."""
        if self._driver is None:
            self._driver = _Driver(self.address, self.env())
        try:
            return self._driver.ask(expression, timeout_s)
        except DriverError:
            self._driver.close()
            self._driver = None
            raise

    def actor_log(self, actor_name: str, lines: int = 60) -> str:
        """The last `lines` of the Ray log (worker-*.err) of the actor named `actor_name`
        (Ray names it in the log's first lines): what a failing test shows."""
        logs = self.temp / "session_latest" / "logs"
        for path in sorted(logs.glob("worker-*.err")):
            text = path.read_text(errors="replace")
            if f":actor_name:{actor_name}" in text[:4096]:
                return "\n".join(text.splitlines()[-lines:])
        return f"(no log of an actor named {actor_name} under {logs})"

    def by_id(self, node_id: str) -> RayNode:
        return next(n for n in self.nodes if n.node_id == node_id)

    def stop_node(self, index: int, grace_s: float = 15.0) -> None:
        """Stop one raylet and everything it runs (its worker processes die with it):
        SIGTERM to its `ray start`, then SIGKILL to its session after `grace_s`; 0 is a
        node that crashes (the GCS finds out by its health checks, fast on these
        clusters)."""
        node = self.nodes[index]
        if node.proc.poll() is None and grace_s > 0:
            node.proc.send_signal(signal.SIGTERM)
            try:
                node.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(node.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        node.proc.wait()

    def close(self) -> None:
        if self._driver is not None:
            self._driver.close()
            self._driver = None
        for node in reversed(self.nodes):  # workers first, the head (GCS) last
            self.stop_node(node.index)
        shutil.rmtree(self.temp, ignore_errors=True)

    def __enter__(self) -> RayNodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
