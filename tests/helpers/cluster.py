"""End-to-end helpers: a real local cluster on loopback, and what its workers report."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc

from kv_store.transfer import TransferConfig
from pdserve.launcher import ClusterSpec, LocalCluster
from pdserve.proto import worker_pb, worker_pb_grpc
from pdserve.serving.security import ClientSecurity, ClusterSecret
from pdserve.serving.security.secret import KV_PURPOSE

TEST_SECRET = "pdserve-test-cluster-secret-do-not-use"
"""The cluster secret of the test clusters, so helpers can call their workers by address."""
TEST_SECURITY = ClientSecurity(secret=ClusterSecret(TEST_SECRET.encode()))
TEST_KV_KEY = ClusterSecret(TEST_SECRET.encode()).key(KV_PURPOSE)
"""The KV transfer key of the test clusters: a test that plays a prefill worker signs with it."""


def cluster_transfer(**options) -> TransferConfig:
    """A transfer config whose pairs a test cluster's receivers accept (`options` as in
    `TransferConfig`)."""
    return TransferConfig(auth_key=TEST_KV_KEY, **options)


def start_cluster(model: Path, tmp: Path, prefill: int = 1, decode: int = 1,
                  worker_args: tuple[str, ...] = (), router_args: tuple[str, ...] = (),
                  prefill_tp: int = 1, decode_tp: int = 1,
                  env: dict[str, str] | None = None, redis_url: str = "",
                  tls: bool = False, host: str = "127.0.0.1") -> LocalCluster:
    spec = ClusterSpec(model=str(model), host=host, port=0, num_prefill=prefill, num_decode=decode,
                       prefill_tp=prefill_tp, decode_tp=decode_tp,
                       threads_per_worker=1, worker_args=("--dtype", "float32", *worker_args),
                       router_args=router_args, log_dir=str(tmp / "logs"),
                       env={"OMP_NUM_THREADS": "1", **(env or {})}, redis_url=redis_url,
                       tls=tls, cluster_secret=TEST_SECRET)
    return LocalCluster(spec).start()


def worker_channel(address: str, security: ClientSecurity = TEST_SECURITY) -> grpc.Channel:
    """A blocking channel to a test cluster's worker, with the cluster's credentials."""
    return security.channel(address)


def worker_stats(address: str, security: ClientSecurity = TEST_SECURITY
                 ) -> worker_pb.WorkerStats:
    with worker_channel(address, security) as ch:
        return worker_pb_grpc.WorkerStub(ch).GetStats(worker_pb.StatsRequest(), timeout=10)


def wait_idle(cluster: LocalCluster, timeout_s: float = 20.0) -> dict[str, int]:
    """Wait until no worker holds a KV block or a request; returns the blocks still used."""
    end = time.monotonic() + timeout_s
    used: dict[str, int] = {}
    while time.monotonic() < end:
        used = {}
        for c in cluster.children:
            if c.proc.poll() is not None:
                continue  # a worker a test killed
            s = worker_stats(c.info["address"], cluster.security)
            used[c.name] = s.kv_blocks_used + s.num_running + s.num_waiting
        if not any(used.values()):
            return used
        time.sleep(0.2)
    return used


def listening_addresses(pid: int) -> list[str]:
    """host:port of every TCP socket `pid` listens on (from /proc, no extra tools)."""
    inodes = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:  # 0A = LISTEN
                found.append(_decode_addr(parts[1], table == "tcp6"))
    return found


def _decode_addr(hexaddr: str, v6: bool) -> str:
    host, port = hexaddr.split(":")
    if not v6:
        ip = ".".join(str(int(host[i:i + 2], 16)) for i in (6, 4, 2, 0))
    elif host == "0" * 32:
        ip = "::"
    elif host.startswith("0000000000000000FFFF0000"):
        h = host[24:]
        ip = ".".join(str(int(h[i:i + 2], 16)) for i in (6, 4, 2, 0))
    elif host == "00000000000000000000000001000000":
        ip = "::1"
    else:
        ip = host
    return f"{ip}:{int(port, 16)}"


def run(coro):
    return asyncio.run(coro)


def eventually(check, what: str, timeout_s: float = 20.0, period_s: float = 0.1) -> None:
    """Poll `check()` until it is true; AssertionError naming `what` after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout_s:.0f}s: {what}")
        time.sleep(period_s)


def wait_polled(cluster, role: str = "decode", timeout_s: float = 30.0) -> None:
    """Wait until the router has polled every `role` worker once more since this call (its KV
    events applied: the router's index then holds what each worker held at this call)."""
    from tests.helpers.faults import router_metrics

    def polls() -> dict[str, float]:
        return {name: v for name, v in router_metrics(cluster).items()
                if name.startswith("pdserve_router_worker_polls_total{")
                and f'role="{role}"' in name}

    before = polls()
    assert before, f"the router reports no {role} workers"
    eventually(lambda: all(polls().get(k, 0) > v for k, v in before.items()),
               f"every {role} worker polled again", timeout_s)
