"""The block hash is chained, deterministic and byte-stable."""

from __future__ import annotations

from pdserve.block_hash import ROOT_HASH, block_hash, chain_hashes, hash_extra


def test_hash_is_stable_across_runs():
    # A fixed value: any change to the encoding breaks cross-process agreement.
    h = block_hash(ROOT_HASH, [1, 2, 3, 4], b"")
    assert h.hex() == "f23680cf9d0cdff61c7fe464c491f63b"
    assert len(h) == 16


def test_chain_depends_on_parent_and_extra():
    a = chain_hashes([1, 2, 3, 4, 5, 6], 2)
    b = chain_hashes([9, 9, 3, 4, 5, 6], 2)
    assert len(a) == 3 and a[1] != b[1]  # same block tokens, different prefix
    extra = hash_extra("m", "float32", 2)
    assert chain_hashes([1, 2], 2, extra) != chain_hashes([1, 2], 2)


def test_partial_block_is_not_hashed_and_chain_resumes():
    full = chain_hashes(list(range(10)), 4)
    assert len(full) == 2
    resumed = chain_hashes(list(range(10)), 4, parent=full[0], start_block=1)
    assert resumed == full[1:]
