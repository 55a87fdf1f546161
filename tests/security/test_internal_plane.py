"""The internal plane of a plaintext cluster with a cluster secret, bearer tokens, metrics
tokens and a Redis index behind an ACL user and password (what `pdserve up --redis URL`
runs): an attacker on the same host gets nothing from the workers, cannot pose as a KV
sender, runs no code with a pickle, and reads no secret in `ps` or the logs. Even a cluster
member (it holds the secret) cannot write KV into a transfer it was not handed the ticket of,
nor replay frames of an earlier transfer of the same request id."""

from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta
from pathlib import Path

import grpc
import pytest
import torch
import torch.distributed as dist
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_store.transfer import KVSender, TransferConfig, TransferError, new_ticket, wire
from pdserve.client import Client
from pdserve.engine import LLM, SamplingParams
from pdserve.proto import worker_pb, worker_pb_grpc
from pdserve.serving import kv_messages
from pdserve.serving.convert import params_to_pb
from pdserve.serving.kv_messages import PrefillDone
from pdserve.serving.security import ClientSecurity, ClusterSecret
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import (
    TEST_SECRET,
    cluster_transfer,
    eventually,
    start_cluster,
    wait_idle,
    worker_channel,
    worker_stats,
)
from tests.helpers.engine import random_prompts
from tests.helpers.redis_server import RedisServer, require_redis_server
from tests.security.probes import all_listening, call_every_worker_rpc, command_lines, send_pickles

pytestmark = pytest.mark.timeout(300)

TOKEN = "api-token-for-the-security-suite"
METRICS_TOKEN = "metrics-token-for-the-security-suite"
REDIS_PASSWORD = "redis-password-for-the-security-suite"
SECRETS = (TOKEN, METRICS_TOKEN, REDIS_PASSWORD, TEST_SECRET)
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    require_redis_server()
    with RedisServer(tmp_path_factory.mktemp("redis"), password=REDIS_PASSWORD,
                     username="pdserve") as server:
        yield server


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory, redis_server):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("secure"), redis_url=redis_server.url(),
                      env={"PDSERVE_AUTH_TOKENS": TOKEN,
                           "PDSERVE_METRICS_TOKENS": METRICS_TOKEN})
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32")


def _expected(reference, prompt):
    return reference.generate([prompt], SamplingParams(**GREEDY))[0].token_ids


def _generate(cluster, prompt, rid="victim"):
    with Client(cluster.address, token=TOKEN) as client:
        return client.generate(prompt, request_id=rid, timeout=60, **GREEDY).token_ids


def _while_a_victim_runs(cluster, reference, attack) -> None:
    """Run `attack()` while a request that goes through the prefill worker (P → D KV) is
    in flight; the victim must still get exactly the engine's output."""
    prompt = random_prompts([120], VOCAB, seed=5)[0]
    out: list = []
    victim = threading.Thread(target=lambda: out.append(_generate(cluster, prompt)))
    victim.start()
    attack()
    victim.join(60)
    assert out == [_expected(reference, prompt)]


def test_every_internal_rpc_without_the_secret_is_unauthenticated(cluster, reference):
    wrong = ClientSecurity(secret=ClusterSecret(b"not-the-cluster-secret"))

    def attack():
        for c in cluster.children:
            for security in (ClientSecurity(), wrong):
                with security.channel(c.info["address"]) as ch:
                    codes = call_every_worker_rpc(ch, "victim")
                    health = health_pb2_grpc.HealthStub(ch).Check(
                        health_pb2.HealthCheckRequest(), timeout=10)
                assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
                assert health.status == health_pb2.HealthCheckResponse.SERVING

    _while_a_victim_runs(cluster, reference, attack)
    assert worker_stats(cluster.workers("decode")[0].info["address"]).worker_id  # the secret
    assert not any(wait_idle(cluster).values())


def test_forged_kv_hellos_are_refused_and_the_victim_completes(cluster, reference):
    kv = cluster.workers("decode")[0].info["kv_address"]
    host, port = kv.rsplit(":", 1)

    def attack():
        store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=5))
        for _ in range(3):  # junk, and every hello anyone wrote, replayed under new ids
            pair_id = store.add("pairs/next", 1)
            old = [store.get(f"pairs/{i}/hello") for i in range(1, pair_id)
                   if store.check([f"pairs/{i}/hello"])]
            for hello in [wire.pack({"kind": "hello", "sender": "evil:1", "host": host,
                                     "transport": "gloo", "quiet_limit_s": 1.0}), *old]:
                pid = store.add("pairs/next", 1)
                store.set(f"pairs/{pid}/hello", hello)
                store.queue_push("pairs/hello", str(pid))
            store.queue_push("pairs/hello", "1")  # an id that was answered already
        # a sender process without the secret, speaking the protocol properly
        with KVSender(TransferConfig(connect_timeout_s=5.0)) as sender:
            sender.send_layer(kv, "victim", 0, [0], torch.zeros((1, 2, 2, 16, 8)))
            with pytest.raises(TransferError, match="MAC|refused"):
                sender.finish(kv, "victim", b"forged").result(20)

    _while_a_victim_runs(cluster, reference, attack)
    assert not any(wait_idle(cluster).values())


def _reserve(d_stub, rid, prompt):
    """Open a remote-prefill Decode as the router does: (call, ready)."""
    call = d_stub.Decode(worker_pb.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, seed=0,
        sampling=params_to_pb(SamplingParams(**GREEDY)), deadline_unix_s=time.time() + 60),
        timeout=60)
    return call, next(call).ready


def _forge(ready, rid, ticket: bytes) -> None:
    """A cluster member writes the whole transfer: garbage KV into the reserved blocks (the
    tiny model's shapes: 2 layers, 2 KV heads, block 16, head dim 16) and a wrong first
    token, tagged under `ticket` (not the one D handed out)."""
    address, blocks = ready.endpoints[0].address, list(ready.block_ids[ready.cached_blocks:])
    with KVSender(cluster_transfer(connect_timeout_s=5.0)) as member:
        for layer in range(2):
            member.send_layer(address, rid, layer, blocks,
                              torch.full((len(blocks), 2, 2, 16, 16), 7.0),
                              lease_s=ready.kv_lease_s, ticket=ticket)
        member.finish(address, rid, kv_messages.encode(PrefillDone(3)), ticket=ticket
                      ).result(20)  # on the wire: only D can refuse it


def _prefill_then_decode(p_stub, call, ready, rid, prompt) -> list[int]:
    """The real prefill worker fills the blocks under D's ticket; the whole output."""
    target = worker_pb.KVTarget(endpoints=ready.endpoints, block_ids=ready.block_ids,
                                skip_blocks=ready.cached_blocks, lease_s=ready.kv_lease_s,
                                kv_ticket=ready.kv_ticket)
    first = p_stub.Prefill(worker_pb.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=params_to_pb(SamplingParams(**GREEDY)),
        seed=0, target=target, deadline_unix_s=time.time() + 60), timeout=60).token_id
    return [first, *(t for ev in call if ev.HasField("tokens") for t in ev.tokens.token_ids)]


def _refused(d: str) -> float:
    return worker_stats(d).counters.get("kv_frames_refused", 0.0)


def test_kv_frames_without_the_transfers_ticket_are_refused_and_the_victim_completes(
        cluster, reference):
    d, p = (cluster.workers(r)[0].info["address"] for r in ("decode", "prefill"))
    prompt = random_prompts([120], VOCAB, seed=8)[0]
    with worker_channel(d) as dch, worker_channel(p) as pch:
        call, ready = _reserve(worker_pb_grpc.WorkerStub(dch), "victim-kv", prompt)
        assert len(ready.kv_ticket) == 16
        before = _refused(d)
        for forged in (new_ticket(), b""):  # a ticket of its own; none at all
            _forge(ready, "victim-kv", forged)
        eventually(lambda: _refused(d) >= before + 6, "D refused 2 x (2 layers + DONE)")
        out = _prefill_then_decode(worker_pb_grpc.WorkerStub(pch), call, ready, "victim-kv",
                                   prompt)
    assert out == _expected(reference, prompt)
    assert not any(wait_idle(cluster).values())


def test_frames_of_an_earlier_transfer_of_the_same_request_are_refused(cluster, reference):
    d, p = (cluster.workers(r)[0].info["address"] for r in ("decode", "prefill"))
    prompt = random_prompts([120], VOCAB, seed=9)[0]
    with worker_channel(d) as dch, worker_channel(p) as pch:
        stub = worker_pb_grpc.WorkerStub(dch)
        call, earlier = _reserve(stub, "retried", prompt)
        call.cancel()  # that attempt is given up (its prefill worker was deemed lost) ...
        eventually(lambda: not any(wait_idle(cluster, 0.5).values()), "the release")
        call, ready = _reserve(stub, "retried", prompt)  # ... and the request retried here
        assert ready.kv_ticket != earlier.kv_ticket
        before = _refused(d)
        _forge(earlier, "retried", earlier.kv_ticket)  # what the old sender still had queued
        eventually(lambda: _refused(d) >= before + 3, "D refused the earlier transfer's frames")
        out = _prefill_then_decode(worker_pb_grpc.WorkerStub(pch), call, ready, "retried",
                                   prompt)
    assert out == _expected(reference, prompt)
    assert not any(wait_idle(cluster).values())


def test_pickles_sent_to_every_port_run_nothing(cluster, reference, tmp_path):
    addresses = all_listening(cluster)
    assert len(addresses) >= 7  # router gRPC + HTTP, each worker's gRPC + metrics, KV store
    send_pickles(addresses, tmp_path / "pwned")
    prompt = random_prompts([60], VOCAB, seed=6)[0]
    assert _generate(cluster, prompt, "after-pickles") == _expected(reference, prompt)


def test_metrics_need_their_token(cluster):
    worker = cluster.workers("decode")[0].info["metrics_address"]
    urls = [f"http://{worker}/metrics", f"http://{cluster.http_address}/metrics"]
    for url in urls:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, timeout=10)
        assert err.value.code == 401
    worker_req = urllib.request.Request(urls[0], headers={
        "Authorization": f"Bearer {METRICS_TOKEN}"})
    with urllib.request.urlopen(worker_req, timeout=10) as r:
        assert b"pdserve_" in r.read()


def test_no_secret_in_any_command_line_or_log(cluster):
    _generate(cluster, [5, 6, 7], "for-the-logs")
    lines = command_lines(cluster)
    assert len(lines) >= 3
    for pid, line in lines.items():
        assert not any(s in line for s in SECRETS), (pid, line)
    logs = Path(cluster.spec.log_dir)
    texts = {p.name: p.read_text(errors="replace") for p in logs.glob("*.log")}
    assert texts
    for name, text in texts.items():
        assert not any(s in text for s in SECRETS), name
