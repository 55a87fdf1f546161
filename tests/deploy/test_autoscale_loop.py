"""The autoscaling loop (`autoscale_loop`), driven by a fake clock against a fake cluster; the
plain-data path from the `pdserve ray up` driver to the controller actor (`RemoteCluster`);
and the `ray up --autoscale` flags. No Ray cluster, no sleeping."""

from __future__ import annotations

import argparse
import json
import logging
import threading
from types import SimpleNamespace

import pytest

from pdserve.deploy.autoscale import (
    AutoscaleConfig,
    AutoscalePolicy,
    AutoscaleState,
    ScaleRule,
    WorkerLoad,
)
from pdserve.deploy.autoscale_loop import autoscale_loop
from pdserve.deploy.cli import add_arguments, autoscale_config
from pdserve.deploy.controller import (
    RemoteCluster,
    autoscale_config_from_dict,
    autoscale_config_to_dict,
    decision_from_dict,
    decision_to_dict,
)

POLICY = AutoscalePolicy(AutoscaleConfig(
    prefill=ScaleRule(min_replicas=1, max_replicas=4, high=1000, low=100, up_after=2),
    decode=ScaleRule(min_replicas=1, max_replicas=4, high=0.8, low=0.3)))
BUSY = {"prefill": 5000, "decode": 0.5}  # prefill over high, decode inside its band


class FakeTime:
    """`clock` and `wait` for the loop: waiting moves the clock; stop after `rounds` waits."""

    def __init__(self, rounds: int) -> None:
        self.now = 0.0
        self.waits: list[float] = []
        self.rounds = rounds

    def clock(self) -> float:
        return self.now

    def wait(self, seconds: float) -> bool:
        self.waits.append(seconds)
        self.now += seconds
        return len(self.waits) > self.rounds


class FakeCluster:
    """`autoscale_once` as RayCluster does it (sizes, loads, kept state, applied targets), on
    made-up loads; a scale takes `scale_cost_s` of fake time; `fail` lists rounds that raise."""

    def __init__(self, time: FakeTime, signal: dict[str, float], scale_cost_s: float = 0.0,
                 fail: tuple[int, ...] = ()) -> None:
        self.time, self.signal, self.scale_cost_s, self.fail = time, signal, scale_cost_s, fail
        self.sizes = {"prefill": 1, "decode": 1}
        self.state = AutoscaleState()
        self.calls: list[float] = []

    def loads(self, role: str) -> list[WorkerLoad]:
        if role == "prefill":
            return [WorkerLoad(queued_prefill_tokens=int(self.signal[role]))] * self.sizes[role]
        used = int(self.signal[role] * 100)
        return [WorkerLoad(kv_blocks_used=used, kv_blocks_total=100)] * self.sizes[role]

    def autoscale_once(self, policy: AutoscalePolicy):
        self.calls.append(self.time.now)
        if len(self.calls) in self.fail:
            raise RuntimeError("prefill-3: no node could take its placement group")
        d = policy.decide(self.sizes, {r: self.loads(r) for r in self.sizes}, self.state)
        self.state = d.state
        if d.changes():
            self.time.now += self.scale_cost_s
        self.sizes = dict(d.targets)
        return d


def test_one_decision_per_period_applied_and_its_hysteresis_kept_between_rounds():
    t = FakeTime(rounds=4)
    cluster = FakeCluster(t, BUSY)
    assert autoscale_loop(cluster, POLICY, t.wait, period_s=15.0, clock=t.clock) == 4
    assert cluster.calls == [15.0, 30.0, 45.0, 60.0]  # the first one a period after the start
    # up_after=2: the second busy round grows the pool (5 x load -> 4 = max); decode holds.
    assert cluster.sizes == {"prefill": 4, "decode": 1}


def test_a_round_that_overruns_the_period_is_followed_by_a_full_period():
    t = FakeTime(rounds=4)
    cluster = FakeCluster(t, BUSY, scale_cost_s=100.0)  # a scale-up waits for model loads
    autoscale_loop(cluster, POLICY, t.wait, period_s=15.0, clock=t.clock)
    assert t.waits[:3] == [15.0, 15.0, 15.0]  # round 2 scaled and overran: a full period
    assert cluster.calls == [15.0, 30.0, 145.0, 160.0]


def test_a_round_within_the_period_keeps_the_cadence():
    t = FakeTime(rounds=3)
    cluster = FakeCluster(t, BUSY, scale_cost_s=5.0)
    autoscale_loop(cluster, POLICY, t.wait, period_s=15.0, clock=t.clock)
    assert cluster.calls == [15.0, 30.0, 45.0]
    assert t.waits[2] == 10.0  # the scale took 5 of the 15 s


def test_a_failed_round_is_logged_and_the_loop_goes_on(caplog):
    t = FakeTime(rounds=3)
    cluster = FakeCluster(t, BUSY, fail=(2,))
    with caplog.at_level(logging.INFO, logger="pdserve.deploy.autoscale_loop"):
        made = autoscale_loop(cluster, POLICY, t.wait, period_s=15.0, clock=t.clock)
    assert made == 2 and len(cluster.calls) == 3
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "RuntimeError" in warning.getMessage() and "placement group" in warning.getMessage()


def test_every_decision_is_logged_with_its_reasons(caplog):
    t = FakeTime(rounds=2)
    with caplog.at_level(logging.INFO, logger="pdserve.deploy.autoscale_loop"):
        autoscale_loop(FakeCluster(t, BUSY), POLICY, t.wait, period_s=15.0, clock=t.clock)
    first, second = [r.getMessage() for r in caplog.records]
    assert first == ("autoscale: prefill 1 (5e+03 > high 1000, 1 of 2 in a row); "
                     "decode 1 (0.5 within [0.3, 0.8])")
    assert second == ("autoscale: prefill 1 -> 4 (5e+03 > high 1000); "
                      "decode 1 (0.5 within [0.3, 0.8])")


def test_a_stop_before_the_first_period_makes_no_decision():
    t = FakeTime(rounds=0)
    cluster = FakeCluster(t, BUSY)
    assert autoscale_loop(cluster, POLICY, t.wait, period_s=15.0, clock=t.clock) == 0
    assert cluster.calls == []


def test_the_period_must_be_positive():
    t = FakeTime(rounds=1)
    with pytest.raises(ValueError, match="period_s"):
        autoscale_loop(FakeCluster(t, BUSY), POLICY, t.wait, period_s=0, clock=t.clock)


# -- driver -> controller actor: plain data both ways ------------------------------------------

class ActorShim:
    """Stands for a Ray actor handle: `handle.method.remote(*args)` calls the object's method
    with a JSON round trip of the arguments and the result (only plain data may cross)."""

    def __init__(self, target: object) -> None:
        self._target = target

    def __getattr__(self, name: str):
        method = getattr(self._target, name)

        def remote(*args):
            return json.loads(json.dumps(method(*json.loads(json.dumps(args)))))
        return SimpleNamespace(remote=remote)


def test_config_and_decision_cross_as_plain_data_and_come_back_equal():
    config = POLICY.config
    assert autoscale_config_from_dict(json.loads(json.dumps(
        autoscale_config_to_dict(config)))) == config
    t = FakeTime(rounds=1)
    cluster = FakeCluster(t, BUSY)
    cluster.autoscale_once(POLICY)
    decision = cluster.autoscale_once(POLICY)
    assert decision.changes()  # a decision with a change, reasons and hysteresis state
    assert decision_from_dict(json.loads(json.dumps(decision_to_dict(decision)))) == decision


def test_remote_cluster_drives_the_controllers_cluster_through_the_actor():
    pytest.importorskip("ray", reason="ray is not installed (pip install -e .[ray])")
    from pdserve.deploy.controller import Controller, spec_to_dict
    from pdserve.deploy.spec import RayClusterSpec

    controller = Controller(spec_to_dict(RayClusterSpec(model="/m", redis_url="redis://r:6379")))
    t = FakeTime(rounds=2)
    controller.cluster = FakeCluster(t, BUSY)  # no Ray cluster: only the actor's plumbing
    remote = RemoteCluster(ActorShim(controller), get=lambda result: result)
    assert autoscale_loop(remote, POLICY, t.wait, period_s=15.0, clock=t.clock) == 2
    assert controller.cluster.sizes == {"prefill": 4, "decode": 1}


def test_the_autoscaler_thread_of_ray_up_runs_until_stopped():
    from pdserve.deploy.cli import _start_autoscaler

    ran = threading.Event()
    t = FakeTime(rounds=10**6)

    class Controller:
        def __init__(self) -> None:
            self.cluster = FakeCluster(t, BUSY)

        def autoscale_once(self, config):
            ran.set()
            policy = AutoscalePolicy(autoscale_config_from_dict(config))
            return decision_to_dict(self.cluster.autoscale_once(policy))

    stop = threading.Event()
    thread = _start_autoscaler(SimpleNamespace(get=lambda r: r), ActorShim(Controller()),
                               POLICY.config, 0.001, stop)
    assert ran.wait(30.0), "no decision was made"
    stop.set()
    thread.join(30.0)
    assert not thread.is_alive()


# -- `pdserve ray up --autoscale` flags ----------------------------------------------------------

def up_args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["up", "--model", "/m", *flags])


def test_flags_set_the_bounds_and_keep_the_default_thresholds():
    assert autoscale_config(up_args()) is None
    config = autoscale_config(up_args("--autoscale", "--prefill", "2", "--prefill-max", "3",
                                      "--decode-min", "2", "--decode", "2"))
    default = AutoscaleConfig()
    assert (config.prefill.min_replicas, config.prefill.max_replicas) == (1, 3)
    assert (config.decode.min_replicas, config.decode.max_replicas) == (2, default.decode
                                                                        .max_replicas)
    assert (config.prefill.high, config.decode.low) == (default.prefill.high, default.decode.low)
    assert up_args("--autoscale").autoscale_period == 15.0


@pytest.mark.parametrize("flags, named", [
    (["--prefill-max", "4"], "--prefill-max"),  # without --autoscale: it would do nothing
    (["--autoscale", "--decode-min", "0"], "--decode-min"),
    (["--autoscale", "--prefill-min", "3", "--prefill-max", "2"], "--prefill-min"),
    (["--autoscale", "--decode", "9"], "--decode"),
    (["--autoscale", "--autoscale-period", "0"], "--autoscale-period"),
])
def test_bounds_that_cannot_work_are_refused_naming_the_flag(flags, named):
    with pytest.raises(ValueError, match=named):
        autoscale_config(up_args(*flags))

