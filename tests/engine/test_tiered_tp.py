"""Host / SSD KV tiers with tensor parallelism (TP=2, two real processes over gloo).

Every rank keeps its own head slice of each block in its own tiers; rank 0 decides and its
followers replay. Greedy output must equal TP=1 without tiers whatever the tiers do.
"""

from __future__ import annotations

import msgpack
import pytest

from pdserve.block_hash import ROOT_HASH, block_hash
from pdserve.engine import LLM, SamplingParams
from pdserve.engine.tp.tiers import TierOp, TierOpKind
from tests.engine.test_tiered_cache import FixedSpeeds
from tests.helpers.checkpoints import VOCAB, save_tiny
from tests.helpers.engine import assert_idle, random_prompts

pytestmark = pytest.mark.timeout(300)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BS = 4
BASE = dict(dtype="float32", block_size=BS, max_num_batched_tokens=64)
HOST_BLOCKS = 8  # an ahead-demotion window of 2 blocks (a quarter of the host tier)
PROMPT_LEN = 22  # 5 full blocks can come from the tiers (the last token is always computed)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    # A larger init spread so greedy outputs vary (the default gives near-uniform logits).
    return save_tiny(tmp_path_factory.mktemp("tiered-tp"), "llama", seed=7,
                     initializer_range=0.2, attention_bias=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts([PROMPT_LEN] * 12, VOCAB, seed=23)


@pytest.fixture(scope="module")
def ref(ckpt, prompts):
    """TP=1, no tiers: the expected output of each prompt, and one rank's block bytes."""
    llm = LLM(str(ckpt), **BASE, num_gpu_blocks=64)
    outs = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    full = sum(c[0].numel() * c.element_size() for c in llm.engine.runner.caches)
    return outs, full // 2  # 2 KV heads split over 2 ranks


@pytest.fixture(scope="module")
def llm(ckpt, ref, tmp_path_factory):
    rank_bytes = ref[1]
    ssd = tmp_path_factory.mktemp("tiered-tp-ssd")
    llm = LLM(str(ckpt), **BASE, num_gpu_blocks=10, tensor_parallel_size=2,
              kv_host_gb=HOST_BLOCKS * rank_bytes / 2**30, kv_ssd_dir=str(ssd),
              kv_ssd_gb=64 * (rank_bytes + 4 * BS + 64) / 2**30)
    llm.engine.tiers.bandwidth = FixedSpeeds(1e12, 1e12, 1.0)  # always load: deterministic
    yield llm
    llm.close()


def _gen(llm, ref, prompts, i: int) -> None:
    assert llm.generate([prompts[i]], GREEDY)[0].token_ids == ref[0][i], f"prompt {i}"


def _hashes(llm, prompt) -> list[tuple[bytes, tuple[int, ...]]]:
    extra, out, parent = llm.engine.scheduler.kv.hash_extra, [], ROOT_HASH
    for i in range(len(prompt) // BS):
        toks = tuple(prompt[i * BS:(i + 1) * BS])
        parent = block_hash(parent, toks, extra)
        out.append((parent, toks))
    return out


def _stat(llm, name: str) -> float:
    return llm.engine.stats().get(name, 0.0)


def test_tier_ops_survive_the_wire():
    op = TierOp(TierOpKind.LOAD, (3, 4), (b"\x01" * 16, b"\x02" * 16), ((1, 2), (3, 4)))
    wire = msgpack.unpackb(msgpack.packb(op.to_wire(), use_bin_type=True), raw=False)
    assert TierOp.from_wire(wire) == op
    stats = TierOp(TierOpKind.STATS, names=("kv_tier_host_blocks",))
    assert TierOp.from_wire(stats.to_wire()) == stats


def test_tp2_blocks_go_to_host_and_ssd_and_come_back(llm, ref, prompts):
    tiers = llm.engine.tiers
    for i in range(4):  # each prompt evicts the one before it: device → host → SSD
        _gen(llm, ref, prompts, i)
    tiers.flush()
    assert _stat(llm, "kv_tier_ssd_blocks") > 0
    _gen(llm, ref, prompts, 0)  # from SSD
    _gen(llm, ref, prompts, 3)  # from host (pushed out of the device by prompt 0)
    assert _stat(llm, "kv_tier_ssd_hits") >= 1
    assert _stat(llm, "kv_tier_host_hits") >= 1
    assert _stat(llm, "kv_tier_load_cut_by_peer") == 0  # both ranks held every block
    names = ["kv_tier_host_blocks", "kv_tier_ssd_hits", "kv_tier_host_hits"]
    ranks = tiers.rank_stats(names)
    # Every rank loaded the same blocks. Which of them came from host and which from SSD may
    # differ: background SSD reads (staging) land in each rank's host tier at its own moment.
    loaded = [r["kv_tier_ssd_hits"] + r["kv_tier_host_hits"] for r in ranks]
    assert len(ranks) == 2 and loaded[0] == loaded[1]
    assert ranks[0]["kv_tier_host_blocks"] == ranks[1]["kv_tier_host_blocks"]
    assert max(r["kv_tier_ssd_hits"] for r in ranks) >= 1 or _stat(
        llm, "kv_tier_staged_blocks") >= 1  # blocks came back from SSD (directly or staged)
    assert_idle(llm)


def test_record_corrupt_on_one_follower_is_recomputed_on_every_rank(llm, ref, prompts, tmp_path):
    tiers = llm.engine.tiers
    for i in range(4, 9):  # prompt 4 ends up wholly on SSD
        _gen(llm, ref, prompts, i)
    tiers.flush()
    blocks = _hashes(llm, prompts[4])[:5]
    assert all(tiers.ssd.has(h, t) and h not in tiers.host for h, t in blocks)
    assert _corrupt_follower_record(tiers.ssd.dir.parent / "rank1", blocks[2][0])
    before = _stat(llm, "kv_tier_load_cut_by_peer")
    _gen(llm, ref, prompts, 4)  # rank 0 loads 5 blocks, rank 1 only 2: 3 recomputed on both
    assert _stat(llm, "kv_tier_load_cut_by_peer") - before == 3
    assert tiers.rank_stats(["kv_tier_ssd_corrupted"])[1]["kv_tier_ssd_corrupted"] == 1
    assert_idle(llm)


def _corrupt_follower_record(rank_dir, h: bytes) -> bool:
    """Flip the crc of the record holding `h` in a follower's segment files."""
    for seg in sorted(rank_dir.glob("seg-*.pdkv")):
        raw = bytearray(seg.read_bytes())
        at = raw.find(h)
        if at >= 8 and raw[at - 8:at - 4] == b"PDKV":
            raw[at + 16] ^= 0xFF  # the crc32 field follows the 16-byte hash
            seg.write_bytes(bytes(raw))
            return True
    return False


def test_demotion_ahead_is_mirrored_and_eviction_copies_nothing(llm, ref, prompts):
    engine, pool, tiers = llm.engine, llm.engine.pool, llm.engine.tiers
    _gen(llm, ref, prompts, 9)
    while engine.idle_tick():
        pass
    ahead = pool.eviction_candidates(2)
    assert len(ahead) == 2
    for b in ahead:  # in host, and still on the device
        assert tiers.host.has(b.block_hash, b.token_ids)
        assert pool.lookup(b.block_hash, b.token_ids) == b.block_id
    names = ["kv_tier_demoted_ahead", "kv_tier_demote_copies", "kv_tier_demote_found_in_host"]
    before = tiers.rank_stats(names)
    assert before[0]["kv_tier_demoted_ahead"] == before[1]["kv_tier_demoted_ahead"]
    for i in (10, 11):  # evicts prompt 9's blocks
        _gen(llm, ref, prompts, i)
    assert all(pool.lookup(b.block_hash, b.token_ids) is None for b in ahead)
    after = tiers.rank_stats(names)
    # The follower copied ahead exactly what rank 0 did and demoted the same blocks; whether a
    # demoted block was still in its host tier may differ (staged SSD reads land per rank).
    assert after[0]["kv_tier_demoted_ahead"] == after[1]["kv_tier_demoted_ahead"]
    demoted = [r["kv_tier_demote_copies"] + r["kv_tier_demote_found_in_host"] for r in after]
    assert demoted[0] == demoted[1]
    for rank, was in zip(after, before, strict=True):
        copies = rank["kv_tier_demote_copies"] - was["kv_tier_demote_copies"]
        found = rank["kv_tier_demote_found_in_host"] - was["kv_tier_demote_found_in_host"]
        assert found >= 2  # the blocks copied ahead cost no copy at eviction
        assert copies + found >= 6  # every cached block of prompt 9 was demoted
    _gen(llm, ref, prompts, 9)
    assert_idle(llm)

