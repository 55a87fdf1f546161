"""A real deployment on a real Ray cluster (one raylet started by the test, token auth on):
`pdserve ray up --detach` serves the engine's greedy output and its CLI process exits; a
`kill -9` of a decode worker, a prefill worker or a router is repaired by the controller while
the service keeps answering (two routers: a client tries the other, as a load balancer
would); `status` answers during a scale (the figure is printed); `pdserve ray down` leaves no
process, no actor and no Redis lease. The tiny random checkpoint, a few tokens."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from tests.deploy.test_ray_controller import ROOT, _alive, _named_actors, pdserve_ray
from tests.helpers.checkpoints import VOCAB
from tests.helpers.cluster import eventually
from tests.helpers.engine import random_prompts
from tests.helpers.redis_server import registered_workers

ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e .[ray])")

pytestmark = pytest.mark.timeout(600)

GREEDY = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def deploy_file(tmp_path: Path, model: Path) -> Path:
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    worker = "{replicas: %d, cpus_per_rank: 0.25, worker_args: [--dtype, float32]}"
    path = tmp_path / "deploy.yaml"
    path.write_text(f"""
model: {model}
name: serve
host: 127.0.0.1
env: {json.dumps(env)}
prefill: {worker % 1}
decode: {worker % 2}
router: {{replicas: 2, port: 0, http_port: 0, num_cpus: 0.25, args: [--routing, round-robin]}}
reconcile_period_s: 1
""")
    return path


class Service:
    """Requests sent in a loop, each to the first router that answers (with the client's
    own retries), while the test breaks things; every answer is checked. `routers()` gives
    the router addresses of the moment."""

    def __init__(self, routers, prompts, expected, pause_s: float = 0.2) -> None:
        self.routers, self.prompts, self.expected = routers, prompts, expected
        self.pause_s = pause_s  # leaves the CPUs to the replacement's model load
        self.answered = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def once(self) -> None:
        from pdserve.client import Client, PDServeError

        routers = self.routers()
        for i, prompt in enumerate(self.prompts):
            last = None
            for address in routers:
                try:
                    with Client(address, max_retries=5, max_backoff_s=1.0) as c:
                        out = c.generate(prompt, timeout=60, **GREEDY).token_ids
                    break
                except PDServeError as exc:
                    last = exc
            else:
                self.errors.append(f"no router answered: {last}")
                continue
            if out != self.expected[i]:
                self.errors.append(f"wrong answer {out} != {self.expected[i]}")
            self.answered += 1

    def _run(self) -> None:
        while not self._stop.wait(self.pause_s):
            self.once()

    def __enter__(self) -> Service:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(120)


def _repair(d, role: str, pick: int = 0) -> float:
    """kill -9 one process of `role`; seconds until the controller has it replaced."""
    victim = d.status().of(role)[pick]
    os.kill(victim.pid, 9)
    t = time.monotonic()
    eventually(lambda: (lambda st: st.converged and victim.name not in
                        [p.name for p in st.processes])(d.status()),
               f"{victim.name} is replaced", timeout_s=120, period_s=0.2)
    return time.monotonic() - t


def test_a_detached_deployment_serves_heals_and_goes_down_clean(ray_head, redis_server,
                                                                tiny_llama, tmp_path):
    from pdserve.deploy import Deployment
    from pdserve.engine import LLM, SamplingParams

    prompts = random_prompts([40, 12], VOCAB, seed=21)  # one via the prefill pool, one local
    expected = [o.token_ids for o in LLM(str(tiny_llama), dtype="float32").generate(
        prompts, SamplingParams(**GREEDY))]
    done = pdserve_ray(ray_head, "up", "--detach", "-f", str(deploy_file(tmp_path, tiny_llama)),
                       "--redis", redis_server.url())
    assert done.returncode == 0, done.stderr[-3000:]
    d = Deployment.connect("serve")
    st = d.status()
    assert st.converged and len(st.routers()) == 2
    for p in st.processes:  # every process's gRPC and metrics address is reported, and real
        assert p.grpc and p.metrics and p.log, p
        import urllib.request

        with urllib.request.urlopen(f"http://{p.metrics}/metrics", timeout=10) as r:
            assert b"pdserve_" in r.read()
    assert sorted(registered_workers(redis_server.url()).values()) == ["decode", "decode",
                                                                        "prefill"]
    service = Service(lambda: d.status().routers(), prompts, expected)
    service.once()
    assert service.answered == 2 and not service.errors

    repaired = {}
    with service:
        for role in ("decode", "prefill", "router"):
            repaired[role] = _repair(d, role)
        # A scale while requests flow: status keeps answering (timed), the new worker joins.
        d.scale("decode", 3, wait=False)
        took = []
        while not d.status().converged:
            t = time.monotonic()
            d.status()
            took.append(time.monotonic() - t)
            time.sleep(0.1)
    print(f"repair after kill -9 (s): {json.dumps({k: round(v, 1) for k, v in repaired.items()})}"
          f"; status during a scale: max {max(took, default=0):.3f}s over {len(took)} calls")
    assert not service.errors, service.errors[:3]
    assert service.answered > 6

    pids = [p.pid for p in d.status().processes]
    down = pdserve_ray(ray_head, "down", "--name", "serve")
    assert down.returncode == 0, down.stderr
    eventually(lambda: not any(_alive(p) for p in pids), "every process is gone",
               timeout_s=90)
    assert "serve-controller" not in _named_actors()
    eventually(lambda: not registered_workers(redis_server.url()), "no Redis lease is left",
               timeout_s=30)
