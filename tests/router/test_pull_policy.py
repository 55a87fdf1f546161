"""Choosing a pull source and what a prefetch hint names: pure functions of index figures."""

from __future__ import annotations

from router.policy import Holder, pick_pull_source, prefetch_hashes

BS = 16


def pick(holders, own=0, prompt=212, threshold=32, have_prefill=True):
    return pick_pull_source(holders, own, prompt, BS, threshold, have_prefill)


def test_pulls_from_the_longest_prefix_when_the_rest_is_short():
    holders = [Holder(0, blocks=10, device_blocks=10, tp_size=1),
               Holder(1, blocks=12, device_blocks=12, tp_size=1)]
    assert pick(holders).index == 1  # 212 - 12 * 16 = 20 tokens left for D


def test_no_pull_when_the_rest_is_long_and_a_prefill_worker_exists():
    holders = [Holder(0, blocks=8, device_blocks=8, tp_size=1)]  # 84 tokens left
    assert pick(holders) is None
    assert pick(holders, have_prefill=False).index == 0  # D computes the rest anyway


def test_no_pull_unless_the_source_holds_more_than_the_decode_worker():
    holders = [Holder(0, blocks=12, device_blocks=12, tp_size=1)]
    assert pick(holders, own=12) is None
    assert pick(holders, own=11).index == 0


def test_tensor_parallel_sources_are_skipped():
    assert pick([Holder(0, blocks=12, device_blocks=12, tp_size=2)]) is None


def test_the_last_prompt_token_is_never_pulled():
    # A 192-token prompt can use 11 blocks at most: the 12th holds the token D must compute.
    holders = [Holder(0, blocks=12, device_blocks=12, tp_size=1)]
    assert pick(holders, own=11, prompt=192) is None
    assert pick(holders, own=10, prompt=192).index == 0


def test_ties_go_to_the_source_with_more_blocks_in_device_memory():
    holders = [Holder(0, blocks=12, device_blocks=4, tp_size=1),
               Holder(1, blocks=12, device_blocks=12, tp_size=1),
               Holder(2, blocks=12, device_blocks=12, tp_size=1)]
    assert pick(holders).index == 1


def test_prefetch_names_only_the_blocks_below_device_memory():
    hashes = [bytes([i]) * 16 for i in range(6)]
    assert prefetch_hashes((2, 4, 5), hashes) == hashes[2:5]
    assert prefetch_hashes((5, 5, 5), hashes) == []  # all in device memory
    assert prefetch_hashes((), hashes) == []
