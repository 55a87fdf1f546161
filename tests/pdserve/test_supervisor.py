"""Supervision of a local cluster's children: backoff, resets, pinned ports (no processes:
the supervisor is driven with an explicit clock over stand-in children)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from pdserve.launcher import Child, ClusterSpec, LocalCluster, pin_ports
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
        self.logs: dict[str, str] = {}

    def log_path(self, child):
        return f"/logs/{child.name}.log"

    def log_tail(self, child):
        return self.logs.get(child.name, "")

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


def test_an_exit_is_reported_with_the_end_of_the_childs_log(capsys):
    cluster = FakeCluster()
    cluster.logs["decode-0"] = "".join(f"line {i}\n" for i in range(30)) + "OSError: boom\n"
    sup = Supervisor(cluster, RestartPolicy(initial_backoff_s=1.0))
    sup.check(0.0)
    cluster.children[0].proc.returncode = 1
    sup.check(1.0)
    out = capsys.readouterr().out
    assert "decode-0 exited with code 1" in out
    assert "/logs/decode-0.log" in out
    assert "  | OSError: boom" in out and "  | line 11" in out
    assert "line 10\n" not in out  # only the last lines


def test_a_log_tail_is_the_end_of_the_file_and_empty_without_a_log_dir(tmp_path):
    child = Child("decode-0", proc=None)
    logged = LocalCluster(ClusterSpec(log_dir=str(tmp_path)))
    (tmp_path / "decode-0.log").write_bytes(b"x" * 10_000 + b"\nthe reason\n")
    assert logged.log_tail(child, max_bytes=100).endswith("x\nthe reason\n")
    assert len(logged.log_tail(child, max_bytes=100)) == 100
    assert LocalCluster(ClusterSpec()).log_tail(child) == ""
    assert LocalCluster(ClusterSpec(log_dir=str(tmp_path / "none"))).log_tail(child) == ""
