"""Fixtures of the Ray tests: a real Ray cluster on this host (tests/deploy/ray_nodes.py) and
a password-protected redis-server."""

from __future__ import annotations

import os

import pytest

from tests.deploy.ray_nodes import RayNodes
from tests.helpers.redis_server import RedisServer, require_redis_server

REDIS_PASSWORD = "pw-ray-test"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    require_redis_server()
    with RedisServer(tmp_path_factory.mktemp("redis"), password=REDIS_PASSWORD) as server:
        yield server


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    """One raylet (2 CPUs, 2 logical GPUs), token auth on; this test process is connected to
    it as a driver too (the Python API), with the cluster's token."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e .[ray])")
    nodes = RayNodes(tmp_path_factory.mktemp("ray"))
    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN_PATH",
                                            "RAY_ADDRESS")}
    try:
        nodes.add(num_cpus=2, num_gpus=2)
        env = nodes.env()
        for k in saved:
            os.environ[k] = env[k]
        # Ray reads RAY_AUTH_MODE into its config when first imported: read it again.
        from ray._raylet import Config

        Config.initialize("")
        ray.init(address=nodes.address, namespace="pdserve", log_to_driver=False,
                 logging_level="WARNING")
        yield nodes
    finally:
        ray.shutdown()
        nodes.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
