"""Workers die under load: requests fail fast with UNAVAILABLE (no hang), the dead worker leaves
its pool, and the cluster keeps serving with what is left."""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from pdserve.client import AsyncClient, Client, PDServeError
from pdserve.engine import LLM, SamplingParams
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import start_cluster, wait_idle
from tests.helpers.engine import random_prompts

pytestmark = pytest.mark.timeout(300)


async def _run_all(address, prompts, max_tokens):
    async with AsyncClient(address, max_retries=0) as client:
        return await asyncio.gather(
            *(client.generate(p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                              timeout=60) for p in prompts),
            return_exceptions=True)


def test_prefill_worker_killed_mid_load_then_decode_prefills_locally(tiny_llama, tmp_path):
    cluster = start_cluster(tiny_llama, tmp_path, prefill=1, decode=1)
    try:
        prompts = random_prompts([300] * 6, VOCAB, seed=21)

        async def load_then_kill():
            task = asyncio.create_task(_run_all(cluster.address, prompts, 40))
            await asyncio.sleep(0.3)
            cluster.kill(cluster.workers("prefill")[0])
            return await task

        t0 = time.monotonic()
        results = asyncio.run(load_then_kill())
        assert time.monotonic() - t0 < 60  # nothing hung until its deadline
        for r in results:  # each either finished correctly or failed with a clear status
            if isinstance(r, BaseException):
                assert isinstance(r, PDServeError), r
                assert r.code == grpc.StatusCode.UNAVAILABLE, r
        # The router notices (failed call or missed polls) and prefills on D instead.
        expected = LLM(str(tiny_llama), dtype="float32").generate(
            prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        deadline = time.monotonic() + 20
        while True:
            try:
                with Client(cluster.address, max_retries=0) as client:
                    got = [client.generate(p, max_tokens=8, temperature=0.0, ignore_eos=True,
                                           timeout=30).token_ids for p in prompts[:2]]
                break
            except PDServeError:
                assert time.monotonic() < deadline, "router kept using the dead worker"
                time.sleep(0.5)
        assert got == [e.token_ids for e in expected]
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()


def test_decode_worker_killed_mid_stream_fails_requests_fast(tiny_llama, tmp_path):
    cluster = start_cluster(tiny_llama, tmp_path, prefill=1, decode=2)
    try:
        prompts = random_prompts([60] * 8, VOCAB, seed=22)
        victim = cluster.workers("decode")[0]

        async def load_then_kill():
            task = asyncio.create_task(_run_all(cluster.address, prompts, 600))
            await asyncio.sleep(1.0)
            cluster.kill(victim, signal.SIGKILL)
            return await task

        t0 = time.monotonic()
        results = asyncio.run(load_then_kill())
        assert time.monotonic() - t0 < 60
        failures = [r for r in results if isinstance(r, BaseException)]
        assert all(isinstance(r, PDServeError) and r.code == grpc.StatusCode.UNAVAILABLE
                   for r in failures), failures
        # New requests go to the surviving decode worker.
        with Client(cluster.address, max_retries=3) as client:
            out = client.generate(prompts[0], max_tokens=5, temperature=0.0, timeout=30)
        assert len(out.token_ids) == 5
        assert not any(wait_idle(cluster).values())
    finally:
        cluster.stop()


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
