"""A cluster started like `pdserve up --tls auto --host 127.0.0.2`: TLS on the router's gRPC,
HTTP and metrics, mTLS on every worker port (gRPC and metrics) with the throwaway cluster CA;
nothing listens anywhere but the given host."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import pytest

from pdserve.client import Client, PDServeError
from pdserve.engine import LLM, SamplingParams
from pdserve.proto import worker_pb, worker_pb_grpc
from pdserve.serving.security import ClientSecurity, ClientTLS
from pdserve.serving.security.certs import ThrowawayCA
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle
from tests.helpers.engine import random_prompts
from tests.security.probes import all_listening, send_pickles

pytestmark = pytest.mark.timeout(300)
HOST = "127.0.0.2"
GREEDY = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tiny_llama, tmp_path_factory):
    c = start_cluster(tiny_llama, tmp_path_factory.mktemp("tls"), tls=True, host=HOST)
    yield c
    c.stop()


def _stats(security: ClientSecurity, address: str):
    with security.channel(address) as ch:
        return worker_pb_grpc.WorkerStub(ch).GetStats(worker_pb.StatsRequest(), timeout=10)


def test_the_sdk_over_tls_gets_the_engines_output(cluster, tiny_llama):
    prompts = random_prompts([100, 10], VOCAB, seed=9)  # via the prefill worker, and local
    expected = [o.token_ids for o in LLM(str(tiny_llama), dtype="float32").generate(
        prompts, SamplingParams(**GREEDY))]
    with Client(cluster.address, root_certificates=cluster.root_certificates) as client:
        assert [client.generate(p, timeout=60, **GREEDY).token_ids for p in prompts] == expected
    with Client(cluster.address, max_retries=0) as plaintext, pytest.raises(PDServeError):
        plaintext.generate(prompts[1], timeout=10, **GREEDY)
    assert not any(wait_idle(cluster).values())


def test_workers_admit_only_certificates_of_the_cluster_ca(cluster, tmp_path):
    intruder = ThrowawayCA(tmp_path / "other").issue("intruder", (HOST,))
    ca = cluster.ca_path
    refused = {
        "a certificate from another CA": ClientTLS.from_files(ca, intruder.cert, intruder.key),
        "no client certificate": ClientTLS.from_files(ca),
        "plaintext": None,
    }
    for c in cluster.children:
        address = c.info["address"]
        assert _stats(cluster.security, address).worker_id == c.name
        for what, tls in refused.items():
            with pytest.raises(grpc.RpcError) as err:
                _stats(ClientSecurity(tls, cluster.security.secret), address)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE, what


def _get(url: str, context: ssl.SSLContext | None) -> int:
    with urllib.request.urlopen(url, timeout=10, context=context) as r:
        return r.status


def test_http_and_metrics_speak_tls_and_worker_metrics_want_a_client_certificate(cluster):
    tls = cluster.security.tls
    with_cert, without = tls.ssl_context(), ClientTLS(tls.ca).ssl_context()
    assert _get(f"https://{cluster.http_address}/v1/models", without) == 200
    metrics = cluster.workers("decode")[0].info["metrics_address"]
    assert _get(f"https://{metrics}/metrics", with_cert) == 200
    for url, ctx in ((f"https://{metrics}/metrics", without),
                     (f"http://{metrics}/metrics", None),
                     (f"http://{cluster.http_address}/v1/models", None)):
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            _get(url, ctx)


def test_nothing_listens_off_the_given_host_and_pickles_run_nothing(cluster, tmp_path):
    addresses = all_listening(cluster)
    assert len(addresses) >= 7
    assert all(a.startswith(f"{HOST}:") for a in addresses), addresses
    send_pickles(addresses, tmp_path / "pwned")
    with Client(cluster.address, root_certificates=cluster.root_certificates) as client:
        assert client.generate([3, 4, 5], timeout=60, **GREEDY).token_ids


def test_bench_over_grpc_and_https_with_the_cluster_ca(cluster, tmp_path):
    for server in (["--target", cluster.address],
                   ["--openai-url", f"https://{cluster.http_address}/v1"]):
        out = subprocess.run(
            [sys.executable, "-m", "pdserve", "bench", "--vocab-size", str(VOCAB),
             "--no-progress", *server, "--tls-ca", cluster.ca_path, "--num-prompts", "2",
             "--input-len", "8", "--output-len", "3", "--output", str(tmp_path / "r.json")],
            capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert json.loads((tmp_path / "r.json").read_text())["summary"]["failed"] == 0
