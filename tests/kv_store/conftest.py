"""Fixtures of the transfer suites: each runs once per payload transport (gloo, NIXL)."""

from __future__ import annotations

import pytest

from kv_store.transfer.nixl_agent import NixlAgent, NixlUnavailable

TRANSPORTS = ("gloo", "nixl")


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request):
    """The payload transport a transfer suite runs over (module-wide: its agents share it)."""
    return request.param


@pytest.fixture(scope="module")
def local_nixl(transport):
    """This process's NIXL agent when the suite runs over NIXL (None over gloo); the NIXL
    run is skipped where NIXL does not load."""
    if transport != "nixl":
        yield None
        return
    try:
        agent = NixlAgent("127.0.0.1")
    except NixlUnavailable as exc:
        pytest.skip(f"NIXL is not usable here: {exc}")
    yield agent
    agent.close()
