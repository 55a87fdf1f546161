"""Supervision of a local cluster's children: backoff, resets, pinned ports (no processes:
the supervisor is driven with an explicit clock over stand-in children)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pdserve.launcher import pin_ports
from pdserve.supervisor import RestartPolicy, Supervisor


def test_backoff_doubles_up_to_a_cap():
    p = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=4.0)
    assert [p.delay(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def test_ports_are_pinned_to_what_the_child_announced():
    worker = pin_ports(["--model", "m", "--threads", "1"], {"address": "127.0.0.1:4242"})
    assert worker == ["--model", "m", "--threads", "1", "--port", "4242"]
    router = pin_ports(["--port", "0", "--http-port=0", "--decode", "a:1"],
                       {"role": "router", "address": "h:50051", "http_address": "h:8000"})
    assert router == ["--decode", "a:1", "--port", "50051", "--http-port", "8000"]


@dataclass
class FakeProc:
    returncode: int | None = None

    def poll(self):
        return self.returncode


@dataclass
class FakeChild:
    name: str
    proc: FakeProc = field(default_factory=FakeProc)
    ready: threading.Event = field(default_factory=threading.Event)
    info: dict = field(default_factory=dict)


class FakeCluster:
    def __init__(self):
        self.router = None
        self.children = [FakeChild("decode-0")]
        self.respawned = []

    def respawn(self, child):
        self.respawned.append(child.name)
        child.proc, child.ready = FakeProc(), threading.Event()


def test_an_exited_child_is_respawned_after_its_backoff_and_backs_off_more_if_it_fails_again():
    cluster = FakeCluster()
    sup = Supervisor(cluster, RestartPolicy(initial_backoff_s=1.0, stable_after_s=100.0))
    child = cluster.children[0]
    sup.check(0.0)
    child.proc.returncode = -9
    sup.check(10.0)  # noticed: due at 11
    sup.check(10.5)
    assert cluster.respawned == []
    sup.check(11.0)
    assert cluster.respawned == ["decode-0"]
    child.proc.returncode = 1  # fails again soon: waits 2 s this time
    sup.check(12.0)
    sup.check(13.5)
    assert cluster.respawned == ["decode-0"]
    sup.check(14.0)
    assert cluster.respawned == ["decode-0", "decode-0"]
    sup.check(200.0)  # ran long enough: the next failure waits the least again
    child.proc.returncode = 1
    sup.check(201.0)
    sup.check(202.0)
    assert len(cluster.respawned) == 3


def test_a_stopped_supervisor_respawns_nothing():
    cluster = FakeCluster()
    sup = Supervisor(cluster, RestartPolicy(initial_backoff_s=0.0))
    sup.stop()
    cluster.children[0].proc.returncode = 0
    sup.check(0.0)
    sup.check(1.0)
    assert cluster.respawned == []
