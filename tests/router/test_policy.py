"""Worker choice is pure: load figures in, an index out."""

from __future__ import annotations

from router.policy import Load, pick_decode, pick_prefill, prefill_remotely


def test_decode_prefers_the_lowest_kv_usage_fraction():
    loads = [Load(0, 0, used_blocks=50, total_blocks=100, inflight=0),
             Load(1, 0, used_blocks=60, total_blocks=200, inflight=0)]
    assert pick_decode(loads) == 1


def test_decode_counts_requests_in_flight_not_yet_in_stats():
    loads = [Load(0, 0, 0, 100, inflight=5), Load(1, 0, 10, 100, inflight=0)]
    assert pick_decode(loads, blocks_per_request=8) == 1


def test_prefill_prefers_the_shortest_queue():
    loads = [Load(0, queued_tokens=900, used_blocks=0, total_blocks=1, inflight=0),
             Load(1, queued_tokens=100, used_blocks=0, total_blocks=1, inflight=1)]
    assert pick_prefill(loads, prompt_tokens=500) == 1
    assert pick_prefill(loads, prompt_tokens=1000) == 0


def test_no_worker_means_none():
    assert pick_decode([]) is None and pick_prefill([], 10) is None


def test_conditional_disaggregation():
    assert not prefill_remotely(20, 0, threshold=32, have_prefill_workers=True)
    assert prefill_remotely(100, 0, threshold=32, have_prefill_workers=True)
    assert not prefill_remotely(100, 80, threshold=32, have_prefill_workers=True)
    assert not prefill_remotely(100, 0, threshold=32, have_prefill_workers=False)
