"""Latency metrics, percentiles, SLOs and goodput on synthetic timings."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.loadgen.metrics import (
    Slo,
    SloMetric,
    distribution_ms,
    itl_samples,
    parse_slos,
    percentile,
    request_metrics,
    summarize,
)
from pdserve.loadgen.records import Arrival, RequestResult


def result(send, arrivals, kind="random", prompt_len=10, output_tokens=None, error=None,
           cached=None, detail=None):
    arr = tuple(Arrival(t, n) for t, n in arrivals)
    out = sum(n for _, n in arrivals) if output_tokens is None else output_tokens
    end = arr[-1].time if arr else send
    return RequestResult(kind, prompt_len, send, end, arr, out, cached, error, detail)


def test_ttft_e2e_tpot_and_itl_of_one_request():
    r = result(10.0, [(10.5, 1), (10.6, 1), (10.8, 1), (11.1, 1)])
    m = request_metrics(r)
    assert m.ttft == pytest.approx(0.5)
    assert m.e2e == pytest.approx(1.1)
    assert m.tpot == pytest.approx(0.6 / 3)
    assert m.itl == pytest.approx((0.1, 0.2, 0.3))
    assert sum(m.itl) == pytest.approx(m.e2e - m.ttft)


def test_a_chunk_of_several_tokens_spreads_its_gap_over_them():
    # first chunk: 2 tokens (the second adds no ITL sample); then 3 tokens after 0.3 s
    assert itl_samples([Arrival(1.0, 2), Arrival(1.3, 3), Arrival(1.4, 1)]) == pytest.approx(
        [0.1, 0.1, 0.1, 0.1])
    m = request_metrics(result(0.0, [(1.0, 2), (1.3, 3), (1.4, 1)]))
    assert m.tpot == pytest.approx(0.4 / 5)  # per output token after the first


def test_one_token_output_has_no_tpot_and_cannot_miss_a_tpot_slo():
    m = request_metrics(result(0.0, [(0.2, 1)]))
    assert m.tpot is None and m.itl == ()
    assert Slo(SloMetric.TPOT, 1.0).met(m)
    assert not Slo(SloMetric.TTFT, 100.0).met(m)


def test_failed_or_empty_requests_have_no_metrics():
    assert request_metrics(result(0.0, [(0.1, 1)], error="UNAVAILABLE")) is None
    assert request_metrics(result(0.0, [])) is None


@pytest.mark.parametrize("q", [0, 1, 37.5, 50, 90, 99, 100])
def test_percentile_interpolates_like_numpy(q):
    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6, 5.0]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_refuses_nothing_and_out_of_range_q():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError, match="q"):
        percentile([1.0], 101)


def test_distribution_is_in_milliseconds_and_empty_without_samples():
    d = distribution_ms([0.1, 0.2, 0.3, 0.4])
    assert (d.count, d.mean, d.p50) == (4, pytest.approx(250.0), pytest.approx(250.0))
    assert d.p99 == pytest.approx(float(np.percentile([100, 200, 300, 400], 99)))
    assert distribution_ms([]).mean is None


def test_summary_throughput_goodput_and_errors():
    results = [
        result(0.0, [(0.1, 1), (0.2, 1), (0.3, 1)], prompt_len=5, cached=2),  # ttft 100, tpot 100
        result(0.0, [(0.5, 1), (0.6, 1), (0.7, 1)], prompt_len=7),  # ttft 500: misses TTFT
        result(1.0, [(1.1, 1), (1.5, 1), (1.9, 1)], prompt_len=9),  # tpot 400: misses TPOT
        result(1.0, [(1.2, 1), (1.3, 1), (1.4, 1)], prompt_len=4),  # meets both
        result(2.0, [], error="RESOURCE_EXHAUSTED", detail="router is full"),
        result(2.0, [], error="RESOURCE_EXHAUSTED", detail="still full"),
        result(2.0, [(2.1, 1)], error="DEADLINE_EXCEEDED"),
    ]
    slos = parse_slos(["ttft:300", "tpot:200"])
    s = summarize(results, duration_s=4.0, slos=slos)
    assert (s.completed, s.failed) == (4, 3)
    assert s.errors == {"DEADLINE_EXCEEDED": 1, "RESOURCE_EXHAUSTED": 2}
    assert s.error_examples == {"DEADLINE_EXCEEDED": "", "RESOURCE_EXHAUSTED": "router is full"}
    assert (s.input_tokens, s.output_tokens, s.cached_tokens) == (25, 12, 2)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(3.0)
    assert s.goodput == pytest.approx(2 / 4.0)
    assert s.slo_attainment == pytest.approx(2 / 7)
    assert s.ttft_ms.count == 4 and s.ttft_ms.p50 == pytest.approx(150.0)
    assert s.itl_ms.count == 8
    assert summarize(results, 4.0).goodput is None


def test_parse_slos_reads_metric_and_milliseconds():
    assert parse_slos(["TTFT:250", "e2e:1500.5"]) == (
        Slo(SloMetric.TTFT, 250.0), Slo(SloMetric.E2E, 1500.5))


@pytest.mark.parametrize("items", [["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:x"],
                                   ["tpot:5", "tpot:6"], ["ttft:inf"]])
def test_bad_slos_are_refused_naming_goodput(items):
    with pytest.raises(ValueError, match="goodput"):
        parse_slos(items)


def test_summary_needs_a_positive_duration():
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], 0.0)
