"""Fixtures for the SDK tests: a fake PDServe server on loopback, fresh for each test."""

from collections.abc import Iterator

import pytest

from tests.client.fake_pdserve import FakePDServe, FakeServer, start_server


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    served = start_server(FakePDServe())
    yield served
    served.server.stop(grace=None)
