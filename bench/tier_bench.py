"""KV tiers: TTFT of a request whose 2k-token prefix is uncached / in device / host / SSD,
and SSD-tier read throughput against a plain sequential read of the same bytes.

    .venv/bin/python bench/tier_bench.py [--prefix 2048] [--repeats 3] [--ssd-only]
        [--read-only BLOCKS]

Prints a table and writes bench/results/tiers.json. TTFT is the wall time of a one-token
generation on the single-process engine (no network), best of --repeats. `--ssd-only` skips
the device and host rows; `--read-only BLOCKS` measures only the SSD read figure, on a store
of BLOCKS blocks of the default model's size written directly (no engine, a minute). The SSD
read figure: each side's best of --repeats, and the median of the per-repeat ratios (the
two reads alternate, the page cache dropped before each).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_json  # noqa: E402
from kv_store.tiers import SSDStore, record  # noqa: E402
from kv_store.tiers import ssd as ssd_mod  # noqa: E402
from pdserve.demo_model import ensure_demo_model  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.engine.sampling_params import SamplingParams  # noqa: E402

ONE = SamplingParams(max_tokens=1, temperature=0)


def ttft(engine: LLMEngine, prompt: list[int], rid: str) -> float:
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, ONE)
    while engine.has_unfinished():
        if engine.step():
            break
    dt = time.perf_counter() - t0
    while engine.has_unfinished():
        engine.step()
    return dt


def push_out_of_device(engine: LLMEngine) -> None:
    """Evict every cached device block (demoting it to the lower tiers)."""
    blocks = engine.pool.allocate(engine.pool.num_free)
    engine.pool.free(blocks)
    if engine.tiers is not None:
        engine.tiers.flush()


def drop_page_cache() -> bool:
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def measure(engine: LLMEngine, prefix_len: int, repeats: int, where: str) -> dict:
    # A different seed per scenario: one scenario's prompts must be uncached in the next.
    g = torch.Generator().manual_seed(len(where) * 1000 + ord(where[0]))
    out = {"uncached": [], where: []}
    for r in range(repeats):
        prompt = torch.randint(3, engine.vocab_size, (prefix_len + 8,), generator=g).tolist()
        out["uncached"].append(ttft(engine, prompt, f"u{r}"))
        if where == "device":
            out[where].append(ttft(engine, prompt, f"d{r}"))
            continue
        push_out_of_device(engine)
        if where == "ssd":
            drop_page_cache()
        out[where].append(ttft(engine, prompt, f"t{r}"))
    return {k: min(v) for k, v in out.items()}


def ssd_throughput(engine: LLMEngine, repeats: int) -> dict:
    """Every block of the SSD tier read the way a request's run is (`read_many`: adjacent
    records in one read, checksums verified), against a plain sequential read of the same
    segment files; interleaved `repeats` times, the page cache dropped before each read."""
    ssd = engine.tiers.ssd
    hashes = [h for h in list(ssd._index)]  # noqa: SLF001 - bench reads the whole tier
    blocks = [(h, ssd.tokens_of(h)) for h in hashes]
    tier_s, plain_s, nbytes, plain, dropped = [], [], 0, 0, True
    for _ in range(repeats):
        dropped = drop_page_cache() and dropped
        t0 = time.perf_counter()
        nbytes = sum(len(f.result()) for f in ssd.read_many(blocks))
        tier_s.append(time.perf_counter() - t0)
        drop_page_cache()
        t0 = time.perf_counter()
        plain = 0
        for seg in sorted(ssd.dir.glob("seg-*.pdkv")):
            with open(seg, "rb") as f:
                while chunk := f.read(8 << 20):
                    plain += len(chunk)
        plain_s.append(time.perf_counter() - t0)
    ratios = sorted((nbytes / t) / (plain / p) for t, p in zip(tier_s, plain_s, strict=True))
    return {"blocks": len(hashes), "checksum": record.WRITE_CHECKSUM.name,
            "record_version": record.VERSION, "tier_bytes": nbytes,
            "tier_GBps": nbytes / min(tier_s) / 1e9, "plain_bytes": plain,
            "plain_GBps": plain / min(plain_s) / 1e9, "ratio_median": ratios[len(ratios) // 2],
            "ratios": ratios, "page_cache_dropped": dropped}


VARIANTS = {  # name: (checksum written, largest read): the tier now, and as it read before
    "runs_xxh3": (record.WRITE_CHECKSUM, ssd_mod.MAX_READ_BYTES),
    "per_record_crc32": (record.Checksum.CRC32, 1),
}


def ssd_read_only(blocks: int, repeats: int) -> dict:
    """The SSD read figure alone, on stores filled directly with `blocks` random blocks of
    the default model's size (30 layers x 2 x 3 heads x 16 x 64 fp32: 720 KiB), no engine:
    one store per variant, the variants' reads interleaved within each repeat."""
    saved = record.WRITE_CHECKSUM, ssd_mod.MAX_READ_BYTES
    with tempfile.TemporaryDirectory() as tmp:
        stores = {}
        try:
            for name, (kind, _) in VARIANTS.items():
                record.WRITE_CHECKSUM = kind
                stores[name] = _filled_store(Path(tmp) / name, blocks)
            runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
            for _ in range(repeats):
                for name, ssd in stores.items():
                    ssd_mod.MAX_READ_BYTES = VARIANTS[name][1]
                    runs[name].append(ssd_throughput(
                        SimpleNamespace(tiers=SimpleNamespace(ssd=ssd)), 1))
        finally:
            record.WRITE_CHECKSUM, ssd_mod.MAX_READ_BYTES = saved
            for ssd in stores.values():
                ssd.close()
    return {name: {**_summary(rs), "checksum": VARIANTS[name][0].name,
                   "max_read_bytes": VARIANTS[name][1]} for name, rs in runs.items()}


def _summary(rs: list[dict]) -> dict:
    ratios = sorted(r["ratio_median"] for r in rs)
    return {**rs[0], "tier_GBps": max(r["tier_GBps"] for r in rs),
            "plain_GBps": max(r["plain_GBps"] for r in rs),
            "ratio_median": ratios[len(ratios) // 2], "ratios": ratios,
            "page_cache_dropped": all(r["page_cache_dropped"] for r in rs)}


def _filled_store(directory: Path, blocks: int) -> SSDStore:
    block_bytes, block_size = 30 * 2 * 3 * 16 * 64 * 4, 16
    ssd = SSDStore(directory, 2**32, block_bytes, block_size)
    g = torch.Generator().manual_seed(0)
    payload = torch.randint(0, 255, (block_bytes,), dtype=torch.uint8, generator=g)
    for i in range(blocks):
        payload[:8] = torch.tensor(list(i.to_bytes(8, "little")), dtype=torch.uint8)
        ssd.write(i.to_bytes(16, "big"), list(range(i, i + block_size)),
                  payload.numpy().tobytes())
    ssd.flush()
    return ssd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefix", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ssd-only", action="store_true")
    ap.add_argument("--read-only", type=int, default=0, metavar="BLOCKS",
                    help="only the SSD read figure, on a store of BLOCKS default-model blocks")
    ap.add_argument("--out", default="bench/results/tiers.json")
    a = ap.parse_args()
    torch.set_num_threads(2)
    if a.read_only:
        got = ssd_read_only(a.read_only, a.repeats)
        rows = [{"read": k, "tier_GBps": v["tier_GBps"], "plain_GBps": v["plain_GBps"],
                 "ratio_median": v["ratio_median"]} for k, v in got.items()]
        print(f"SSD tier read vs plain sequential read, {a.read_only} blocks, load average "
              f"{os.getloadavg()[0]:.1f}")
        print_table(rows, list(rows[0]))
        write_json(a.out, {"ssd_read": got, "load_average_1_5_15m": list(os.getloadavg())})
        return
    model = str(ensure_demo_model())
    base = dict(model=model, dtype="float32", device="cpu", max_num_batched_tokens=4096,
                num_gpu_blocks=(a.prefix // 16 + 4) * 2)
    rows, results = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        host = LLMEngine(EngineConfig(**base, kv_host_gb=2.0))
        for where in () if a.ssd_only else ("device", "host"):
            r = measure(host, a.prefix, a.repeats, where)
            results[where] = r
            rows.append({"prefix_in": where, "ttft_s": r[where],
                         "uncached_s": r["uncached"], "ratio": r[where] / r["uncached"]})
        results["host_stats"] = {k: v for k, v in host.stats().items() if "kv_tier" in k}
        host.close()
        ssd = LLMEngine(EngineConfig(**base, kv_ssd_dir=tmp, kv_ssd_gb=4.0))
        r = measure(ssd, a.prefix, a.repeats, "ssd")
        results["ssd"] = r
        rows.append({"prefix_in": "ssd", "ttft_s": r["ssd"], "uncached_s": r["uncached"],
                     "ratio": r["ssd"] / r["uncached"]})
        results["ssd_stats"] = {k: v for k, v in ssd.stats().items() if "kv_tier" in k}
        results["ssd_read"] = ssd_throughput(ssd, a.repeats)
        ssd.close()
    print_table(rows, ["prefix_in", "ttft_s", "uncached_s", "ratio"])
    print("SSD tier read vs plain sequential read:", results["ssd_read"])
    write_json(a.out, {"prefix_tokens": a.prefix, "ttft": rows, **results})


if __name__ == "__main__":
    main()
