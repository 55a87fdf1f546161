"""Worker choice is pure: load figures in, an index out."""

from __future__ import annotations

import pytest

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


def test_decode_prefers_the_worker_holding_the_prefix_within_the_guard():
    loads = [Load(0, 0, used_blocks=10, total_blocks=100, inflight=0),
             Load(1, 0, used_blocks=20, total_blocks=100, inflight=0, cached_blocks=12)]
    assert pick_decode(loads) == 1  # affinity: 0.2 usage is within 0.25 of the floor


def test_decode_affinity_never_builds_a_hot_spot():
    loads = [Load(0, 0, used_blocks=10, total_blocks=100, inflight=0),
             Load(1, 0, used_blocks=90, total_blocks=100, inflight=0, cached_blocks=50)]
    assert pick_decode(loads) == 0


def test_prefill_counts_only_uncached_tokens():
    loads = [Load(0, queued_tokens=0, used_blocks=0, total_blocks=1, inflight=0),
             Load(1, queued_tokens=100, used_blocks=0, total_blocks=1, inflight=0,
                  cached_blocks=20)]
    assert pick_prefill(loads, prompt_tokens=400, block_size=16) == 1  # 80 + 100 < 400


def test_prefill_guard_spreads_a_popular_prefix():
    loads = [Load(0, queued_tokens=0, used_blocks=0, total_blocks=1, inflight=0),
             Load(1, queued_tokens=5000, used_blocks=0, total_blocks=1, inflight=0,
                  cached_blocks=400)]
    assert pick_prefill(loads, prompt_tokens=6400, block_size=16,
                        max_imbalance_tokens=4096) == 0


def test_tier_weights_discount_slower_tiers():
    from router.policy import weighted_blocks

    assert weighted_blocks([4, 4, 4]) == 4.0  # all in device memory
    assert weighted_blocks([0, 4, 4]) < weighted_blocks([4, 4, 4])
    assert weighted_blocks([0, 0, 4]) < weighted_blocks([0, 4, 4])


def test_tier_weights_come_from_the_real_block_bytes_and_measured_speeds():
    from router.policy import TIER_WEIGHTS, TierSpeeds, tier_weights, weighted_blocks

    assert tier_weights(None) == TIER_WEIGHTS
    assert tier_weights(TierSpeeds(4096, 16)) == TIER_WEIGHTS  # nothing measured yet
    # 16 tokens at 1600 tok/s: 10 ms to recompute a block. SSD at 1 MB/s reads a 4 kB
    # (MLA-sized) block in 4 ms and a 16 kB (GQA-sized) one in 16 ms: worth 0.6, or nothing.
    latent = tier_weights(TierSpeeds(4000, 16, host_bw=4e8, ssd_bw=1e6, prefill_tps=1600))
    heads = tier_weights(TierSpeeds(16000, 16, host_bw=4e8, ssd_bw=1e6, prefill_tps=1600))
    assert latent[0] == heads[0] == 1.0
    assert latent[1] > 0.99 and latent[2] == pytest.approx(0.6)
    assert heads[2] == 0.0
    only_host = tier_weights(TierSpeeds(4000, 16, host_bw=4e8, prefill_tps=1600))
    assert only_host[2] == TIER_WEIGHTS[2]  # SSD not measured: the default
    assert weighted_blocks([0, 0, 4], latent) > weighted_blocks([0, 0, 4], heads)
