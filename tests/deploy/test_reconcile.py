"""The controller's pure parts: what it does next (`reconcile.plan`), the lifecycle table,
start backoff, and the autoscaling cadence. No Ray, no processes, no sleeping."""

from __future__ import annotations

import pytest

from pdserve.deploy.autoscale import AutoscaleConfig, AutoscalePolicy, ScaleRule, WorkerLoad
from pdserve.deploy.autoscale_loop import Cadence, describe
from pdserve.deploy.reconcile import Backoff, Member, Phase, check_transition, plan

TARGETS = {"router": 1, "prefill": 1, "decode": 2}


def members(*specs: tuple[str, str, Phase]) -> list[Member]:
    return [Member(name, role, phase, i) for i, (name, role, phase) in enumerate(specs)]


def test_an_empty_deployment_starts_every_role():
    p = plan(TARGETS, [])
    assert p.start == TARGETS and not p.drain and not p.reap


def test_a_dead_member_is_reaped_and_replaced_and_a_starting_one_counts():
    ms = members(("router-0", "router", Phase.READY), ("prefill-0", "prefill", Phase.LOST),
                 ("decode-0", "decode", Phase.READY), ("decode-1", "decode", Phase.STARTING))
    p = plan(TARGETS, ms)
    assert p.reap == ("prefill-0",) and p.start == {"prefill": 1} and not p.drain


def test_a_converged_deployment_needs_nothing():
    ms = members(("router-0", "router", Phase.READY), ("prefill-0", "prefill", Phase.READY),
                 ("decode-0", "decode", Phase.READY), ("decode-1", "decode", Phase.READY))
    assert plan(TARGETS, ms).empty


def test_a_surplus_drains_what_serves_nobody_first_then_the_least_loaded():
    ms = members(("decode-0", "decode", Phase.READY), ("decode-1", "decode", Phase.READY),
                 ("decode-2", "decode", Phase.READY), ("decode-3", "decode", Phase.STARTING))
    loads = {"decode-0": WorkerLoad(kv_blocks_used=50, kv_blocks_total=100),
             "decode-1": WorkerLoad(kv_blocks_used=10, kv_blocks_total=100),
             "decode-2": WorkerLoad(kv_blocks_used=90, kv_blocks_total=100)}
    assert plan({"decode": 2}, ms, loads).drain == ("decode-3", "decode-1")
    # A ready worker that answers no stats goes before a loaded one.
    del loads["decode-2"]
    assert plan({"decode": 1}, ms, loads).drain == ("decode-3", "decode-2", "decode-1")


def test_draining_members_no_longer_count_and_routers_drain_newest_first():
    ms = members(("router-0", "router", Phase.READY), ("router-1", "router", Phase.READY),
                 ("router-2", "router", Phase.DRAINING))
    assert plan({"router": 1}, ms).drain == ("router-1",)
    assert plan({"router": 3}, ms).start == {"router": 1}


def test_a_role_in_backoff_starts_nothing_but_still_drains():
    ms = members(("decode-0", "decode", Phase.READY), ("decode-1", "decode", Phase.READY))
    blocked = frozenset({"decode", "prefill"})
    assert plan({"decode": 3, "prefill": 1}, ms, blocked=blocked).start == {}
    assert plan({"decode": 1}, ms, blocked=blocked).drain == ("decode-1",)


@pytest.mark.parametrize("old, new", [(Phase.READY, Phase.STARTING), (Phase.LOST, Phase.READY),
                                      (Phase.DRAINING, Phase.READY),
                                      (Phase.PLACING, Phase.READY)])
def test_the_lifecycle_refuses_transitions_that_skip_or_go_back(old, new):
    with pytest.raises(ValueError, match=f"{old.value} -> {new.value}"):
        check_transition(old, new)


def test_backoff_doubles_up_to_its_cap_and_clears_on_success():
    b = Backoff(base_s=5.0, cap_s=30.0)
    assert [b.failed("decode", 0.0) for _ in range(4)] == [5.0, 10.0, 20.0, 30.0]
    assert b.blocked(29.0) == {"decode"} and b.blocked(30.0) == frozenset()
    assert b.failures("decode") == 4
    b.succeeded("decode")
    assert b.failures("decode") == 0 and b.blocked(0.0) == frozenset()


def test_the_first_decision_comes_a_period_after_the_start_and_the_cadence_is_kept():
    c = Cadence(period_s=15.0, now=0.0)
    assert not c.due(14.9) and c.due(15.0)
    c.done(started=15.0, now=20.0)  # a round within the period
    assert c.next_at == 30.0
    c.done(started=30.0, now=130.0)  # a scale-up that waited for model loads
    assert c.next_at == 145.0  # a full period after it ended
    with pytest.raises(ValueError, match="period_s"):
        Cadence(period_s=0, now=0.0)


def test_a_decision_reads_as_one_log_line_with_its_reasons():
    policy = AutoscalePolicy(AutoscaleConfig(
        prefill=ScaleRule(min_replicas=1, max_replicas=4, high=1000, low=100, up_after=1),
        decode=ScaleRule(min_replicas=1, max_replicas=4, high=0.8, low=0.3)))
    d = policy.decide({"prefill": 1, "decode": 1},
                      {"prefill": [WorkerLoad(queued_prefill_tokens=5000)],
                       "decode": [WorkerLoad(kv_blocks_used=50, kv_blocks_total=100)]})
    assert describe(d) == ("prefill 1 -> 4 (5e+03 > high 1000); "
                           "decode 1 (0.5 within [0.3, 0.8])")
