"""The security plane's parts without processes: secrets, per-call credentials, the server
interceptor, TLS flags, the throwaway CA, bearer checks, the metrics server over mTLS."""

from __future__ import annotations

import argparse
import asyncio
import ssl
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry, Counter

from pdserve.observability.http import MetricsServer
from pdserve.proto import worker_pb, worker_pb_grpc
from pdserve.serving.grpc_server import start_server
from pdserve.serving.security import (
    ClientSecurity,
    ClientTLS,
    ClusterSecret,
    InternalSecurity,
    SecretError,
    TLSConfig,
    TLSError,
    load_cluster_secret,
)
from pdserve.serving.security import args as security_args
from pdserve.serving.security.certs import ThrowawayCA
from pdserve.serving.security.http_auth import bearer_ok
from pdserve.serving.security.rpc_auth import MAX_SKEW_S, check_credential, make_credential
from pdserve.serving.security.secret import KV_PURPOSE, RPC_PURPOSE

SECRET = ClusterSecret(b"unit-test-cluster-secret")
METHOD = "/pdserve.worker.v1.Worker/GetStats"


def test_secret_comes_from_a_file_or_the_environment_never_too_short(tmp_path):
    f = tmp_path / "secret"
    f.write_text("from-a-file-0123456789\n")
    assert load_cluster_secret({}, str(f)).value == b"from-a-file-0123456789"
    env = {"PDSERVE_CLUSTER_SECRET": "from-the-env-0123456789"}
    assert load_cluster_secret(env).value == b"from-the-env-0123456789"
    assert load_cluster_secret({}) is None
    with pytest.raises(SecretError, match="at least"):
        load_cluster_secret({"PDSERVE_CLUSTER_SECRET": "short"})
    with pytest.raises(SecretError, match="cannot read"):
        load_cluster_secret({}, str(tmp_path / "missing"))
    assert "unit-test" not in repr(SECRET)
    assert SECRET.key(RPC_PURPOSE) != SECRET.key(KV_PURPOSE) != SECRET.value


def test_a_credential_is_good_for_its_method_its_key_and_a_bounded_time():
    key = SECRET.key(RPC_PURPOSE)
    cred = make_credential(key, METHOD, now=1000)
    assert check_credential(key, METHOD, cred, now=1000) == ""
    assert check_credential(key, METHOD, cred, now=1000 + MAX_SKEW_S) == ""
    assert "expired" in check_credential(key, METHOD, cred, now=1001 + MAX_SKEW_S)
    assert "invalid" in check_credential(key, "/pdserve.worker.v1.Worker/Decode", cred, 1000)
    other = ClusterSecret(b"another-cluster-secret").key(RPC_PURPOSE)
    assert "invalid" in check_credential(other, METHOD, cred, now=1000)
    assert "missing" in check_credential(key, METHOD, "", now=1000)
    assert "malformed" in check_credential(key, METHOD, "v1.x.y", now=1000)
    assert SECRET.value.decode() not in cred


class _Stats(worker_pb_grpc.WorkerServicer):
    async def GetStats(self, request, context):
        return worker_pb.WorkerStats(worker_id="w")

    async def Decode(self, request, context):
        yield worker_pb.DecodeEvent(ready=worker_pb.DecodeReady(cached_blocks=3))


async def _serve(security: InternalSecurity):
    return await start_server(
        "127.0.0.1", 0, lambda s: worker_pb_grpc.add_WorkerServicer_to_server(_Stats(), s),
        ["pdserve.worker.v1.Worker"], tls=security.tls,
        interceptors=security.server_interceptors())


async def _call(security: ClientSecurity, port: int):
    async with security.aio_channel(f"127.0.0.1:{port}") as ch:
        stub = worker_pb_grpc.WorkerStub(ch)
        events = [e async for e in stub.Decode(worker_pb.DecodeRequest(), timeout=5)]
        assert events[0].ready.cached_blocks == 3  # server streaming carries it too
        return await stub.GetStats(worker_pb.StatsRequest(), timeout=5)


def test_the_interceptor_refuses_calls_without_the_secret_and_keeps_health_open():
    async def main():
        server = await _serve(InternalSecurity(secret=SECRET))
        try:
            assert (await _call(ClientSecurity(secret=SECRET), server.port)).worker_id == "w"
            for wrong in (None, ClusterSecret(b"another-cluster-secret")):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _call(ClientSecurity(secret=wrong), server.port)
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
                reply = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            # blocking channels carry the credential too
            assert (await asyncio.to_thread(_sync_call, server.port)).worker_id == "w"
        finally:
            await server.server.stop(None)

    asyncio.run(main())


def _sync_call(port: int):
    with ClientSecurity(secret=SECRET).channel(f"127.0.0.1:{port}") as ch:
        stub = worker_pb_grpc.WorkerStub(ch)
        assert next(iter(stub.Decode(worker_pb.DecodeRequest(), timeout=5))).ready.cached_blocks
        return stub.GetStats(worker_pb.StatsRequest(), timeout=5)


def _tls_files(tmp_path):
    ca = ThrowawayCA(tmp_path / "ca")
    return ca, ca.issue("server", ("127.0.0.1",)), ca.issue("client")


def test_mtls_admits_cluster_certificates_only(tmp_path):
    ca, server, client = _tls_files(tmp_path)
    foreign = ThrowawayCA(tmp_path / "other").issue("intruder")
    tls = TLSConfig.from_files(server.cert, server.key, ca.ca_path)
    good = ClientSecurity(ClientTLS.from_files(ca.ca_path, client.cert, client.key))
    bad = [ClientSecurity(ClientTLS.from_files(ca.ca_path, foreign.cert, foreign.key)),
           ClientSecurity(ClientTLS.from_files(ca.ca_path)), ClientSecurity()]

    async def main():
        server_ = await _serve(InternalSecurity(tls=tls, secret=SECRET))
        assert InternalSecurity(tls=tls).server_interceptors() == []  # the handshake decides
        try:
            assert (await _call(good, server_.port)).worker_id == "w"
            for sec in bad:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await _call(sec, server_.port)
                assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        finally:
            await server_.server.stop(None)

    asyncio.run(main())


def _parse(add, argv):
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(argv)


def test_tls_flags_are_paths_checked_at_start(tmp_path):
    ca, server, _ = _tls_files(tmp_path)
    a = _parse(security_args.add_tls_args, ["--tls-cert", server.cert, "--tls-key", server.key,
                                            "--tls-ca", ca.ca_path])
    assert security_args.server_tls(a).mutual
    for argv, match in ((["--tls-ca", ca.ca_path], "needs --tls-cert"),
                        (["--tls-cert", server.cert], "go together"),
                        (["--tls-cert", server.cert, "--tls-key", str(tmp_path / "nope")],
                         "cannot read")):
        with pytest.raises(TLSError, match=match):
            security_args.server_tls(_parse(security_args.add_tls_args, argv))
    assert security_args.server_tls(_parse(security_args.add_tls_args, [])) is None


def test_bearer_tokens():
    assert bearer_ok(None, ())
    assert bearer_ok("Bearer t1", ("t0", "t1"))
    assert not bearer_ok("Bearer t2", ("t1",)) and not bearer_ok(None, ("t1",))
    assert not bearer_ok("t1", ("t1",))


def test_metrics_server_over_mtls_with_a_token(tmp_path):
    ca, server, client = _tls_files(tmp_path)
    registry = CollectorRegistry()
    Counter("pdserve_unit", "a counter", registry=registry).inc()
    tls = TLSConfig.from_files(server.cert, server.key, ca.ca_path)
    metrics = MetricsServer("127.0.0.1", 0, registry, tls.ssl_context(), ("scrape",))
    url = f"https://{metrics.address}/metrics"
    good = ClientTLS.from_files(ca.ca_path, client.cert, client.key).ssl_context()
    try:
        req = urllib.request.Request(url, headers={"Authorization": "Bearer scrape"})
        with urllib.request.urlopen(req, context=good, timeout=10) as r:
            assert b"pdserve_unit_total 1.0" in r.read()
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url, context=good, timeout=10)
        assert err.value.code == 401
        no_cert = ClientTLS.from_files(ca.ca_path).ssl_context()
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(req, context=no_cert, timeout=10).read()
    finally:
        metrics.close()
