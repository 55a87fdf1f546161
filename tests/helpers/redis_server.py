"""A real `redis-server` for tests: loopback, free port, temp dir, no persistence.

    with RedisServer(tmp_path, password="s3cret") as server:
        url = server.url()          # redis://:s3cret@127.0.0.1:PORT/0
        server.kill()               # SIGKILL: clients see connection errors
        server.start()              # same port, empty (nothing is ever saved)

Tests call `require_redis_server()` first: it skips with a clear reason when the binary is
missing (CI installs it with `apt-get install -y redis-server`).
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from pathlib import Path
from urllib.parse import quote

import pytest


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def require_redis_server() -> str:
    """Path of `redis-server`, or skip the calling test when it is not installed."""
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("redis-server is not on PATH (install it: apt-get install -y redis-server)")
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One `redis-server` process that can be killed and restarted empty on the same port."""

    def __init__(self, tmp_dir: Path, password: str | None = None,
                 username: str | None = None, startup_timeout_s: float = 10.0,
                 tls: tuple[str, str, str] | None = None) -> None:
        """`tls`: (CA, certificate, key) paths: the server speaks TLS only (`rediss://`)."""
        self.binary = require_redis_server()
        self.dir = Path(tmp_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.username = username
        self.port = _free_port()
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.tls = tls

    def url(self, password: str | None = ..., username: str | None = ..., db: int = 0) -> str:
        """URL for this server; by default with the configured credentials."""
        password = self.password if password is ... else password
        username = self.username if username is ... else username
        auth = ""
        if password is not None:
            auth = f"{quote(username or '', safe='')}:{quote(password, safe='')}@"
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/{db}"

    def start(self) -> RedisServer:
        if self.proc is not None:
            raise RuntimeError("redis-server already running")
        # The configuration goes in on stdin: a password stays out of the process table.
        conf = [f"port {0 if self.tls else self.port}", "bind 127.0.0.1", 'save ""',
                "appendonly no", f"dir {self.dir}", f"logfile {self.dir / 'redis.log'}",
                "daemonize no"]
        if self.tls:
            ca, cert, key = self.tls
            conf += [f"tls-port {self.port}", f"tls-cert-file {cert}", f"tls-key-file {key}",
                     f"tls-ca-cert-file {ca}", "tls-auth-clients no"]
        if self.password is not None:
            if self.username:
                conf += ["user default off",
                         f"user {self.username} on >{self.password} ~* &* +@all"]
            else:
                conf.append(f"requirepass {self.password}")
        self.proc = subprocess.Popen([self.binary, "-"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.proc.stdin.write("\n".join(conf).encode() + b"\n")
        self.proc.stdin.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace")
                log = (self.dir / "redis.log").read_text() if (self.dir / "redis.log").exists() \
                    else ""
                self.proc = None
                raise RuntimeError(f"redis-server exited at startup: {err}\n{log[-2000:]}")
            try:
                with self._connect() as s:
                    s.sendall(b"PING\r\n")
                    reply = s.recv(64)
                if reply.startswith((b"+PONG", b"-NOAUTH")):
                    return
            except OSError:
                pass
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def _connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        if not self.tls:
            return sock
        ctx = ssl.create_default_context(cafile=self.tls[0])
        return ctx.wrap_socket(sock, server_hostname="127.0.0.1")

    def kill(self) -> None:
        """SIGKILL the server (its data is lost: it never saves)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc.stderr.close()
            self.proc = None

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()


def registered_workers(url: str) -> dict[str, str]:
    """Worker id → role of every live lease in the KV index's registry at `url`."""
    import redis

    from kv_store.index.events import decode_batch
    from kv_store.index.redis_common import Keys, RedisIndexConfig

    keys = Keys(RedisIndexConfig().namespace)
    r = redis.Redis.from_url(url)
    out = {}
    for member in r.smembers(keys.workers):
        value = r.get(keys.lease(member.decode()))
        if value is not None:
            reg = decode_batch(value)[0]
            out[reg.worker_id] = reg.info["role"]
    return out
