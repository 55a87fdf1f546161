"""A worker's metrics, built on each scrape from a snapshot of its engine and service state.

A custom collector, so nothing in the engine's hot path changes: the scrape asks the worker
for a `WorkerSnapshot` (`LLMEngine.stats()` taken on the engine thread between two steps, plus
the service's cumulative counters) and turns it into metric families. Every family carries
`component` (prefill | decode) and `worker` (the worker id) labels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from pdserve.observability.vllm_metrics import state_families, worker_state

_TIER_PREFIX = "kv_tier_"
# The KV store's lower tiers (kv_store/tiers) report `kv_tier_*` keys in `LLMEngine.stats()`:
# family -> (kind, help, label names, {stats key: label values}). A key that is absent (no
# tiers configured) emits nothing; a key not listed here still shows as `kv_tier_stat{name}`.
_TIER_FAMILIES = {
    "kv_tier_blocks": ("gauge", "KV blocks held per lower tier.", ("tier", "state"), {
        "kv_tier_host_blocks": ("host", "used"),
        "kv_tier_host_capacity_blocks": ("host", "capacity"),
        "kv_tier_ssd_blocks": ("ssd", "used"),
        "kv_tier_ssd_corrupted": ("ssd", "corrupted")}),
    "kv_tier_read_bytes_per_second": ("gauge", "Measured read bandwidth per tier.",
                                      ("tier",), {"kv_tier_host_read_bw": ("host",),
                                                  "kv_tier_ssd_read_bw": ("ssd",)}),
    "kv_tier_prefill_tokens_per_second": ("gauge", "Measured prefill speed (the recompute "
                                          "side of load-or-recompute).", (),
                                          {"kv_tier_prefill_tps": ()}),
    "kv_tier_hits": ("counter", "Prefix blocks found in a lower tier.", ("tier",),
                     {"kv_tier_host_hits": ("host",), "kv_tier_ssd_hits": ("ssd",)}),
    "kv_tier_bytes": ("counter", "Bytes moved into (demoted) and out of (loaded) each tier.",
                      ("tier", "direction"), {"kv_tier_host_bytes_in": ("host", "in"),
                                              "kv_tier_host_bytes_out": ("host", "out"),
                                              "kv_tier_ssd_bytes_in": ("ssd", "in"),
                                              "kv_tier_ssd_bytes_out": ("ssd", "out")}),
    "kv_tier_load_decisions": ("counter", "Lower-tier blocks planned to load vs recompute.",
                               ("decision",),
                               {"kv_tier_blocks_loaded_planned": ("load",),
                                "kv_tier_blocks_recompute_chosen": ("recompute",)}),
    "kv_tier_prefetches": ("counter", "SSD to host reads in the background: started by a "
                           "router hint, and landed in host (hinted or staged).", ("stage",),
                           {"kv_tier_prefetch_started": ("started",),
                            "kv_tier_prefetched": ("done",)}),
    "kv_tier_staged_blocks": ("counter", "SSD blocks a waiting request started reading into "
                              "host for itself before its admission.", (),
                              {"kv_tier_staged_blocks": ()}),
    "kv_tier_ssd_load_failures": ("counter", "SSD block loads that failed (checksum, I/O).",
                                  (), {"kv_tier_ssd_load_failures": ()}),
    "kv_tier_demotions": ("counter", "Device blocks kept in host memory: copied at eviction, "
                          "copied ahead of it, or found there at eviction (copied ahead).",
                          ("kind",), {"kv_tier_demote_copies": ("at_eviction",),
                                      "kv_tier_demoted_ahead": ("ahead",),
                                      "kv_tier_demote_found_in_host": ("found_in_host",)}),
    "kv_tier_load_cut_by_peer": ("counter", "Lower-tier blocks recomputed because another "
                                 "tensor-parallel rank lacked them.", (),
                                 {"kv_tier_load_cut_by_peer": ()}),
}
_TIER_KEYS = frozenset(k for *_, keys in _TIER_FAMILIES.values() for k in keys)


@dataclass(frozen=True)
class WorkerSnapshot:
    stats: Mapping[str, float] | None
    """`LLMEngine.stats()`; None when the engine did not answer (dead or stuck)."""
    counters: Mapping[str, float] = field(default_factory=dict)
    """The service's cumulative counters (`WorkerServicerBase.counters`)."""
    engine_steps: int = 0
    model_name: str = ""
    """The served model's id: the `model_name` label of vLLM's families."""
    block_size: int = 0


class WorkerCollector(Collector):
    def __init__(self, component: str, worker_id: str,
                 snapshot: Callable[[], WorkerSnapshot]) -> None:
        self.labels = {"component": component, "worker": worker_id}
        self.snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # registering must not take a snapshot (the engine may not run yet)

    def collect(self) -> Iterator[Metric]:
        return iter(worker_families(self.labels, self.snapshot()))


def worker_families(labels: Mapping[str, str], snap: WorkerSnapshot) -> list[Metric]:
    fam = _Families(labels)
    fam.gauge("engine_up", "1 while the engine answers stats, else 0.",
              1.0 if snap.stats is not None else 0.0)
    fam.counter("engine_steps", "Engine steps run.", snap.engine_steps)
    if snap.stats is not None:
        _engine_families(fam, snap.stats)
    _counter_families(fam, snap.counters)
    _pull_families(fam, snap.counters, pulls=labels.get("component") == "decode")
    if snap.stats is not None:  # vLLM's names for this engine's state
        fam.out.extend(state_families(snap.model_name,
                                      worker_state(snap.stats, snap.block_size)))
    return fam.out


def _engine_families(fam: _Families, s: Mapping[str, float]) -> None:
    fam.gauge("queue_depth", "Requests in the engine by state.", by=("state",),
              series={("waiting",): s.get("num_waiting", 0),
                      ("running",): s.get("num_running", 0)})
    fam.gauge("queued_prefill_tokens", "Prompt tokens still to prefill.",
              s.get("queued_prefill_tokens", 0))
    fam.gauge("kv_blocks", "KV blocks of the device cache by state.", by=("state",),
              series={("used",): s.get("kv_blocks_used", 0),
                      ("cached",): s.get("kv_blocks_cached", 0),
                      ("total",): s.get("kv_blocks_total", 0)})
    _tier_families(fam, s)
    fam.gauge("spec_acceptance_rate", "Accepted / proposed draft tokens (cumulative).",
              s.get("spec_acceptance_rate", 0))
    fam.gauge("spec_mean_accepted_length", "Tokens emitted per verifying request-step.",
              s.get("spec_mean_accepted_length", 0))
    fam.gauge("spec_k", "Draft tokens proposed per step, as last chosen.", s.get("spec_k", 0))
    fam.counter("spec_drafts_proposed", "Draft tokens proposed.",
                s.get("spec_drafts_proposed", 0))
    fam.counter("spec_drafts_accepted", "Draft tokens accepted.",
                s.get("spec_drafts_accepted", 0))


def _tier_families(fam: _Families, s: Mapping[str, float]) -> None:
    for name, (kind, doc, by, keys) in _TIER_FAMILIES.items():
        series = {labels: s[key] for key, labels in keys.items() if key in s}
        if series:
            add = fam.gauge if kind == "gauge" else fam.counter
            add(name, doc, by=by, series=series)
    other = {(k[len(_TIER_PREFIX):],): v for k, v in s.items()
             if k.startswith(_TIER_PREFIX) and k not in _TIER_KEYS}
    if other:
        fam.gauge("kv_tier_stat", "Other KV tier statistics, by stats key.", by=("name",),
                  series=other)


def _counter_families(fam: _Families, c: Mapping[str, float]) -> None:
    if "prompt_tokens" in c:  # prefill workers: the prompts they computed
        prompt, hit = c.get("prompt_tokens", 0), c.get("prefix_hit_tokens", 0)
        fam.gauge("prefix_hit_ratio", "Prompt tokens served from the prefix cache / prompt "
                  "tokens (since start; use the _total counters for a window).",
                  hit / prompt if prompt else 0.0)
        fam.counter("worker_prompt_tokens", "Prompt tokens prefilled.", prompt)
        fam.counter("prefix_hit_tokens", "Prompt tokens found in the prefix cache.", hit)
        fam.summary("prefill_queue_seconds", "Wait before a prefill was first scheduled.",
                    c.get("prefills", 0), c.get("queue_s", 0))
        fam.summary("prefill_compute_seconds", "First schedule to first token.",
                    c.get("prefills", 0), c.get("compute_s", 0))
    if "local_prefills" in c or "remote_prefills" in c:  # decode workers
        fam.counter("decode_admissions", "Requests admitted, by where their prompt was "
                    "prefilled.", by=("prefill",),
                    series={("local",): c.get("local_prefills", 0),
                            ("remote",): c.get("remote_prefills", 0)})
        fam.counter("prefix_hit_blocks", "Prompt blocks already cached here on admission.",
                    c.get("prefix_hit_blocks", 0))
    done, failed = c.get("kv_transfers_done", 0), c.get("kv_transfers_failed", 0)
    if done or failed or "kv_bytes" in c:
        fam.counter("kv_transfer_bytes", "KV bytes sent to decode workers.", c.get("kv_bytes", 0))
        fam.summary("kv_transfer_seconds", "Latency of KV transfers (sender side).", done,
                    c.get("kv_transfer_s", 0))
        fam.counter("kv_transfers", "KV transfers by result.", by=("result",),
                    series={("done",): done, ("failed",): failed})
    if "kv_transfers" in c:
        fam.summary("kv_exposed_seconds", "Time a request waited for its KV after the "
                    "prefill finished (receiver side).", c["kv_transfers"],
                    c.get("kv_exposed_s", 0))
    if "kv_frames_refused" in c:  # decode workers' receivers (security: docs/architecture)
        fam.counter("kv_refused", "KV transfer pair offers and frames refused: a pair not "
                    "signed with the cluster secret, a frame not tagged under its "
                    "transfer's ticket.", by=("what",),
                    series={("pair",): c.get("kv_pairs_refused", 0),
                            ("frame",): c["kv_frames_refused"]})
    if "kv_bytes_received" in c:  # decode workers' receivers, by payload path
        total, nixl = c["kv_bytes_received"], c.get("kv_bytes_received_nixl", 0)
        fam.counter("kv_received_bytes", "KV payload bytes received, by transport (NIXL, "
                    "or inline on gloo/NCCL).", by=("transport",),
                    series={("nixl",): nixl, ("inline",): max(total - nixl, 0)})
        fam.counter("kv_nixl_read_bytes", "Of the NIXL bytes, those this worker read from "
                    "the sender's staging slots (same host: one copy), not written into its "
                    "landing slots.", c.get("kv_bytes_read_nixl", 0))


def _pull_families(fam: _Families, c: Mapping[str, float], pulls: bool) -> None:
    """Decode pulls (`decode_worker/kv_pull.py`, puller side: decode workers) and the pushes
    that serve them (`serving/kv_push.py`, any worker); present at 0 before the first one,
    so rate() works from the start."""
    if pulls or "kv_pulls" in c:
        fam.counter("kv_pulls", "Prefix pulls attempted from another worker.",
                    c.get("kv_pulls", 0))
        fam.counter("kv_pull_failures", "Prefix pulls that brought nothing (the prefix was "
                    "recomputed).", c.get("kv_pull_failures", 0))
        fam.counter("kv_pulled_blocks", "KV blocks received by pulls.",
                    c.get("kv_pulled_blocks", 0))
    fam.counter("kv_pushes", "Pulls served for other workers (PushKV that sent blocks).",
                c.get("kv_pushes", 0))
    fam.counter("kv_pushed_blocks", "KV blocks sent to pulling workers.",
                c.get("kv_pushed_blocks", 0))


class _Families:
    """Builds metric families that carry this worker's labels, plus `by` labels whose values
    key `series`."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        self.names = list(labels)
        self.values = list(labels.values())
        self.out: list[Metric] = []

    def gauge(self, name: str, doc: str, value: float = 0.0, by: tuple[str, ...] = (),
              series: Mapping[tuple[str, ...], float] | None = None) -> None:
        self._add(GaugeMetricFamily, name, doc, by, series or {(): value})

    def counter(self, name: str, doc: str, value: float = 0.0, by: tuple[str, ...] = (),
                series: Mapping[tuple[str, ...], float] | None = None) -> None:
        self._add(CounterMetricFamily, name, doc, by, series or {(): value})

    def summary(self, name: str, doc: str, count: float, total: float) -> None:
        m = SummaryMetricFamily(f"pdserve_{name}", doc, labels=self.names)
        m.add_metric(self.values, count_value=count, sum_value=total)
        self.out.append(m)

    def _add(self, kind, name: str, doc: str, by: tuple[str, ...],
             series: Mapping[tuple[str, ...], float]) -> None:
        m = kind(f"pdserve_{name}", doc, labels=[*self.names, *by])
        for key, value in series.items():
            m.add_metric([*self.values, *key], float(value))
        self.out.append(m)
