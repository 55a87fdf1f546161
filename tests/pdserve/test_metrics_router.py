"""Router request metrics: what one request's trace observes, by how it ends."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from prometheus_client import generate_latest

from pdserve.observability.router_metrics import RouterMetrics, status_of


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def value(m: RouterMetrics, name: str, **labels) -> float:
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_ok_request_observes_ttft_itl_tpot_e2e_and_tokens():
    m, clock = RouterMetrics(), Clock()
    t = m.trace("r1-abc", 7, logging.getLogger("t"), clock)
    assert value(m, "pdserve_requests_inflight") == 1
    clock.now += 0.5
    t.on_tokens(1)   # first token after 0.5 s
    clock.now += 0.1
    t.on_tokens(3)   # a spec-decoding chunk
    clock.now += 0.2
    t.on_tokens(1)
    t.finish("OK", cached_tokens=4)
    assert value(m, "pdserve_request_ttft_seconds_count") == 1
    assert value(m, "pdserve_request_ttft_seconds_sum") == pytest.approx(0.5)
    assert value(m, "pdserve_request_itl_seconds_count") == 2
    assert value(m, "pdserve_request_itl_seconds_sum") == pytest.approx(0.3)
    # 5 tokens, 0.3 s from the first to the last: 0.3 / 4 per token after the first.
    assert value(m, "pdserve_request_tpot_seconds_sum") == pytest.approx(0.075)
    assert value(m, "pdserve_request_e2e_seconds_sum") == pytest.approx(0.8)
    assert value(m, "pdserve_requests_total", status="OK") == 1
    assert value(m, "pdserve_prompt_tokens_total") == 7
    assert value(m, "pdserve_generation_tokens_total") == 5
    assert value(m, "pdserve_cached_prompt_tokens_total") == 4
    assert value(m, "pdserve_requests_inflight") == 0


def test_failed_request_is_counted_by_status_without_e2e():
    m, clock = RouterMetrics(), Clock()
    t = m.trace("r2", 3, logging.getLogger("t"), clock)
    clock.now += 1.0
    t.finish("UNAVAILABLE")
    t.finish("OK")  # a later finish (e.g. the generator closing) changes nothing
    assert value(m, "pdserve_requests_total", status="UNAVAILABLE") == 1
    assert value(m, "pdserve_requests_total", status="OK") == 0
    assert value(m, "pdserve_request_e2e_seconds_count") == 0
    assert value(m, "pdserve_request_ttft_seconds_count") == 0
    assert value(m, "pdserve_requests_inflight") == 0


def test_single_token_request_has_no_tpot():
    m, clock = RouterMetrics(), Clock()
    t = m.trace("r3", 3, logging.getLogger("t"), clock)
    clock.now += 0.2
    t.on_tokens(1)
    t.finish("OK")
    assert value(m, "pdserve_request_tpot_seconds_count") == 0
    assert value(m, "pdserve_request_itl_seconds_count") == 0
    assert value(m, "pdserve_request_e2e_seconds_count") == 1


def test_registries_are_independent_and_expose_ok_before_any_request():
    a, b = RouterMetrics(), RouterMetrics()
    a.trace("x", 1, logging.getLogger("t")).finish("OK")
    assert value(b, "pdserve_requests_total", status="OK") == 0
    text = generate_latest(b.registry).decode()
    assert 'pdserve_requests_total{status="OK"} 0.0' in text
    assert "pdserve_request_ttft_seconds_bucket" in text


def test_trace_logs_start_and_finish_with_the_request_id(caplog):
    m, clock = RouterMetrics(), Clock()
    with caplog.at_level(logging.INFO, logger="t"):
        t = m.trace("client-7-abc", 2, logging.getLogger("t"), clock)
        clock.now += 0.25
        t.on_tokens(2)
        t.finish("OK")
    events = [(r.event, r.request_id) for r in caplog.records]
    assert events == [("request_start", "client-7-abc"), ("request_finish", "client-7-abc")]
    done = caplog.records[-1]
    assert (done.status, done.tokens, done.ttft_s) == ("OK", 2, 0.25)


class _Flow(Exception):
    def __init__(self, code):
        super().__init__("x")
        self.code = code


def test_status_of_maps_exceptions_to_grpc_status_names():
    assert status_of(_Flow(grpc.StatusCode.DEADLINE_EXCEEDED)) == "DEADLINE_EXCEEDED"
    assert status_of(asyncio.CancelledError()) == "CANCELLED"
    assert status_of(GeneratorExit()) == "CANCELLED"
    assert status_of(RuntimeError("bug")) == "UNKNOWN"


def test_flow_counters_are_read_at_scrape_time():
    m, counters = RouterMetrics(), {"prefetch_hints": 0, "kv_pulls_routed": 0}
    m.export_flow_counters(lambda: counters)
    assert value(m, "pdserve_router_prefetch_hints_total") == 0
    counters["prefetch_hints"] += 3
    counters["kv_pulls_routed"] += 1
    assert value(m, "pdserve_router_prefetch_hints_total") == 3
    assert value(m, "pdserve_router_kv_pulls_routed_total") == 1
    assert value(m, "pdserve_router_prefetch_hint_failures_total") == 0  # key absent: 0
    assert "pdserve_router_prefetch_hints_total 3.0" in generate_latest(m.registry).decode()
