"""A request past its deadline fails with DEADLINE_EXCEEDED and leaves no block behind (worker
deaths are in test_worker_kills.py and test_stop_and_cancel.py: they lose no request)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.client import Client, PDServeError
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle
from tests.helpers.engine import random_prompts

pytestmark = pytest.mark.timeout(300)


def test_deadline_exceeded_releases_blocks(tiny_llama, tmp_path):
    cluster = start_cluster(tiny_llama, tmp_path, prefill=1, decode=1)
    try:
        prompt = random_prompts([100], VOCAB, seed=23)[0]
        with Client(cluster.address, max_retries=0) as client:
            with pytest.raises(PDServeError) as err:
                client.generate(prompt, max_tokens=900, temperature=0.0, ignore_eos=True,
                                timeout=0.5)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()
