"""Benchmark datasets: deterministic for a seed, lengths in range, shared prefixes, validation."""

from __future__ import annotations

import pytest

from pdserve.loadgen.datasets import (
    MixedSpec,
    PrefixSpec,
    RandomSpec,
    build_workload,
)


def test_same_seed_same_workload_and_another_seed_another():
    spec = RandomSpec(num_prompts=20, input_len=50, output_len=10, range_ratio=0.5)
    assert build_workload(spec, 3) == build_workload(spec, 3)
    assert build_workload(spec, 3).requests != build_workload(spec, 4).requests


def test_random_lengths_stay_in_range_and_ids_in_the_vocabulary():
    spec = RandomSpec(num_prompts=300, input_len=100, output_len=20, range_ratio=0.25,
                      vocab_size=97)
    reqs = build_workload(spec, 0).requests
    assert len(reqs) == 300
    ins = [len(r.prompt) for r in reqs]
    outs = [r.output_len for r in reqs]
    assert 75 <= min(ins) and max(ins) <= 125
    assert 15 <= min(outs) and max(outs) <= 25
    assert len(set(ins)) > 20  # lengths actually vary
    ids = {t for r in reqs for t in r.prompt}
    assert min(ids) >= 0 and max(ids) < 97 and len(ids) > 90  # spread over the vocabulary
    assert {r.kind for r in reqs} == {"random"}


def test_zero_range_ratio_gives_exact_lengths():
    reqs = build_workload(RandomSpec(num_prompts=5, input_len=33, output_len=7), 1).requests
    assert {len(r.prompt) for r in reqs} == {33} and {r.output_len for r in reqs} == {7}


def test_prefix_conversations_share_system_prompts_and_resend_earlier_turns():
    spec = PrefixSpec(num_prompts=12, num_prefixes=2, prefix_len=40, turns=3, input_len=10,
                      output_len=5, vocab_size=1000)
    reqs = build_workload(spec, 7).requests
    assert len(reqs) == 12
    # Sent turn by turn (4 conversations: first turns, then second turns, then third), each
    # round in its own order: find each conversation's later turns by their prefix.
    assert len({r.prompt[:40] for r in reqs}) <= 2  # 4 conversations share 2 system prompts

    def next_turn(prev, round_):
        (turn,) = [r for r in reqs[4 * round_:4 * round_ + 4]
                   if r.prompt[:len(prev.prompt)] == prev.prompt]
        return turn

    for t1 in reqs[:4]:
        t2 = next_turn(t1, 1)
        t3 = next_turn(t2, 2)
        assert t2.prompt[:len(t1.prompt)] == t1.prompt
        assert t3.prompt[:len(t2.prompt)] == t2.prompt
        # each turn adds the previous answer (output_len tokens) and a new message
        assert len(t2.prompt) == len(t1.prompt) + t1.output_len + 10
    assert len({r.prompt[:50] for r in reqs[:4]}) == 4  # distinct first user messages


def test_prefix_count_need_not_fill_the_last_round_of_turns():
    spec = PrefixSpec(num_prompts=7, turns=3, prefix_len=8, input_len=4, output_len=2)
    assert len(build_workload(spec, 0).requests) == 7


def test_mixed_has_long_prompts_in_the_stream_and_a_steady_short_population():
    spec = MixedSpec(num_prompts=6, input_len=400, output_len=4, range_ratio=0.2,
                     short_input_len=16, short_output_len=64, short_concurrency=3)
    w = build_workload(spec, 5)
    assert [r.kind for r in w.requests] == ["long"] * 6
    assert all(320 <= len(r.prompt) <= 480 for r in w.requests)
    assert w.steady is not None and w.steady.concurrency == 3
    a, b = w.steady.request(0), w.steady.request(1)
    assert (len(a.prompt), a.output_len, a.kind) == (16, 64, "short")
    assert a == w.steady.request(0) and a != b  # deterministic per index
    assert build_workload(MixedSpec(num_prompts=2, short_concurrency=0), 0).steady is None


@pytest.mark.parametrize("spec, field", [
    (RandomSpec(num_prompts=0), "num_prompts"),
    (RandomSpec(num_prompts=3, input_len=-1), "input_len"),
    (RandomSpec(num_prompts=3, range_ratio=1.0), "range_ratio"),
    (PrefixSpec(num_prompts=3, turns=0), "turns"),
    (MixedSpec(num_prompts=3, short_concurrency=-2), "short_concurrency"),
])
def test_invalid_specs_name_the_field(spec, field):
    with pytest.raises(ValueError, match=field):
        build_workload(spec, 0)
