"""TLS: with `root_certificates` the client verifies the server's certificate."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import grpc
import pytest

from pdserve.client import Client, Unavailable
from tests.client.fake_pdserve import FakePDServe, start_server

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI"),
]


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) for 127.0.0.1, made with openssl."""
    out = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
         "-keyout", str(out / "key.pem"), "-out", str(out / "cert.pem")],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return Path(out / "key.pem").read_bytes(), Path(out / "cert.pem").read_bytes()


@pytest.fixture
def tls_server(self_signed):
    key, cert = self_signed
    served = start_server(FakePDServe(), grpc.ssl_server_credentials([(key, cert)]))
    yield served
    served.server.stop(grace=None)


def test_tls_client_trusting_the_server_certificate_works(tls_server, self_signed):
    with Client(tls_server.target, root_certificates=self_signed[1], token="t") as client:
        assert client.generate("tls").text == "tls"
    assert tls_server.servicer.metadata[0]["authorization"] == "Bearer t"


def test_plaintext_client_cannot_talk_to_a_tls_server(tls_server):
    with Client(tls_server.target, max_retries=0) as client:
        with pytest.raises(Unavailable):
            client.generate("tls", timeout=10)
    assert tls_server.servicer.calls == 0
