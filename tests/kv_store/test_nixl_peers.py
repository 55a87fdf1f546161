"""A NIXL agent's remote peers are counted: each pair that connects to one disconnects when
it ends, and the last unloads it (a prefill worker outlives many decode workers)."""

from __future__ import annotations

import pytest

from kv_store.transfer.nixl_agent import NixlAgent, NixlUnavailable

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def agents():
    try:
        made = NixlAgent("127.0.0.1"), NixlAgent("127.0.0.1")
    except NixlUnavailable as exc:
        pytest.skip(f"NIXL is not usable here: {exc}")
    yield made
    for agent in made:
        agent.close()


def test_the_last_pair_to_disconnect_unloads_the_peer_and_a_later_one_loads_it_again(agents):
    a, b = agents
    md = b.metadata()
    name = a.connect(md)
    assert a.connect(md) == name  # a second pair to the same receiver shares it
    a.disconnect(md)
    assert a.connected(md)
    a.disconnect(md)
    assert not a.connected(md)
    assert a.connect(md) == name  # loaded afresh
    a.disconnect(md)
    a.disconnect(md)  # one too many: nothing to undo
    assert not a.connected(md)
