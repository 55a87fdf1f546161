"""What the security suite does to a running cluster: call every internal RPC, send raw
bytes to every listening port, read every process's command line."""

from __future__ import annotations

import os
import pickle
import socket
from pathlib import Path

import grpc
import psutil
from google.protobuf import message_factory

from pdserve.launcher import LocalCluster
from pdserve.proto import worker_pb
from tests.helpers.cluster import listening_addresses

WORKER_SERVICE = worker_pb.DESCRIPTOR.services_by_name["Worker"]


def call_every_worker_rpc(channel: grpc.Channel, victim_id: str) -> dict[str, grpc.StatusCode]:
    """Each method of the worker service, from its descriptor (so a new RPC cannot be left
    out), called once with a request that would do harm if it were served; its status."""
    harmful = {"Decode": {"request_id": victim_id, "prompt_token_ids": [1, 2, 3],
                          "local_prefill": True},
               "Abort": {"request_id": victim_id},
               "GetStats": {"take_kv_events": True, "kv_snapshot": True}}
    codes = {}
    for m in WORKER_SERVICE.methods:
        req_cls = message_factory.GetMessageClass(m.input_type)
        resp_cls = message_factory.GetMessageClass(m.output_type)
        path = f"/{WORKER_SERVICE.full_name}/{m.name}"
        request = req_cls(**harmful.get(m.name, {}))
        try:
            if m.server_streaming:
                list(channel.unary_stream(path, request_serializer=req_cls.SerializeToString,
                                          response_deserializer=resp_cls.FromString)(
                    request, timeout=10))
            else:
                channel.unary_unary(path, request_serializer=req_cls.SerializeToString,
                                    response_deserializer=resp_cls.FromString)(
                    request, timeout=10)
            codes[m.name] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            codes[m.name] = exc.code()
    return codes


def cluster_pids(cluster: LocalCluster) -> list[int]:
    """Every process of the cluster: the router, the workers and whatever they started."""
    top = [c.proc.pid for c in [cluster.router, *cluster.children] if c is not None]
    pids = list(top)
    for pid in top:
        pids += [p.pid for p in psutil.Process(pid).children(recursive=True)]
    return pids


def all_listening(cluster: LocalCluster) -> list[str]:
    return sorted({a for pid in cluster_pids(cluster) for a in listening_addresses(pid)})


class _Touch:
    """Unpickling this creates `path`: proof that someone unpickled it."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def send_pickles(addresses: list[str], marker: Path) -> None:
    """A pickle whose loading would create `marker`, raw, to every address (then hang up)."""
    payload = pickle.dumps(_Touch(marker))
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2) as s:
                s.sendall(len(payload).to_bytes(8, "little") + payload)
                s.settimeout(0.5)
                try:
                    s.recv(1024)
                except OSError:
                    pass
        except OSError:
            pass  # a port that closed meanwhile (an idle KV pair) is fine too
    assert not os.path.exists(marker)


def command_lines(cluster: LocalCluster) -> dict[int, str]:
    out = {}
    for pid in cluster_pids(cluster):
        out[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    return out
