"""Building a tensor-parallel group: a TCPStore rendezvous bound to the given host, a gloo
group for control messages, and the group the model's collectives run on."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroupGloo

from pdserve.engine.parallel import ParallelContext


@dataclass
class TPGroup:
    context: ParallelContext
    control: dist.ProcessGroup  # gloo, CPU tensors: step messages
    store: dist.TCPStore


def listen_store(host: str, timeout_s: float) -> tuple[dist.TCPStore, int]:
    """A TCPStore server listening on exactly `host` (a free port), for rank 0."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    store = dist.TCPStore(host, port, None, True, timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.detach())
    return store, port


def join_group(store: dist.TCPStore, rank: int, size: int, host: str, device: torch.device,
               timeout_s: float) -> TPGroup:
    """Build this rank's groups (blocks until every rank joins)."""
    opts = ProcessGroupGloo._Options()
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
    control = ProcessGroupGloo(dist.PrefixStore("control/", store), rank, size, opts)
    if device.type == "cuda":
        from torch.distributed import ProcessGroupNCCL  # absent from CPU builds

        nccl_opts = ProcessGroupNCCL.Options()
        nccl_opts._timeout = timedelta(seconds=timeout_s)
        compute = ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, nccl_opts)
    else:
        compute = ProcessGroupGloo(dist.PrefixStore("compute/", store), rank, size, opts)
    return TPGroup(ParallelContext(rank, size, compute), control, store)
