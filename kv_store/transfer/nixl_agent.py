"""One NIXL agent per process: the optional library behind the `nixl` payload path.

NIXL (the `nixl-cu12` wheel) is imported lazily and only here: a process without it, or whose
UCX backend does not start, gets `NixlUnavailable` (with the reason) and transfers over
gloo/NCCL as before. What this wrapper fixes, and why:

- *No busy thread.* NIXL's progress thread spins (about 0.4 core while idle, measured), so the
  agent is created without it and a 2 ms ticker progresses the UCX worker instead: the
  receiving side's part of a connection set-up needs it; one-sided writes over CMA or RDMA do
  not.
- *Thread-safe.* Every pair thread of a process shares the agent: strict synchronisation.
- *Bound to the worker's address.* UCX's TCP transport listens on every interface unless told
  otherwise. A worker on a loopback address can only have peers on this host, so UCX gets
  only its shared-memory transports (`self,sm,cma`: no socket at all; their endpoints have no
  peer-failure handler, so UCX's error handling is off — a dead peer still fails the write,
  and the gloo control pair notices it anyway); any other address limits `UCX_NET_DEVICES`
  to the interface that holds it. What the operator set in `UCX_TLS` / `UCX_NET_DEVICES`
  wins.
- *Quiet stdout.* NIXL logs INFO lines to stdout, where workers announce `PDSERVE_READY`: its
  logger is sent through the process's logging at WARNING instead.

Memory is registered once per buffer (`register`), remote agents are loaded from the
metadata another worker handed out over the authenticated gRPC hand-off (`connect`), and
`write` moves local byte ranges into registered remote ones and `read` the other way, waiting
for completion.
"""

from __future__ import annotations

import atexit
import fcntl
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

log = logging.getLogger(__name__)

UCX_DEVICES_ENV = "UCX_NET_DEVICES"
_TICK_S = 0.002
_WILDCARDS = ("", "0.0.0.0", "::")
Range = tuple[int, int]  # (address, length in bytes)


class NixlUnavailable(RuntimeError):
    """NIXL cannot be used in this process (not installed, or its UCX backend failed)."""


class NixlWriteError(RuntimeError):
    """A write failed or did not complete in time; the pair carrying it must close."""


def load_nixl() -> ModuleType:
    """The `nixl_cu12` module with its logging tamed, or `NixlUnavailable`."""
    raise_exceptions = logging.raiseExceptions  # its logging set-up flips this global
    try:
        import nixl_cu12  # noqa: PLC0415 - optional dependency, imported on demand
    except Exception as exc:  # ImportError, or a shared library that fails to load
        raise NixlUnavailable(f"nixl-cu12 does not import: {exc}") from None
    finally:
        logging.raiseExceptions = raise_exceptions
    nixl_log = logging.getLogger("nixl")
    for handler in list(nixl_log.handlers):  # its handler writes to stdout
        nixl_log.removeHandler(handler)
    nixl_log.propagate = True
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_log.setLevel(logging.WARNING)
    return nixl_cu12


@dataclass(frozen=True)
class Registration:
    """Memory registered with the agent; `NixlAgent.deregister` releases it."""

    handle: object
    mem: str  # "DRAM" | "VRAM"


class NixlAgent:
    """A process's NIXL agent (UCX backend). Thread-safe; `close()` ends it."""

    def __init__(self, host: str = "", name: str = "") -> None:
        """`host`: the worker's bind address (UCX listens only on its interface);
        `NixlUnavailable` if NIXL or its UCX backend cannot start here."""
        nixl = load_nixl()
        params = configure_ucx(host)
        self.name = name or f"pdserve-{socket.gethostname()}-{os.getpid()}-{os.urandom(4).hex()}"
        cfg = nixl.nixl_agent_config(
            enable_prog_thread=False, backends=[],
            sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        try:
            self._agent = nixl.nixl_agent(self.name, cfg)
            self._agent.create_backend("UCX", params)
        except Exception as exc:  # nixlBackendError and friends
            raise NixlUnavailable(f"NIXL's UCX backend does not start: {exc}") from None
        self._lock = threading.Lock()
        self._peers: dict[bytes, str] = {}  # remote metadata -> its agent name
        self._users: dict[bytes, int] = {}  # remote metadata -> pairs that connected to it
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick, name="nixl-progress", daemon=True)
        self._ticker.start()
        # A ticker still inside NIXL while the interpreter tears the agent down aborts the
        # process ("terminate called without an active exception"): stop it first.
        atexit.register(self.close)

    # ---- memory ------------------------------------------------------------------------------

    def register(self, tensor: torch.Tensor) -> Registration:
        """Register a contiguous tensor's bytes (CPU: DRAM, CUDA: VRAM)."""
        if not tensor.is_contiguous():
            raise ValueError("only contiguous tensors can be registered")
        mem = "VRAM" if tensor.is_cuda else "DRAM"
        dev = tensor.get_device() if tensor.is_cuda else 0
        nbytes = tensor.numel() * tensor.element_size()
        handle = self._agent.register_memory([(tensor.data_ptr(), nbytes, dev, "")], mem)
        return Registration(handle, mem)

    def deregister(self, reg: Registration) -> None:
        self._agent.deregister_memory(reg.handle)

    def metadata(self) -> bytes:
        """What a peer needs to write into this agent's registered memory (connection info
        and registration keys): hand it out only over the authenticated control plane."""
        return self._agent.get_agent_metadata()

    # ---- peers -------------------------------------------------------------------------------

    def connect(self, metadata: bytes) -> str:
        """Load a remote agent (once per metadata) for one more user, who calls `disconnect`
        when done with it; its name for `write`."""
        with self._lock:
            name = self._peers.get(metadata)
            if name is None:
                raw = self._agent.add_remote_agent(metadata)
                name = raw.decode() if isinstance(raw, bytes) else str(raw)
                self._peers[metadata] = name
            self._users[metadata] = self._users.get(metadata, 0) + 1
            return name

    def disconnect(self, metadata: bytes) -> None:
        """One user of a remote agent is done (its pair ended); the last unloads it, so a
        prefill worker that outlives many decode workers does not keep every one loaded."""
        with self._lock:  # held across the unload: a connect meanwhile loads it afresh
            left = self._users.get(metadata, 0) - 1
            if left > 0:
                self._users[metadata] = left
                return
            self._users.pop(metadata, None)
            self._unload(metadata)

    def connected(self, metadata: bytes) -> bool:
        """Whether the remote agent of `metadata` is loaded."""
        with self._lock:
            return metadata in self._peers

    def _unload(self, metadata: bytes) -> None:  # caller holds self._lock
        name = self._peers.pop(metadata, None)
        if name is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:  # already gone on the NIXL side
                log.debug("removing NIXL peer %s: %s", name, exc)

    # ---- transfers ---------------------------------------------------------------------------

    def write(self, peer: str, mem: str, device: int, local: Sequence[Range],
              remote: Sequence[Range], timeout_s: float) -> None:
        """Copy each local range into the matching remote range (same lengths) and wait for
        completion; `NixlWriteError` on failure or after `timeout_s` (the request is then
        released, which cancels what it can)."""
        self.transfer("WRITE", peer, (mem, device), local, (mem, device), remote, timeout_s)

    def read(self, peer: str, local_mem: tuple[str, int], local: Sequence[Range],
             remote_mem: tuple[str, int], remote: Sequence[Range], timeout_s: float) -> None:
        """Copy each remote range into the matching local one (same lengths) and wait; the
        memory kinds are (mem, device) pairs. Errors as `write`."""
        self.transfer("READ", peer, local_mem, local, remote_mem, remote, timeout_s)

    def transfer(self, op: str, peer: str, local_mem: tuple[str, int], local: Sequence[Range],
                 remote_mem: tuple[str, int], remote: Sequence[Range], timeout_s: float) -> None:
        """One NIXL transfer ("WRITE" or "READ") between registered ranges, waited for."""
        (lmem, ldev), (rmem, rdev) = local_mem, remote_mem
        src = self._agent.get_xfer_descs([(a, n, ldev) for a, n in local], lmem)
        dst = self._agent.get_xfer_descs([(a, n, rdev) for a, n in remote], rmem)
        try:
            handle = self._agent.initialize_xfer(op, src, dst, peer)
        except Exception as exc:  # the ranges are not registered (here or there), or no peer
            raise NixlWriteError(f"cannot {op.lower()} {peer}: {exc}") from None
        try:
            self._complete(handle, peer, timeout_s)
        finally:
            try:
                handle.release()
            except Exception as exc:  # an in-flight request that cannot be cancelled
                log.warning("releasing a NIXL transfer to %s: %s", peer, exc)

    def reader(self, peer: str, local: Range, remote: Range, remote_mem: str = "DRAM",
               remote_device: int = 0) -> RemoteRead:
        """A read of one remote range into one local (registered, host) one, prepared once
        and posted again at every `RemoteRead.read` (a CMA read of a few bytes: ~2 us, and
        no wake-up of any thread, here or there)."""
        src = self._agent.get_xfer_descs([(*local, 0)], "DRAM")
        dst = self._agent.get_xfer_descs([(*remote, remote_device)], remote_mem)
        try:
            handle = self._agent.initialize_xfer("READ", src, dst, peer)
        except Exception as exc:
            raise NixlWriteError(f"cannot read from {peer}: {exc}") from None
        return RemoteRead(self._complete, handle, peer)

    def _complete(self, handle, peer: str, timeout_s: float) -> None:
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            pause = 0.0
            while state == "PROC":
                if time.monotonic() >= deadline:
                    raise NixlWriteError(f"write to {peer} not done within {timeout_s:.3g}s")
                if pause:
                    time.sleep(pause)
                pause = min(0.001, pause * 2 or 0.00002)  # CMA completes at once; TCP polls
                state = self._agent.check_xfer_state(handle)
        except NixlWriteError:
            raise
        except Exception as exc:  # nixlRemoteDisconnectError: the receiver is gone
            raise NixlWriteError(f"write to {peer} failed: {exc}") from None
        if state != "DONE":
            raise NixlWriteError(f"write to {peer} failed ({state})")

    def close(self) -> None:
        """Stop the ticker and unload the peers (idempotent)."""
        self._stop.set()
        self._ticker.join(1.0)
        with self._lock:
            self._users.clear()
            for md in list(self._peers):
                self._unload(md)

    def _tick(self) -> None:
        while not self._stop.wait(_TICK_S):
            try:
                self._agent.get_new_notifs()  # progresses the UCX worker
            except Exception:  # the agent is being torn down
                return


class RemoteRead:
    """A prepared NIXL READ (`NixlAgent.reader`); `read` and `release` may race (a pair's
    send thread polls while another thread tears the pair down)."""

    def __init__(self, complete, handle, peer: str) -> None:
        self._complete, self._handle, self._peer = complete, handle, peer
        self._lock = threading.Lock()

    def read(self, timeout_s: float) -> None:
        """Copy the remote range into the local one now; `NixlWriteError` on failure, after
        `timeout_s`, or once released."""
        with self._lock:
            if self._handle is None:
                raise NixlWriteError(f"read from {self._peer} released")
            self._complete(self._handle, self._peer, timeout_s)

    def release(self) -> None:
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            try:
                handle.release()
            except Exception as exc:
                log.warning("releasing a NIXL read from %s: %s", self._peer, exc)


UCX_TLS_ENV = "UCX_TLS"
SAME_HOST_TLS = "self,sm,cma"
_NETWORK_TLS = ("tcp", "rc", "ud", "dc", "ib", "all", "srd", "gga")


def configure_ucx(host: str) -> dict[str, str]:
    """Point UCX at `host` (see the module docstring): sets `UCX_TLS` for a loopback host or
    `UCX_NET_DEVICES` for another, unless the operator did; the UCX backend's parameters."""
    if _is_loopback(host):
        os.environ.setdefault(UCX_TLS_ENV, SAME_HOST_TLS)  # UCX reads it at backend start
    elif host not in _WILDCARDS and not os.environ.get(UCX_DEVICES_ENV):
        name = interface_of(host)
        if name is None:
            log.warning("no network interface holds %s: NIXL's UCX may listen on every one",
                        host)
        else:
            os.environ[UCX_DEVICES_ENV] = name
    tls = os.environ.get(UCX_TLS_ENV, "")
    networked = not tls or any(t in tls for t in _NETWORK_TLS)
    return {"ucx_error_handling_mode": "peer" if networked else "none"}


def is_local_host(host: str) -> bool:
    """Whether `host` (an address or name) is this machine: loopback, or held by one of its
    interfaces. Two workers for which it holds share memory, and CMA copies between them."""
    return _is_loopback(host) or interface_of(host) is not None


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def interface_of(host: str) -> str | None:
    """The name of the local interface that holds address `host` (IPv4 or IPv6)."""
    try:
        ip = ipaddress.ip_address(socket.getaddrinfo(host, None)[0][4][0])
    except (OSError, ValueError):
        return None
    if ip.version == 6:
        return _v6_interface(ip)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                     struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == str(ip):
                return name
    return None


def _v6_interface(ip: ipaddress.IPv6Address) -> str | None:
    try:
        with open("/proc/net/if_inet6") as f:
            for line in f:
                parts = line.split()
                if ipaddress.IPv6Address(int(parts[0], 16)) == ip:
                    return parts[-1]
    except OSError:
        pass
    return None
