"""PrefixIndex: the mask-based walk agrees with a per-worker reference; slots are recycled."""

from __future__ import annotations

import random

from kv_store.index import PrefixIndex, PrefixMatch, Tier
from kv_store.index.events import BlockStored, WorkerGone, WorkerRegistered
from kv_store.index.view import IndexView
from pdserve.block_hash import chain_hashes


def _reference(held: dict[str, dict[bytes, set[Tier]]], query: list[bytes]
               ) -> dict[str, PrefixMatch]:
    """Per worker, per tier: leading blocks held in that tier or a faster one."""
    out = {}
    for w, blocks in held.items():
        runs = []
        for tier in Tier:
            n = 0
            while n < len(query) and any(t <= tier for t in blocks.get(query[n], ())):
                n += 1
            runs.append(n)
        if runs[-1]:
            out[w] = PrefixMatch(tuple(runs))
    return out


def test_match_agrees_with_a_brute_force_reference_beyond_64_workers():
    rng = random.Random(7)
    prompts = [chain_hashes([p * 1000 + i for i in range(48)], 4) for p in range(6)]
    index = PrefixIndex()
    held: dict[str, dict[bytes, set[Tier]]] = {}
    for w in range(150):
        wid = f"w{w}"
        held[wid] = {}
        for prompt in rng.sample(prompts, 2):
            for h in prompt[:rng.randrange(len(prompt) + 1)]:
                if rng.random() < 0.9:  # holes: prefixes are not always intact
                    tier = rng.choice(list(Tier))
                    index.store(wid, [h], tier)
                    held[wid].setdefault(h, set()).add(tier)
    for prompt in prompts:
        for cut in (1, 5, len(prompt)):
            assert index.match(prompt[:cut]) == _reference(held, prompt[:cut])


def test_dropped_workers_leave_nothing_behind_and_their_slots_are_reused():
    h = chain_hashes(list(range(40)), 4)
    index = PrefixIndex()
    for w in range(10):
        index.store(f"w{w}", h[:w + 1], Tier.DEVICE)
    for w in range(0, 10, 2):
        index.drop_worker(f"w{w}")
    assert sorted(index.match(h)) == [f"w{w}" for w in range(1, 10, 2)]
    index.store("new", h[:3], Tier.HOST)
    assert index.match(h)["new"] == PrefixMatch((0, 3, 3))
    for w in [*(f"w{w}" for w in range(1, 10, 2)), "new"]:
        index.drop_worker(w)
    assert index.num_blocks() == 0 and index.match(h) == {} and index.workers() == []
    assert index.match([]) == {}


def test_view_ignores_blocks_of_unknown_workers_and_resets_on_registration():
    h = chain_hashes(list(range(16)), 4)
    view = IndexView()
    view.apply([BlockStored("w", h)], now=0.0)
    assert view.prefix.match(h) == {} and view.ignored_events == 1
    view.apply([WorkerRegistered("w", ttl_s=5), BlockStored("w", h)], now=0.0)
    assert view.prefix.match(h)["w"].blocks == 4
    view.apply([WorkerRegistered("w", ttl_s=5), BlockStored("w", h[:1])], now=1.0)
    assert view.prefix.match(h)["w"].blocks == 1
    assert view.expire(now=5.5) == [] and view.expire(now=6.5) == ["w"]
    view.apply([WorkerRegistered("v", ttl_s=5), WorkerGone("v")], now=7.0)
    view.observe_lease("v", {}, 5, 4.0, now=7.1)  # a registry read older than the goodbye
    assert view.workers() == {}
