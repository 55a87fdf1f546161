"""Sampler: greedy is exact argmax, masks and penalties match hand-computed cases, seeded draws
depend only on (seed, step) and the row's own distribution, and draws follow the distribution."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.sampler import Sampler, SamplingRow, derive_seed, greedy_tokens
from pdserve.engine.sampling_params import SamplingParams

P4 = [0.5, 0.3, 0.15, 0.05]
LOG_P4 = torch.tensor(P4).log()


def row(params: SamplingParams | None = None, *, prompt=(), out=(), seed=0, step=None,
        eos=frozenset()) -> SamplingRow:
    params = params or SamplingParams()
    return SamplingRow(params, list(prompt), list(out), seed,
                       len(out) if step is None else step, frozenset(eos))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def probs_of(params: SamplingParams, logits=LOG_P4, **row_kw) -> torch.Tensor:
    return Sampler().probs(torch.as_tensor(logits).reshape(1, -1), [row(params, **row_kw)])[0]


def assert_probs(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32),
                               atol=1e-6, rtol=1e-5)


# -- greedy ----------------------------------------------------------------------------------


def test_greedy_tokens_are_argmax_on_ties_nan_and_inf():
    # Integer logits tie everywhere; NaN wins as in argmax; infinities and a masked row.
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 32, 33):
        x = torch.randint(-3, 4, (n, 4099), generator=g).float()
        x[0, 700] = x[0, 20] = float("nan")
        x[-1] = float("-inf")
        x[n // 2, 5] = x[n // 2, 9] = float("inf")
        assert torch.equal(greedy_tokens(x), x.argmax(dim=-1))


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(8, 100, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, [row(greedy()) for _ in range(8)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 8


@pytest.mark.parametrize("other", [greedy(), SamplingParams(temperature=0.9),
                                   greedy(presence_penalty=0.5)])
def test_greedy_ties_go_to_the_lowest_id(other):
    logits = torch.tensor([[0.0, 5.0, 5.0, 1.0], [1.0, 0.0, 2.0, 3.0]])
    out = Sampler()(logits, [row(greedy()), row(other)])
    assert out.token_ids[0] == 1


def test_greedy_is_exact_argmax_in_a_batch_with_sampled_rows():
    logits = torch.randn(16, 500, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    params = [greedy() if i % 2 else SamplingParams(temperature=1.3, top_p=0.8) for i in range(16)]
    out = Sampler()(logits, [row(p, seed=i) for i, p in enumerate(params)])
    expected = logits.float().argmax(-1).tolist()
    assert [t for i, t in enumerate(out.token_ids) if i % 2] == expected[1::2]


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=5.0, top_k=1)
    out = Sampler()(logits, [row(params, seed=s) for s in range(4)])
    assert out.token_ids == logits.argmax(-1).tolist()


# -- penalties -------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = [2.0, 1.8, -1.0, -1.2, 0.0]
    p = greedy(repetition_penalty=1.5)
    # Token 0 is in the prompt, token 2 in the output: 2/1.5 and -1*1.5.
    expected = torch.tensor([2.0 / 1.5, 1.8, -1.5, -1.2, 0.0]).softmax(-1)
    assert_probs(probs_of(p, logits, prompt=[0, 0], out=[2]), expected)
    out = Sampler()(torch.tensor([logits]), [row(p, prompt=[0], out=[2])])
    assert out.token_ids == [1]


def test_repetition_penalty_of_negative_logit_changes_argmax():
    logits = torch.tensor([[-1.0, -1.2, -5.0]])
    assert Sampler()(logits, [row(greedy(repetition_penalty=1.5), out=[0])]).token_ids == [1]
    assert Sampler()(logits, [row(greedy(), out=[0])]).token_ids == [0]


def test_frequency_penalty_counts_occurrences_and_presence_counts_once():
    logits = torch.tensor([[1.0, 0.5]])
    freq = greedy(frequency_penalty=0.2)
    assert Sampler()(logits, [row(freq, out=[0])]).token_ids == [0]  # 0.8 > 0.5
    assert Sampler()(logits, [row(freq, out=[0, 0, 0])]).token_ids == [1]  # 0.4 < 0.5
    pres = greedy(presence_penalty=0.3)
    assert Sampler()(logits, [row(pres, out=[0, 0, 0])]).token_ids == [0]  # 0.7 > 0.5
    assert_probs(probs_of(pres, [1.0, 0.5], out=[0, 0, 0]), torch.tensor([0.7, 0.5]).softmax(-1))
    both = greedy(presence_penalty=0.3, frequency_penalty=-0.1)
    assert_probs(probs_of(both, [1.0, 0.5], out=[1, 1]), torch.tensor([1.0, 0.4]).softmax(-1))


def test_presence_and_frequency_ignore_prompt_tokens():
    p = greedy(presence_penalty=2.0, frequency_penalty=2.0)
    assert Sampler()(torch.tensor([[1.0, 0.5]]), [row(p, prompt=[0, 0])]).token_ids == [0]


def test_penalties_apply_per_row_and_leave_the_input_untouched():
    logits = torch.tensor([[1.0, 0.9], [1.0, 0.9]])
    before = logits.clone()
    rows = [row(greedy(repetition_penalty=2.0), prompt=torch.tensor([0])), row(greedy(), out=[0])]
    assert Sampler()(logits, rows).token_ids == [1, 0]
    assert torch.equal(logits, before)


def test_out_of_range_token_in_history_is_an_error():
    with pytest.raises(ValueError, match="token ids"):
        Sampler()(torch.zeros(1, 4), [row(greedy(repetition_penalty=1.1), prompt=[4])])


# -- min_tokens ------------------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])  # 3 is EOS, 2 a stop token
    p = greedy(min_tokens=2, stop_token_ids=[2])
    sample = lambda step: Sampler()(logits, [row(p, step=step, eos={3})]).token_ids[0]
    assert sample(0) == 1
    assert sample(1) == 1
    assert sample(2) == 3
    sampled = SamplingParams(min_tokens=1, stop_token_ids=[2])
    assert probs_of(sampled, logits, step=0, eos={3})[2:].tolist() == [0.0, 0.0]


def test_allowed_token_ids_leave_only_those_tokens():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])
    p = greedy(allowed_token_ids=[0, 1])
    assert Sampler()(logits, [row(p)]).token_ids == [1]
    # Raw logprobs are reported as the model gave them (vLLM's default), the mask is not.
    lp = Sampler()(logits, [row(greedy(allowed_token_ids=[0, 1], logprobs=0))]).logprobs[0]
    assert lp.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())
    assert probs_of(SamplingParams(allowed_token_ids=[2, 3]), LOG_P4)[:2].tolist() == [0, 0]


def test_bad_words_ban_a_sequences_last_token_after_the_rest():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])
    p = greedy(bad_words_token_ids=[[3], [1, 2]])
    sample = lambda out: Sampler()(logits, [row(p, out=out)]).token_ids[0]
    assert sample([]) == 2  # 3 is banned everywhere
    assert sample([0, 1]) == 1  # after 1, the word [1, 2] may not end: 2 is banned too
    assert sample([1, 0]) == 2


def test_ignore_eos_does_not_ban_eos_under_min_tokens():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])
    p = greedy(min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    assert Sampler()(logits, [row(p, step=0, eos={3})]).token_ids == [3]
    p = greedy(min_tokens=2, stop_token_ids=[3], ignore_eos=True)  # a stop id is still banned
    assert Sampler()(logits, [row(p, step=0, eos={3})]).token_ids == [2]


# -- temperature and truncation on hand-built distributions ----------------------------------


@pytest.mark.parametrize(("kwargs", "expected"), [
    ({}, P4),
    ({"top_k": 2}, [0.625, 0.375, 0.0, 0.0]),
    ({"top_k": 3}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    ({"top_p": 0.45}, [1.0, 0.0, 0.0, 0.0]),
    ({"top_p": 0.7}, [0.625, 0.375, 0.0, 0.0]),
    ({"top_p": 0.9}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    ({"top_p": 0.97}, P4),
    # top-p acts on what top-k left: after top-k=3 the first two hold 0.842 >= 0.82.
    ({"top_k": 3, "top_p": 0.82}, [0.625, 0.375, 0.0, 0.0]),
    ({"top_p": 0.82}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    ({"min_p": 0.2}, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    ({"min_p": 0.5}, [0.625, 0.375, 0.0, 0.0]),
    ({"min_p": 1.0}, [1.0, 0.0, 0.0, 0.0]),
])
def test_truncation_masks(kwargs, expected):
    assert_probs(probs_of(SamplingParams(**kwargs)), expected)


def test_temperature_sharpens_and_flattens():
    sharp = torch.tensor(P4) ** 2
    assert_probs(probs_of(SamplingParams(temperature=0.5)), sharp / sharp.sum())
    flat = torch.tensor(P4) ** 0.5
    assert_probs(probs_of(SamplingParams(temperature=2.0)), flat / flat.sum())


def test_min_p_is_relative_to_the_tempered_distribution():
    # At temperature 0.5 probs are [.69, .25, .06, .007]: min_p 0.1 drops the last two.
    kept = torch.tensor(P4[:2]) ** 2
    expected = torch.cat([kept / kept.sum(), torch.zeros(2)])
    assert_probs(probs_of(SamplingParams(temperature=0.5, min_p=0.1)), expected)


def test_top_k_keeps_tokens_tied_with_the_last_kept():
    probs = probs_of(SamplingParams(top_k=2), [3.0, 2.0, 2.0, 1.0])
    assert (probs > 0).tolist() == [True, True, True, False]


def test_greedy_rows_get_the_plain_softmax_from_probs():
    assert_probs(probs_of(greedy(top_p=0.1, min_p=0.9)), P4)


def reference_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Full-sort top-p, written independently: True where a token is kept."""
    values = logits.sort(descending=True).values
    probs = values.double().softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    keep = int((mass_before < p).sum())
    return logits >= values[keep - 1]


@pytest.mark.parametrize("scale", [0.3, 8.0])  # flat: nucleus past the candidates; peaked
def test_top_p_matches_a_full_sort_on_a_large_vocabulary(scale):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5000, generator=gen) * scale
    params = SamplingParams(top_p=0.9)
    probs = Sampler().probs(logits, [row(params) for _ in range(6)])
    for i in range(6):
        expected = reference_top_p(logits[i], 0.9)
        assert torch.equal(probs[i] > 0, expected)
    if scale < 1:
        assert int((probs[0] > 0).sum()) > 1024  # the full-sort fallback really ran


# -- seeded determinism ----------------------------------------------------------------------


MIXED = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.2, top_k=40, min_p=0.01),
    SamplingParams(temperature=0.9, repetition_penalty=1.3, presence_penalty=0.4),
    greedy(),
    SamplingParams(temperature=1.5, frequency_penalty=0.7, logprobs=3),
]


def mixed_rows(offset: int = 0) -> list[SamplingRow]:
    return [row(p, prompt=[1, 2, 3], out=[4, 5, 5], seed=100 + i + offset, step=7)
            for i, p in enumerate(MIXED)]


def test_draw_depends_only_on_seed_step_and_own_distribution():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(len(MIXED), 300, generator=gen)
    alone = [Sampler()(logits[i:i + 1], [r]).token_ids[0] for i, r in enumerate(mixed_rows())]
    together = Sampler()(logits, mixed_rows()).token_ids
    assert together == alone
    # Reversed, and padded with unrelated rows.
    extra = torch.randn(3, 300, generator=gen)
    shuffled_logits = torch.cat([extra[:2], logits.flip(0), extra[2:]])
    shuffled_rows = (mixed_rows(offset=50)[:2] + mixed_rows()[::-1] + mixed_rows(offset=60)[:1])
    shuffled = Sampler()(shuffled_logits, shuffled_rows).token_ids
    assert shuffled[2:-1] == together[::-1]


def test_draw_ignores_global_rng_state():
    logits = torch.randn(len(MIXED), 300, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    first = Sampler()(logits, mixed_rows()).token_ids
    torch.manual_seed(12345)
    torch.rand(1000)
    assert Sampler()(logits, mixed_rows()).token_ids == first


def test_steps_and_seeds_give_different_draws():
    logits = torch.zeros(1, 1000)
    p = SamplingParams()
    by_step = {Sampler()(logits, [row(p, seed=9, step=s)]).token_ids[0] for s in range(20)}
    by_seed = {Sampler()(logits, [row(p, seed=s, step=0)]).token_ids[0] for s in range(20)}
    assert len(by_step) > 10 and len(by_seed) > 10


def test_derive_seed_is_pinned():
    # The mix fixes every seeded output: changing it changes what users reproduce.
    assert derive_seed(0, 0) == derive_seed(0, 0, 0)
    assert derive_seed(1234, 5) == 3696761653075492945
    assert derive_seed(1234, 5) != derive_seed(1234, 6) != derive_seed(1235, 5)
    assert derive_seed(1234, 5, stream=1) != derive_seed(1234, 5)
    assert 0 <= derive_seed(2**64 - 1, 2**64 - 1) < 2**63
    with pytest.raises(ValueError, match="stream"):
        derive_seed(1, 1, stream=-1)


def test_draw_equals_a_plain_inverse_cdf_with_the_rows_uniform():
    gen = torch.Generator().manual_seed(6)
    probs = torch.rand(1, 1000, generator=gen) ** 4
    probs[:, ::7] = 0.0  # zero-mass tokens, including whole runs inside blocks
    probs[:, 300:600] = 0.0
    cdf = probs[0].double().cumsum(0)
    rows = [row(seed=s, step=3) for s in range(300)]
    drawn = Sampler().sample_from_probs(probs.expand(300, -1), rows)
    for r, token in zip(rows, drawn, strict=True):
        u = torch.rand((), dtype=torch.float64,
                       generator=torch.Generator().manual_seed(derive_seed(r.seed, r.step)))
        assert token == int(torch.searchsorted(cdf, u * cdf[-1], right=True))
        assert probs[0, token] > 0


# -- draws follow the distribution -----------------------------------------------------------


def chi_square(counts: list[int], expected_probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, expected_probs, strict=True)
               if q > 0)


@pytest.mark.parametrize(("params", "expected"), [
    (SamplingParams(seed=7), P4),
    (SamplingParams(temperature=0.5, seed=7), [p * p / 0.365 for p in P4]),
    (SamplingParams(top_p=0.9, seed=7), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    (SamplingParams(temperature=2.0, top_k=3, seed=7),
     [math.sqrt(p) / sum(math.sqrt(q) for q in P4[:3]) for p in P4[:3]] + [0.0]),
])
def test_draws_follow_the_distribution(params, expected):
    n = 4000
    rows = [row(params, seed=7, step=s) for s in range(n)]
    tokens = Sampler()(LOG_P4.expand(n, -1), rows).token_ids
    counts = [tokens.count(t) for t in range(4)]
    for t, q in enumerate(expected):
        if q == 0:
            assert counts[t] == 0
    # df <= 3; P(chi2 > 30) < 1e-5: generous, yet a biased sampler fails by far.
    assert chi_square(counts, expected) < 30.0


def test_sample_from_probs_accepts_unnormalised_mass():
    n = 4000
    probs = torch.tensor([[0.0, 2.0, 0.0, 6.0]]).expand(n, -1)
    tokens = Sampler().sample_from_probs(probs, [row(seed=3, step=s) for s in range(n)])
    counts = [tokens.count(t) for t in range(4)]
    assert counts[0] == counts[2] == 0
    assert chi_square(counts, [0.0, 0.25, 0.0, 0.75]) < 30.0


def test_sample_from_probs_rejects_rows_without_mass():
    with pytest.raises(ValueError, match="no finite mass"):
        Sampler().sample_from_probs(torch.zeros(2, 4).index_fill_(1, torch.tensor([0]), 1.0)
                                    .index_fill_(0, torch.tensor([1]), 0.0), [row(), row()])
    with pytest.raises(ValueError, match="non-negative"):
        Sampler().sample_from_probs(torch.tensor([[0.5, -0.1, 0.6]]), [row()])


# -- logprobs --------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_raw_logits():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(3, 64, generator=gen)
    rows = [row(SamplingParams(temperature=0.5, repetition_penalty=1.5, logprobs=4),
                prompt=list(range(10)), seed=1),
            row(greedy(logprobs=0)),
            row(SamplingParams())]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, -1)
    for i in range(2):
        lp = out.logprobs[i]
        assert lp.token_id == out.token_ids[i]
        assert lp.logprob == pytest.approx(float(ref[i, lp.token_id]), abs=1e-5)
    top = out.logprobs[0].top
    values, ids = ref[0].topk(4)
    assert [t for t, _ in top] == ids.tolist()
    assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-5)
    assert out.logprobs[1].top == ()
    assert out.logprobs[2] is None


def test_logprobs_on_the_greedy_fast_path_and_half_precision():
    logits = torch.randn(2, 32, generator=torch.Generator().manual_seed(9)).half()
    out = Sampler()(logits, [row(greedy(logprobs=2)), row(greedy())])
    ref = torch.log_softmax(logits.float(), -1)
    assert out.logprobs[0].logprob == pytest.approx(float(ref[0].max()), abs=1e-5)
    assert out.logprobs[0].top[0][0] == out.token_ids[0]
    assert out.logprobs[1] is None


# -- batch checks and scale ------------------------------------------------------------------


def test_batch_shape_is_checked():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, 4), [row()])
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        Sampler()(torch.zeros(4), [row()])
    with pytest.raises(ValueError, match="step"):
        row(step=-1)
    with pytest.raises(ValueError, match="seed"):
        row(seed=-5)


def test_empty_batch_gives_empty_output():
    out = Sampler()(torch.zeros(0, 8), [])
    assert out.token_ids == [] and out.logprobs == []
    assert Sampler().probs(torch.zeros(0, 8), []).shape == (0, 8)
    assert Sampler().sample_from_probs(torch.zeros(0, 8), []) == []


def test_full_size_batch_with_every_feature():
    n, vocab = 256, 32000
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(10)) * 3
    kinds = MIXED + [SamplingParams(top_p=0.95, top_k=100, min_p=0.05, logprobs=5)]
    rows = [row(kinds[i % len(kinds)], prompt=range(i, i + 300), out=range(i, i + 40),
                seed=i, eos={2}) for i in range(n)]
    out = Sampler()(logits, rows)
    assert len(out.token_ids) == n and all(0 <= t < vocab for t in out.token_ids)
    greedy_rows = [i for i, r in enumerate(rows) if r.params.is_greedy]
    assert [out.token_ids[i] for i in greedy_rows] == logits[greedy_rows].argmax(-1).tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_match_cpu_draws():
    logits = torch.randn(len(MIXED), 300, generator=torch.Generator().manual_seed(11)) * 2
    cpu = Sampler()(logits, mixed_rows()).token_ids
    assert Sampler()(logits.cuda(), mixed_rows()).token_ids == cpu


# -- grammar bitmask, logit_bias, choice seeds -----------------------------------------------


def test_bitmask_keeps_only_allowed_tokens_on_its_rows():
    from pdserve.engine.sampler import apply_token_bitmask

    logits = torch.zeros(3, 40)
    mask = torch.zeros(1, 2, dtype=torch.int32)
    mask[0, 0] = (1 << 3) | -(1 << 31)  # bit 31 is the int32 sign bit
    mask[0, 1] = 1 << 2  # token 34
    apply_token_bitmask(logits, mask, [1])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [3, 31, 34]
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()


def test_logit_bias_is_added_and_breaks_the_greedy_fast_path():
    out = Sampler()(LOG_P4.reshape(1, -1), [row(greedy(logit_bias={3: 10.0}))])
    assert out.token_ids == [3]
    assert_probs(probs_of(SamplingParams(logit_bias={0: -100, 1: -100, 2: -100})),
                 [0, 0, 0, 1])


def test_min_tokens_never_empties_a_row():
    """A grammar that allows only EOS, while min_tokens bans it: EOS stays (no crash)."""
    logits = torch.tensor([[float("-inf"), float("-inf"), 0.0, float("-inf")]])
    out = Sampler()(logits, [row(SamplingParams(min_tokens=5, temperature=0.9), eos={2})])
    assert out.token_ids == [2]


def test_choice_seeds_keep_choice_zero_and_differ_otherwise():
    from pdserve.engine.sampler import choice_seed

    assert choice_seed(1234, 0) == 1234
    seeds = {choice_seed(1234, i) for i in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert choice_seed(1234, 3) == choice_seed(1234, 3)
