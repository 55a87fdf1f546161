"""The autoscaling policy: each pool on its own signal, within bounds, with hysteresis."""

from __future__ import annotations

import pytest

from pdserve.deploy.autoscale import (
    AutoscaleConfig,
    AutoscalePolicy,
    AutoscaleState,
    PoolTrend,
    ScaleRule,
    WorkerLoad,
    least_loaded,
    pool_signal,
)

PREFILL = ScaleRule(min_replicas=1, max_replicas=6, high=1000, low=100, up_after=2,
                    down_after=3, max_step_up=3)
DECODE = ScaleRule(min_replicas=1, max_replicas=4, high=0.8, low=0.3, up_after=2, down_after=3)
POLICY = AutoscalePolicy(AutoscaleConfig(prefill=PREFILL, decode=DECODE))


def queued(*tokens: int) -> list[WorkerLoad]:
    return [WorkerLoad(queued_prefill_tokens=t) for t in tokens]


def kv(*usage: float) -> list[WorkerLoad]:
    return [WorkerLoad(kv_blocks_used=int(u * 100), kv_blocks_total=100) for u in usage]


def run(observations, sizes):
    """Feed observations one by one, applying each decision; the sizes after each."""
    state, seen = AutoscaleState(), []
    for loads in observations:
        d = POLICY.decide(sizes, loads, state)
        state, sizes = d.state, dict(d.targets)
        seen.append(sizes)
    return seen


def test_each_pool_is_scaled_on_its_own_signal():
    assert pool_signal("prefill", queued(3000, 1000)) == 2000
    assert pool_signal("decode", kv(0.9, 0.5)) == pytest.approx(0.7)
    # Prefill overloaded, decode calm: only the prefill pool grows.
    seen = run([{"prefill": queued(3000, 3000), "decode": kv(0.5, 0.5)}] * 2,
               {"prefill": 2, "decode": 2})
    assert seen[-1] == {"prefill": 5, "decode": 2}  # ceil(2 * 3000 / 1000) = 6, step cap 3


def test_a_single_spike_does_not_scale_up():
    seen = run([{"prefill": queued(5000), "decode": kv(0.95)},
                {"prefill": queued(10), "decode": kv(0.5)},
                {"prefill": queued(5000), "decode": kv(0.95)}],
               {"prefill": 1, "decode": 1})
    assert all(s == {"prefill": 1, "decode": 1} for s in seen)


def test_scale_up_adds_at_least_one_and_stops_at_max():
    seen = run([{"prefill": queued(1001), "decode": kv(0.81)}] * 2, {"prefill": 1, "decode": 1})
    assert seen[-1] == {"prefill": 2, "decode": 2}
    seen = run([{"prefill": queued(*[9000] * 6), "decode": kv(*[0.99] * 4)}] * 4,
               {"prefill": 6, "decode": 4})
    assert seen[-1] == {"prefill": 6, "decode": 4}


def test_scale_down_is_slower_one_at_a_time_and_not_below_min():
    calm = {"prefill": queued(0, 0, 0), "decode": kv(0.1, 0.1)}
    seen = run([calm] * 9, {"prefill": 3, "decode": 2})
    assert seen[1] == {"prefill": 3, "decode": 2}  # not after 2 calm observations
    assert seen[2] == {"prefill": 2, "decode": 1}  # after 3: one worker each
    assert seen[-1] == {"prefill": 1, "decode": 1}  # min_replicas


def test_no_scale_down_that_would_push_the_rest_over_high():
    # 0.29 < low; 4 workers' load on 3 would be 0.39: over a tight band's high, so it stays.
    tight = AutoscalePolicy(AutoscaleConfig(
        prefill=PREFILL, decode=ScaleRule(high=0.35, low=0.3, down_after=1)))
    d = tight.decide({"prefill": 1, "decode": 4}, {"decode": kv(0.29, 0.29, 0.29, 0.29)})
    assert d.targets["decode"] == 4
    d = POLICY.decide({"prefill": 1, "decode": 4}, {"decode": kv(0.29, 0.29, 0.29, 0.29)},
                      AutoscaleState({"decode": PoolTrend(below=2)}))
    assert d.targets["decode"] == 3


def test_in_band_resets_the_streaks():
    seen = run([{"prefill": queued(5000), "decode": kv(0.5)},
                {"prefill": queued(500), "decode": kv(0.5)},   # inside [low, high]
                {"prefill": queued(5000), "decode": kv(0.5)}], {"prefill": 1, "decode": 1})
    assert seen[-1]["prefill"] == 1


def test_bounds_apply_at_once_and_missing_figures_never_shrink_a_pool():
    d = POLICY.decide({"prefill": 0, "decode": 9}, {})
    assert d.targets == {"prefill": 1, "decode": 4}
    d = POLICY.decide({"prefill": 3, "decode": 2}, {"prefill": [], "decode": []})
    assert d.targets == {"prefill": 3, "decode": 2}


def test_least_loaded_picks_the_idlest_worker_by_the_pools_signal():
    loads = {"a": WorkerLoad(queued_prefill_tokens=50, kv_blocks_used=1, kv_blocks_total=10),
             "b": WorkerLoad(queued_prefill_tokens=10, kv_blocks_used=9, kv_blocks_total=10),
             "c": WorkerLoad(queued_prefill_tokens=10, num_running=2, kv_blocks_used=5,
                             kv_blocks_total=10)}
    assert least_loaded("prefill", loads) == "b"  # ties on tokens broken by requests held
    assert least_loaded("decode", loads) == "a"
    with pytest.raises(ValueError):
        least_loaded("decode", {})


@pytest.mark.parametrize("kwargs, field", [
    ({"min_replicas": 3, "max_replicas": 2}, "min_replicas"),
    ({"high": 0.3, "low": 0.3}, "low"),
    ({"up_after": 0}, "up_after"),
])
def test_rules_are_validated_with_the_field_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ScaleRule(**kwargs)


def test_worker_load_from_stats_ignores_unknown_fields():
    load = WorkerLoad.from_stats({"queued_prefill_tokens": 7, "kv_blocks_used": 3,
                                  "kv_blocks_total": 4, "other": 1})
    assert load.queued_prefill_tokens == 7 and load.kv_usage == 0.75


@pytest.mark.parametrize("sizes, loads, state, reason", [
    ({"prefill": 1}, {"prefill": queued(5000)}, AutoscaleState(),
     "5e+03 > high 1000, 1 of 2 in a row"),
    ({"prefill": 6}, {"prefill": queued(*[5000] * 6)}, AutoscaleState(),
     "5e+03 > high 1000, at max 6"),
    ({"prefill": 2}, {"prefill": queued(0, 0)}, AutoscaleState(), "0 < low 100, 1 of 3 in a row"),
    ({"prefill": 1}, {"prefill": queued(0)}, AutoscaleState(), "0 < low 100, at min 1"),
    ({"prefill": 2}, {"prefill": queued(99, 99)},
     AutoscaleState({"prefill": PoolTrend(below=2)}), "99 < low 100"),
    ({"prefill": 2}, {"prefill": queued(500, 500)}, AutoscaleState(), "500 within [100, 1000]"),
])
def test_the_reason_says_why_a_pool_moves_or_holds(sizes, loads, state, reason):
    assert POLICY.decide(sizes, loads, state).reasons["prefill"] == reason


def test_a_scale_down_blocked_by_the_rest_going_over_high_says_so():
    tight = AutoscalePolicy(AutoscaleConfig(
        prefill=PREFILL, decode=ScaleRule(high=0.35, low=0.3, down_after=1)))
    d = tight.decide({"prefill": 1, "decode": 4}, {"decode": kv(0.29, 0.29, 0.29, 0.29)})
    assert d.reasons["decode"] == "0.28 < low 0.3, but 3 workers would be over high 0.35"
    assert d.changes() == {} and d.sizes == {"prefill": 1, "decode": 4}
