"""Worker metrics: the collector over a snapshot, the `/metrics` server, and the interceptor
that logs and counts request RPCs (against a real grpc.aio server on loopback)."""

from __future__ import annotations

import asyncio
import logging
import urllib.request

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from pdserve.observability.telemetry import WorkerTelemetry
from pdserve.observability.worker_metrics import WorkerCollector, WorkerSnapshot
from pdserve.proto import worker_pb, worker_pb_grpc

STATS = {"num_running": 2, "num_waiting": 3, "queued_prefill_tokens": 40,
         "kv_blocks_total": 100, "kv_blocks_used": 10, "kv_blocks_cached": 6,
         "spec_acceptance_rate": 0.5, "spec_mean_accepted_length": 2.5, "spec_k": 3,
         "spec_drafts_proposed": 8, "spec_drafts_accepted": 4,
         "kv_tier_host_blocks": 7, "kv_tier_host_capacity_blocks": 50,
         "kv_tier_ssd_hits": 2, "kv_tier_host_bytes_out": 1024, "kv_tier_new_thing": 3}
PREFILL_COUNTERS = {"prefills": 2, "prompt_tokens": 80, "prefix_hit_tokens": 20,
                    "queue_s": 0.2, "compute_s": 1.0, "kv_bytes": 4096.0,
                    "kv_transfer_s": 0.3, "kv_transfers_done": 2, "kv_transfers_failed": 1}


def scrape(snapshot: WorkerSnapshot, role: str = "prefill") -> CollectorRegistry:
    reg = CollectorRegistry()
    reg.register(WorkerCollector(role, f"{role}-0", lambda: snapshot))
    return reg


def val(reg: CollectorRegistry, metric: str, role: str = "prefill", /, **labels
        ) -> float | None:
    return reg.get_sample_value(metric, {"component": role, "worker": f"{role}-0", **labels})


def test_engine_stats_become_gauges_with_worker_labels():
    reg = scrape(WorkerSnapshot(STATS, {}, 17))
    assert val(reg, "pdserve_engine_up") == 1
    assert val(reg, "pdserve_engine_steps_total") == 17
    assert val(reg, "pdserve_queue_depth", state="waiting") == 3
    assert val(reg, "pdserve_queue_depth", state="running") == 2
    assert val(reg, "pdserve_queued_prefill_tokens") == 40
    assert val(reg, "pdserve_kv_blocks", state="used") == 10
    assert val(reg, "pdserve_kv_blocks", state="cached") == 6
    assert val(reg, "pdserve_kv_blocks", state="total") == 100
    assert val(reg, "pdserve_kv_tier_blocks", tier="host", state="used") == 7
    assert val(reg, "pdserve_kv_tier_blocks", tier="host", state="capacity") == 50
    assert val(reg, "pdserve_kv_tier_blocks", tier="ssd", state="used") is None  # not reported
    assert val(reg, "pdserve_kv_tier_hits_total", tier="ssd") == 2
    assert val(reg, "pdserve_kv_tier_bytes_total", tier="host", direction="out") == 1024
    assert val(reg, "pdserve_kv_tier_stat", name="new_thing") == 3  # unknown keys still show
    assert val(reg, "pdserve_spec_acceptance_rate") == 0.5
    assert val(reg, "pdserve_spec_mean_accepted_length") == 2.5
    assert val(reg, "pdserve_spec_drafts_accepted_total") == 4


def test_prefill_counters_become_transfer_and_prefix_metrics():
    reg = scrape(WorkerSnapshot(STATS, PREFILL_COUNTERS, 1))
    assert val(reg, "pdserve_prefix_hit_ratio") == pytest.approx(0.25)
    assert val(reg, "pdserve_kv_transfer_bytes_total") == 4096
    assert val(reg, "pdserve_kv_transfer_seconds_count") == 2
    assert val(reg, "pdserve_kv_transfer_seconds_sum") == pytest.approx(0.3)
    assert val(reg, "pdserve_kv_transfers_total", result="done") == 2
    assert val(reg, "pdserve_kv_transfers_total", result="failed") == 1
    assert val(reg, "pdserve_prefill_compute_seconds_sum") == pytest.approx(1.0)
    assert val(reg, "pdserve_decode_admissions_total", prefill="local") is None


def test_decode_counters_and_a_dead_engine():
    counters = {"local_prefills": 1, "remote_prefills": 4, "prefix_hit_blocks": 3,
                "kv_exposed_s": 0.04, "kv_transfers": 4, "kv_pairs_refused": 2,
                "kv_frames_refused": 5, "kv_bytes_received": 100, "kv_bytes_received_nixl": 60,
                "kv_bytes_read_nixl": 40}
    reg = scrape(WorkerSnapshot(None, counters, 9), role="decode")
    assert val(reg, "pdserve_engine_up", "decode") == 0
    assert val(reg, "pdserve_queue_depth", "decode", state="waiting") is None
    assert val(reg, "pdserve_decode_admissions_total", "decode", prefill="remote") == 4
    assert val(reg, "pdserve_kv_exposed_seconds_count", "decode") == 4
    assert val(reg, "pdserve_kv_refused_total", "decode", what="frame") == 5
    assert val(reg, "pdserve_kv_refused_total", "decode", what="pair") == 2
    assert val(reg, "pdserve_kv_received_bytes_total", "decode", transport="nixl") == 60
    assert val(reg, "pdserve_kv_received_bytes_total", "decode", transport="inline") == 40
    assert val(reg, "pdserve_kv_nixl_read_bytes_total", "decode") == 40
    assert val(reg, "pdserve_prefix_hit_ratio", "decode") is None  # no prompt counter here
    assert val(reg, "pdserve_kv_transfer_bytes_total", "decode") is None


def test_metrics_server_serves_text_format_and_validates_its_port():
    calls = []

    def snapshot():
        calls.append(1)
        return WorkerSnapshot(STATS, PREFILL_COUNTERS, 5)

    with pytest.raises(ValueError, match="metrics_port"):
        WorkerTelemetry("prefill", "prefill-0", snapshot, "127.0.0.1", -2, ())
    off = WorkerTelemetry("prefill", "prefill-0", snapshot, "127.0.0.1", -1, ())
    assert off.ready_info() == {} and not calls  # registering took no snapshot
    tel = WorkerTelemetry("prefill", "prefill-0", snapshot, "127.0.0.1", 0, ())
    try:
        addr = tel.ready_info()["metrics_address"]
        assert addr.startswith("127.0.0.1:") and not addr.endswith(":0")
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        names = {f.name for f in text_string_to_metric_families(text)}
        assert {"pdserve_engine_steps", "pdserve_kv_blocks", "pdserve_worker_requests"} <= names
        assert calls
    finally:
        tel.close()


class FakeWorker(worker_pb_grpc.WorkerServicer):
    async def Prefill(self, request, context):
        if request.request_id.startswith("bad"):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        return worker_pb.PrefillResponse(token_id=5)

    async def Decode(self, request, context):
        yield worker_pb.DecodeEvent(ready=worker_pb.DecodeReady())
        for _ in range(3):
            yield worker_pb.DecodeEvent(tokens=worker_pb.TokenBatch(token_ids=[1, 2]))

    async def Prefetch(self, request, context):
        return worker_pb.PrefetchResponse(blocks_promoted=7)


async def _exercise(tel: WorkerTelemetry) -> None:
    server = grpc.aio.server(interceptors=[tel.interceptor])
    worker_pb_grpc.add_WorkerServicer_to_server(FakeWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = worker_pb_grpc.WorkerStub(ch)
            await stub.Prefill(worker_pb.PrefillRequest(request_id="ok-1",
                                                        prompt_token_ids=[1, 2, 3]))
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Prefill(worker_pb.PrefillRequest(request_id="bad-1"))
            events = [e async for e in stub.Decode(worker_pb.DecodeRequest(request_id="d-1"))]
            assert len(events) == 4
            info = await stub.Prefetch(worker_pb.PrefetchRequest())  # not watched
            assert info.blocks_promoted == 7
    finally:
        await server.stop(None)


def test_interceptor_counts_statuses_and_logs_request_ids(caplog):
    tel = WorkerTelemetry("prefill", "prefill-0", lambda: WorkerSnapshot(None), "127.0.0.1",
                          -1, ("Prefill", "Decode"))
    with caplog.at_level(logging.INFO, logger="pdserve.requests"):
        asyncio.run(_exercise(tel))
    reg = tel.registry
    assert val(reg, "pdserve_worker_requests_total", rpc="Prefill", status="OK") == 1
    assert val(reg, "pdserve_worker_requests_total", rpc="Prefill",
               status="RESOURCE_EXHAUSTED") == 1
    assert val(reg, "pdserve_worker_requests_total", rpc="Decode", status="OK") == 1
    assert val(reg, "pdserve_worker_errors_total", status="RESOURCE_EXHAUSTED") == 1
    assert val(reg, "pdserve_worker_requests_total", rpc="Prefetch", status="OK") is None
    assert val(reg, "pdserve_worker_requests_inflight") == 0
    records = [r for r in caplog.records if r.name == "pdserve.requests"]
    finished = {r.request_id: r for r in records if r.event == "request_finish"}
    assert finished["d-1"].tokens == 6
    assert finished["bad-1"].status == "RESOURCE_EXHAUSTED"
    started = [r.request_id for r in records if r.event == "request_start"]
    assert sorted(started) == ["bad-1", "d-1", "ok-1"]


def test_pull_push_and_tier_movement_counters():
    stats = {**STATS, "kv_tier_demote_copies": 5, "kv_tier_demoted_ahead": 4,
             "kv_tier_demote_found_in_host": 3, "kv_tier_prefetch_started": 2,
             "kv_tier_prefetched": 1, "kv_tier_load_cut_by_peer": 6, "kv_tier_staged_blocks": 2}
    counters = {"local_prefills": 1, "kv_pulls": 3, "kv_pull_failures": 1,
                "kv_pulled_blocks": 12, "kv_pushes": 2, "kv_pushed_blocks": 7}
    reg = scrape(WorkerSnapshot(stats, counters, 1), role="decode")
    assert val(reg, "pdserve_kv_pulls_total", "decode") == 3
    assert val(reg, "pdserve_kv_pull_failures_total", "decode") == 1
    assert val(reg, "pdserve_kv_pulled_blocks_total", "decode") == 12
    assert val(reg, "pdserve_kv_pushes_total", "decode") == 2
    assert val(reg, "pdserve_kv_pushed_blocks_total", "decode") == 7
    assert val(reg, "pdserve_kv_tier_demotions_total", "decode", kind="at_eviction") == 5
    assert val(reg, "pdserve_kv_tier_demotions_total", "decode", kind="ahead") == 4
    assert val(reg, "pdserve_kv_tier_demotions_total", "decode", kind="found_in_host") == 3
    assert val(reg, "pdserve_kv_tier_prefetches_total", "decode", stage="started") == 2
    assert val(reg, "pdserve_kv_tier_load_cut_by_peer_total", "decode") == 6
    assert val(reg, "pdserve_kv_tier_staged_blocks_total", "decode") == 2
    assert val(reg, "pdserve_kv_tier_stat", "decode", name="demoted_ahead") is None  # named
    # Before any pull: decode workers show the pull counters at 0; a prefill worker only the
    # pushes (it can be a pull's source, never its destination).
    fresh_d = scrape(WorkerSnapshot(STATS, {}, 1), role="decode")
    assert val(fresh_d, "pdserve_kv_pulls_total", "decode") == 0
    fresh_p = scrape(WorkerSnapshot(STATS, PREFILL_COUNTERS, 1))
    assert val(fresh_p, "pdserve_kv_pushed_blocks_total") == 0
    assert val(fresh_p, "pdserve_kv_pulls_total") is None
