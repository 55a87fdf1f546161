"""Host and SSD stores of the KV tiers, and the load-or-recompute rule."""

from __future__ import annotations

import os
import struct
import threading
import zlib

import numpy as np
import pytest
import torch

from kv_store.block_pool import CachedBlock
from kv_store.index.events import Tier
from kv_store.tiers import HostStore, SSDStore, TierManager, plan_load, record, should_load
from kv_store.tiers.policy import EMA, demote_ahead_window

BB = 64  # block bytes
BS = 4  # tokens per block


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _data(i: int) -> torch.Tensor:
    return torch.full((BB,), i % 251, dtype=torch.uint8)


def _toks(i: int) -> list[int]:
    return [i, i + 1, i + 2, i + 3]


# -- host ------------------------------------------------------------------------------------
def _host_get(host: HostStore, i: int) -> torch.Tensor | None:
    out = []
    ok = host.read(_h(i), _toks(i), lambda s: out.append(s.clone()))
    return out[0] if ok else None


def test_host_round_trip_and_token_check():
    host = HostStore(4 * BB, BB)
    assert host.put(_h(1), _toks(1), _data(1))
    assert not host.put(_h(1), _toks(1), _data(2))  # already held: unchanged
    assert torch.equal(_host_get(host, 1), _data(1))
    assert not host.read(_h(1), [9, 9, 9, 9], lambda s: None)  # same hash, other tokens
    assert host.remove(_h(1)) and len(host) == 0


def test_host_evicts_least_recently_used_to_the_callback():
    evicted = []
    host = HostStore(3 * BB, BB, on_evict=lambda h, t, d: evicted.append((h, t, d.clone())))
    for i in range(3):
        host.put(_h(i), _toks(i), _data(i))
    _host_get(host, 0)  # 0 becomes most recent: 1 is now the LRU
    host.put(_h(3), _toks(3), _data(3))
    assert [e[0] for e in evicted] == [_h(1)]
    assert evicted[0][1] == tuple(_toks(1)) and torch.equal(evicted[0][2], _data(1))
    assert len(host) == 3 and host.bytes_used == 3 * BB
    assert torch.equal(_host_get(host, 3), _data(3))


def test_host_capacity_below_one_block_is_refused():
    with pytest.raises(ValueError, match="capacity"):
        HostStore(BB - 1, BB)


def test_host_concurrent_puts_and_reads_stay_consistent():
    host = HostStore(16 * BB, BB)

    def work(base: int) -> None:
        for i in range(base + 3, base + 200):
            host.put(_h(i), _toks(i), _data(i))
            got = _host_get(host, i - 3)
            assert got is None or torch.equal(got, _data(i - 3))

    threads = [threading.Thread(target=work, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(host) == 16 and len(set(host.hashes())) == 16


# -- SSD -------------------------------------------------------------------------------------
def _ssd(tmp_path, records: int, per_segment: int = 2, notify=None,
         persist: bool = False) -> SSDStore:
    rec = record.record_bytes(BS, BB)
    return SSDStore(tmp_path, records * rec, BB, BS, segment_bytes=per_segment * rec,
                    notify=notify, persist=persist)


def test_ssd_round_trip_and_token_check(tmp_path):
    events = []
    ssd = _ssd(tmp_path, 8, notify=lambda k, h: events.append((k, h)))
    assert ssd.write(_h(1), _toks(1), _data(1).numpy().tobytes()).result()
    assert not ssd.write(_h(1), _toks(1), _data(1).numpy().tobytes()).result()
    got = ssd.read(_h(1), _toks(1)).result()
    assert bytes(got) == _data(1).numpy().tobytes()
    assert ssd.read(_h(1), [0, 0, 0, 0]).result() is None
    assert ssd.read(_h(2), _toks(2)).result() is None
    assert events == [("stored", _h(1))]
    ssd.close()


def test_ssd_persisted_tier_is_rebuilt_at_start_and_survives_a_torn_record(tmp_path):
    ssd = _ssd(tmp_path, 8, persist=True)
    for i in range(5):
        assert ssd.write(_h(i), _toks(i), _data(i).numpy().tobytes()).result()
    path, offset = ssd.location(_h(3))
    ssd.close()
    raw = bytearray(path.read_bytes())  # a crash mid-write: record 3's bytes are torn
    raw[offset + ssd.record_bytes - 1] ^= 0xFF
    path.write_bytes(bytes(raw))
    (tmp_path / "seg-junk.pdkv").write_bytes(b"not ours")

    events = []
    again = _ssd(tmp_path, 8, persist=True, notify=lambda k, h: events.append((k, h)))
    assert again.num_recovered == 5 and len(again) == 5
    assert sorted(h for k, h in events if k == "stored") == sorted(_h(i) for i in range(5))
    for i in (0, 1, 2, 4):
        assert bytes(again.read(_h(i), _toks(i)).result()) == _data(i).numpy().tobytes()
    assert again.read(_h(3), _toks(3)).result() is None  # checksum: recomputed, not served
    assert again.write(_h(9), _toks(9), _data(9).numpy().tobytes()).result()  # appends go on
    again.close()
    smaller = _ssd(tmp_path, 2, persist=True)  # capacity shrank to the newest segment
    assert len(smaller) == 2 and _h(0) not in smaller
    assert smaller.read(_h(9), _toks(9)).result() is not None
    smaller.close()
    assert _ssd(tmp_path, 8).num_recovered == 0  # without persist: start empty
    assert not list(tmp_path.glob("seg-0*.pdkv"))


def test_ssd_evicts_the_oldest_segment_at_capacity(tmp_path):
    removed = []
    ssd = _ssd(tmp_path, 4, per_segment=2,
               notify=lambda k, h: removed.append(h) if k == "removed" else None)
    for i in range(5):
        ssd.write(_h(i), _toks(i), _data(i).numpy().tobytes()).result()
    assert removed == [_h(0), _h(1)]  # the first segment went as a whole
    assert len(ssd) == 3 and len(list(tmp_path.glob("seg-*.pdkv"))) == 2
    assert ssd.read(_h(0), _toks(0)).result() is None
    assert bytes(ssd.read(_h(4), _toks(4)).result()) == _data(4).numpy().tobytes()
    ssd.close()


def test_ssd_corrupted_record_is_a_miss_and_dropped(tmp_path):
    ssd = _ssd(tmp_path, 8)
    ssd.write(_h(1), _toks(1), _data(1).numpy().tobytes()).result()
    path, offset = ssd.location(_h(1))
    raw = bytearray(path.read_bytes())
    raw[offset + ssd.record_bytes - 1] ^= 0x01  # one bit of the block bytes
    path.write_bytes(bytes(raw))
    assert ssd.read(_h(1), _toks(1)).result() is None
    assert ssd.num_corrupted == 1 and _h(1) not in ssd
    ssd.close()


def test_ssd_concurrent_writes_and_reads(tmp_path):
    ssd = _ssd(tmp_path, 64, per_segment=8)
    futs = [ssd.write(_h(i), _toks(i), _data(i).numpy().tobytes()) for i in range(40)]
    assert all(f.result() for f in futs)
    reads = {i: ssd.read(_h(i), _toks(i)) for i in range(40)}
    for i, f in reads.items():
        assert bytes(f.result()) == _data(i).numpy().tobytes()
    ssd.close()
    assert not list(tmp_path.glob("seg-*.pdkv"))


def test_ssd_read_many_returns_each_block_in_order_with_misses(tmp_path, monkeypatch):
    ssd = _ssd(tmp_path, 16, per_segment=4)
    for i in range(10):
        assert ssd.write(_h(i), _toks(i), _data(i).numpy().tobytes()).result()
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv",
                        lambda fd, bufs, off: calls.append(off) or real(fd, bufs, off))
    want = [7, 2, 3, 99, 4, 5, 1]  # 2..5 span two segments; 99 was never stored
    futs = ssd.read_many([(_h(i), _toks(i)) for i in want])
    got = [f.result() for f in futs]
    for i, data in zip(want, got, strict=True):
        assert (data is None) if i == 99 else bytes(data) == _data(i).numpy().tobytes()
    # Adjacent records are read together: [1, 2, 3] and [4, 5] (segments of 4), [7].
    assert len(calls) == 3
    ssd.close()


def test_ssd_records_name_their_checksum_and_each_kind_verifies(tmp_path, monkeypatch):
    """Records written with either checksum (xxh3-64 only where `xxhash` is installed) sit
    side by side in one tier and each is checked with the kind it names."""
    kinds = [record.Checksum.CRC32] + ([record.Checksum.XXH3_64] if record.xxhash else [])
    ssd = _ssd(tmp_path, 8)
    for i, kind in enumerate(kinds):
        monkeypatch.setattr(record, "WRITE_CHECKSUM", kind)
        assert ssd.write(_h(i), _toks(i), _data(i).numpy().tobytes()).result()
    for i, kind in enumerate(kinds):
        path, offset = ssd.location(_h(i))
        assert path.read_bytes()[offset + 5] == kind
        assert bytes(ssd.read(_h(i), _toks(i)).result()) == _data(i).numpy().tobytes()
    ssd.close()


def test_ssd_refuses_persisted_records_of_the_old_version(tmp_path):
    """A version-1 segment left by an older build is skipped at start-up (and deleted), its
    blocks are misses, and the tier goes on writing the current version."""
    old = struct.Struct("<4sBxH16sII")  # version 1: crc32 in a 32-bit field
    tok = np.asarray(_toks(1), dtype="<i4").tobytes()
    data = _data(1).numpy().tobytes()
    body = tok + data
    v1 = old.pack(b"PDKV", 1, BS, _h(1), zlib.crc32(body), BB) + body
    seg = tmp_path / "seg-00000000.pdkv"
    seg.write_bytes(v1 + b"\0" * (record.record_bytes(BS, BB) - len(v1)))
    ssd = _ssd(tmp_path, 8, persist=True)
    assert ssd.num_refused == 1 and ssd.num_recovered == 0 and _h(1) not in ssd
    assert ssd.read(_h(1), _toks(1)).result() is None and not seg.exists()
    assert ssd.write(_h(1), _toks(1), data).result()
    assert bytes(ssd.read(_h(1), _toks(1)).result()) == data
    ssd.close()


# -- load or recompute -----------------------------------------------------------------------
def test_should_load_compares_copy_time_with_recompute_time():
    # 1 MB at 1 GB/s = 1 ms; 16 tokens at 1000 tok/s = 16 ms → load.
    assert should_load(2**20, 1e9, 16, 1000.0)
    # 1 MB at 10 MB/s = 100 ms > 16 ms → recompute.
    assert not should_load(2**20, 1e7, 16, 1000.0)
    assert should_load(2**20, None, 16, 1000.0)  # unmeasured tier: probe it once


def test_plan_load_takes_the_best_prefix_of_a_mixed_run():
    bw = {Tier.HOST: 1e9, Tier.SSD: 1e6}
    # A block: 16 tokens at 1000 tok/s = 16 ms to recompute; 1 MB: host 1 ms, SSD 1 s.
    assert plan_load([Tier.HOST] * 3, 2**20, 16, bw, 1000.0) == 3
    assert plan_load([Tier.HOST, Tier.HOST, Tier.SSD], 2**20, 16, bw, 1000.0) == 2
    assert plan_load([Tier.SSD, Tier.HOST], 2**20, 16, bw, 1000.0) == 0
    assert plan_load([], 2**20, 16, bw, 1000.0) == 0


def test_ema_tracks_rates():
    ema = EMA(alpha=0.5)
    ema.add(100, 1.0)
    ema.add(300, 1.0)
    assert ema.value == pytest.approx(200.0)


def test_demote_ahead_window_is_bounded_by_a_quarter_of_the_host_tier():
    assert demote_ahead_window(32, 64) == 16
    assert demote_ahead_window(4, 64) == 4
    assert demote_ahead_window(32, 3) == 0  # a tiny host tier: no copies ahead
    assert demote_ahead_window(0, 64) == 0


# -- demotion ahead of eviction --------------------------------------------------------------
def _manager(events: list) -> tuple[TierManager, torch.Tensor]:
    cache = torch.arange(6 * 2 * 8, dtype=torch.float32).reshape(6, 2, 8)  # 64 B per block
    tiers = TierManager([cache], BS, host_bytes=4 * 64,
                        on_event=lambda ev, tier: events.append((ev.kind, ev.block_hash, tier)))
    return tiers, cache


def test_demote_ahead_copies_once_and_eviction_then_copies_nothing():
    events: list = []
    tiers, cache = _manager(events)
    blocks = [CachedBlock(i, _h(i), tuple(_toks(i))) for i in range(3)]
    tiers.host.put(_h(2), _toks(2), torch.zeros(64, dtype=torch.uint8))  # already in host
    done = tiers.demote_ahead(blocks, max_blocks=1)
    assert [b.block_id for b in done] == [0]  # the budget: one block per call
    assert [b.block_id for b in tiers.demote_ahead(blocks, max_blocks=5)] == [1]  # 2 skipped
    expect = cache[1].reshape(-1).view(torch.uint8)
    got = []
    assert tiers.host.read(_h(1), _toks(1), lambda s: got.append(s.clone()))
    assert torch.equal(got[0], expect)  # the device block's bytes, copied while it stays
    for b in blocks[:2]:  # their eviction finds them in host: no second copy, no event
        tiers.demote(b.block_id, b.block_hash, b.token_ids)
    stats = tiers.stats()
    assert stats["kv_tier_demoted_ahead"] == 2
    assert stats["kv_tier_demote_found_in_host"] == 2
    assert stats.get("kv_tier_demote_copies", 0) == 0
    assert [(k, h) for k, h, t in events if t is Tier.HOST] == [("stored", _h(0)),
                                                               ("stored", _h(1))]
    tiers.demote(3, _h(3), tuple(_toks(3)))  # not ahead: copied at eviction
    assert tiers.stats()["kv_tier_demote_copies"] == 1
