"""Admission control as a pure policy: bounded queues from what a worker can serve, refusal of
what cannot finish before its deadline, retry hints, the in-flight cap from the pools."""

from __future__ import annotations

import pytest

from router.admission import (
    AdmissionConfig,
    DecodeLoad,
    PrefillLoad,
    RequestSize,
    Slowdown,
    StepTime,
    capacity,
    decide,
    estimate,
    queue_limit,
    slots,
)

STEP = StepTime(base_s=0.01, per_token_s=0.001)  # 10 ms + 1 ms per token in the step


def worker(index=0, occupancy=0, max_seqs=8, blocks=1000, step=STEP, remaining=64.0):
    return DecodeLoad(index=index, max_seqs=max_seqs, kv_blocks_total=blocks, block_size=16,
                      occupancy=occupancy, mean_remaining=remaining, step=step)


def size(deadline=120.0, prompt=20, out=64, remote=False):
    return RequestSize(prompt, out, deadline, remote)


def test_slots_are_bounded_by_the_batch_and_by_kv_blocks():
    assert slots(worker(max_seqs=8, blocks=1000), size()) == 8
    # 20 + 64 tokens need 6 blocks of 16: 30 blocks hold 5 such requests.
    assert slots(worker(max_seqs=8, blocks=30), size()) == 5
    assert queue_limit(worker(max_seqs=8, blocks=1000), size(), AdmissionConfig()) == 32
    # Waiting requests hold their prompt's blocks (2 each): 30 blocks, 15 requests.
    assert queue_limit(worker(max_seqs=8, blocks=30), size(), AdmissionConfig()) == 15


def test_a_free_slot_takes_what_fits_its_deadline_at_that_batch():
    w = worker(occupancy=7)  # it would make the batch 8
    _, finish = estimate(w, size(), 0.0)
    assert finish == pytest.approx(64 * STEP.seconds(8))
    assert decide([w], [], size(deadline=finish / 0.9 + 0.01)).admitted
    assert not decide([worker(occupancy=7, max_seqs=64)], [], size(deadline=finish)).admitted


def test_a_request_too_big_for_its_deadline_even_alone_still_gets_a_free_slot():
    verdict = decide([worker(occupancy=7)], [], size(deadline=0.001))
    assert verdict.admitted and verdict.workers == (0,)  # DEADLINE_EXCEEDED, as ever
    assert not decide([worker(occupancy=8)], [], size(deadline=0.001)).admitted


def test_a_queued_request_is_admitted_only_if_it_can_finish_in_time():
    w = worker(occupancy=8)  # every slot taken: it waits one wave of 64 tokens at batch 8
    start, finish = estimate(w, size(), 0.0)
    assert start == pytest.approx(64 * STEP.seconds(8))
    assert finish == pytest.approx(start + 64 * STEP.seconds(1))  # first of the next batch
    assert estimate(worker(occupancy=13), size(), 0.0)[1] == pytest.approx(
        start + 64 * STEP.seconds(6))  # sixth of it
    assert decide([w], [], size(deadline=finish / 0.9 + 0.01)).admitted
    late = decide([w], [], size(deadline=finish))  # inside the deadline, not inside the margin
    assert late.workers == ()
    assert not late.admitted and "deadline" in late.reason
    assert late.retry_after_s > 0


def test_the_queue_is_bounded_even_with_time_to_spare():
    w = worker(occupancy=32)  # 4 waves of 8
    verdict = decide([w], [], size(deadline=1e6))
    assert not verdict.admitted and "queue full" in verdict.reason
    # Retry when a slot frees: remaining tokens x step time / slots.
    assert verdict.retry_after_s == pytest.approx(64 * STEP.seconds(8) / 8)


def test_an_unmeasured_worker_takes_only_what_it_can_start_at_once():
    assert decide([worker(occupancy=7, step=None)], [], size()).admitted
    assert not decide([worker(occupancy=8, step=None)], [], size()).admitted


def test_only_the_workers_that_can_take_it_are_named():
    busy, idle = worker(0, occupancy=32), worker(1, occupancy=0)
    assert decide([busy, idle], [], size()).workers == (1,)


def test_prefill_queue_delays_the_start():
    w = worker(occupancy=8)
    prefill = [PrefillLoad(queued_tokens=100_000, step_budget=1000, step=STEP)]
    # 101 steps of 1000 tokens: 1.01 s fixed + 101 s per token, before the first token.
    pre = 101 * STEP.base_s + 100_020 * STEP.per_token_s
    start, finish = estimate(w, size(remote=True), pre)
    assert start == pytest.approx(pre)  # longer than the wait for a slot: it decides
    assert not decide([w], prefill, size(deadline=finish, remote=True)).admitted
    assert decide([w], prefill, size(deadline=finish / 0.9 + 1, remote=True)).admitted
    # Prefilled by the decode worker itself: the prefill queue does not count.
    assert decide([w], prefill, size(deadline=finish, remote=False)).admitted


def test_refusal_retry_hint_is_clamped():
    verdict = decide([worker(occupancy=32, remaining=1e9)], [], size())
    assert verdict.retry_after_s == 60.0


def test_no_decode_worker_is_not_an_admission_refusal():
    assert decide([], [], size()).workers == ()  # the flow answers UNAVAILABLE


def test_disabled_admission_admits_everything():
    config = AdmissionConfig(enabled=False)
    assert decide([worker(occupancy=10_000)], [], size(), config).admitted


def test_the_in_flight_cap_is_the_pools_queues():
    loads = [worker(0, max_seqs=8), worker(1, max_seqs=4)]
    assert capacity(loads, size(), AdmissionConfig(queue_waves=2)) == 16 + 8


def test_burst_admits_what_the_worker_finishes_by_the_deadline():
    """300 requests at once: admitted in order until the estimate passes the deadline; every
    admitted one finishes in time under the model, none that could is refused early."""
    step = StepTime(0.02, 0.0005)
    admitted = []
    for _ in range(300):
        w = worker(occupancy=len(admitted), max_seqs=32, step=step)
        if decide([w], [], size(deadline=120.0)).admitted:
            admitted.append(estimate(w, size(), 0.0)[1])
    assert admitted and max(admitted) <= 120.0 * 0.9
    assert len(admitted) < 300
    # One more would have finished past the budget.
    w = worker(occupancy=len(admitted), max_seqs=32, step=step)
    assert estimate(w, size(), 0.0)[1] > 120.0 * 0.9 or len(admitted) == queue_limit(
        w, size(), AdmissionConfig())


def test_the_slowdown_follows_what_streams_see_and_scales_step_times():
    slow = Slowdown(alpha=0.5)
    assert slow.scale(STEP) == STEP
    for _ in range(20):
        slow.observe(observed_s=0.03, predicted_s=0.01)
    assert slow.factor == pytest.approx(3.0, rel=1e-3)
    assert slow.scale(STEP).seconds(8) == pytest.approx(3 * STEP.seconds(8), rel=1e-3)
    slow.observe(observed_s=100.0, predicted_s=0.01)  # a stall counts, bounded
    assert slow.factor <= 12.0
    assert slow.scale(None) is None


def test_a_request_with_n_choices_takes_n_places_on_its_worker():
    unmeasured = worker(occupancy=2, max_seqs=4, step=None)  # takes only what starts at once
    assert decide([unmeasured], [], RequestSize(20, 64, 120.0, False, count=2)).admitted
    assert not decide([unmeasured], [], RequestSize(20, 64, 120.0, False, count=3)).admitted
    # Measured: its last choice lands in a batch of occupancy + n.
    w = worker(occupancy=5)
    one = decide([w], [], size(deadline=64 * STEP.seconds(6) / 0.9 + 0.01))
    three = decide([w], [], RequestSize(20, 64, 64 * STEP.seconds(6) / 0.9 + 0.01, False, 3))
    assert one.admitted and not three.admitted and three.retry_after_s > 0
