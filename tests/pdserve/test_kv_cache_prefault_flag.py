"""`--kv-cache-prefault`: off by default; the flag reaches the engine's config, and the
config as a tensor-parallel follower receives it (JSON) keeps it."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.serving.worker_options import add_worker_args, options_from_args

pytestmark = pytest.mark.unit


def engine_config(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_worker_args(p)
    return options_from_args("decode", p.parse_args(["--model", "m", *argv])).engine


def test_the_flag_reaches_the_engine_config_and_survives_the_trip_to_a_follower():
    assert engine_config().kv_cache_prefault is False
    config = engine_config("--kv-cache-prefault")
    assert config.kv_cache_prefault is True
    again = EngineConfig(**json.loads(json.dumps(dataclasses.asdict(config))))
    assert again.kv_cache_prefault is True
