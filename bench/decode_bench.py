"""Decode speed on the real default model (SmolLM2-135M-Instruct): pdserve vs HF
transformers, and weight bytes read per second over memory-copy bandwidth. Issue 15.

    .venv/bin/python bench/decode_bench.py [--repeats 3] [--threads 2]
        [--configs default mkl eager ...] [--batches 1 32] [--skip-hf]

Engines (one process, all loaded at start; every repeat runs each of them in turn, so the
machine's noise hits all alike; medians of the repeats, ratios within a repeat):
- `default`: the engine as it serves this file: its Q4_1 blocks as int4 (pdserve's
  fp32-activation kernel) and its Q8_0 embedding as the int8 LM head;
- `eager`: dense fp32 (`quantization="none"`: the blocks dequantised, as HF does), C++ CPU
  paged attention, eager decode step;
- `inductor`: the same with `compile_decode="inductor"` (compiled before timing);
- `reference`: dense fp32 with `attention_backend="torch"`, the pure-torch paged attention
  (the previous engine's path);
- `invariant`: `default` with `batch_invariant=True` (every row through the int4 GEMV and the
  C++ attention, whatever the batch): what the mode costs;
- `python-layers`: `default` with the flat decode loop's layers run from Python
  (`FlatDecode(native=False)`), the baseline for the C++ loop (`kernels/cpu/flat_decoder.cpp`);
- `mkl`: `default` with torch's oneDNN turned off (`torch.backends.mkldnn.enabled = False`
  while it runs), so the products of prompts of 384+ tokens go through MKL's sgemm on
  dequantised tiles, as before oneDNN took them (kernels/cpu/int4_linear.cpp): `default`'s
  baseline in `vs_mkl`. Shorter prompts (batch 1's 128 tokens) run the panel kernel either
  way, so there the two are the same computation;
- `eager-mkl`: `eager` with oneDNN off, so every dense product is F.linear's (MKL), as before
  `kernels/onednn.py`: `eager`'s baseline in `vs_mkl`;
- `hf`: transformers reading the same GGUF file (dequantised to fp32 like ours).

Workloads: batch 1 (one 128-token prompt, 128 new tokens) and batch 32 ragged (prompts
16..512, max_tokens 16..128; HF pads and runs to the longest, both credited with the same
useful tokens), as in bench/engine_bench.py. Bandwidth (batch 1): every weight byte a decode
step reads (the embedding matrix counted once: tied, it is read whole as the LM head) x
tokens/s, over a large tensor copy's bytes/s measured right before each repeat; counted two
ways: end to end (the prompt's prefill in the time, as tokens/s counts it) and over the decode
steps alone (the request's time less that of the same request with max_tokens=1, its prefill
and first token, over the steps after it: what a decode step reads per second of its own).
Greedy tokens of the dense engines are checked equal to each other and, at batch 1, to HF;
the default engine's sequences equal to the dense ones are counted (`same_greedy`).
Writes bench/results/decode.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import memcpy_bandwidth, print_table, write_json  # noqa: E402
from bench.engine_bench import workload  # noqa: E402
from pdserve.default_model import ensure_default_model, source_file  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402
from pdserve.engine.flat_decode import FlatDecode  # noqa: E402

DENSE = {"quantization": "none"}
ENGINES = {
    "default": {},
    "eager": DENSE,
    "inductor": {**DENSE, "compile_decode": "inductor"},
    "reference": {**DENSE, "attention_backend": "torch"},
    "invariant": {"batch_invariant": True},
    "python-layers": {},
    "mkl": {},
    "eager-mkl": DENSE,
}
PYTHON_LAYERS = "python-layers"
MKL_TWIN = {"default": "mkl", "eager": "eager-mkl"}
"""An engine and its twin run with oneDNN off (the `vs_mkl` column)."""


def load_hf():
    import transformers

    gguf = source_file()
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()


def run_hf(model, prompts, max_new) -> tuple[float, list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max(max_new), min_new_tokens=max(max_new),
                             pad_token_id=0, eos_token_id=None)
    dt = time.perf_counter() - t0
    return dt, [row[width:width + m].tolist() for row, m in zip(out, max_new, strict=True)]


def run_ours(llm: LLM, prompts, max_new, onednn: bool = True) -> tuple[float, list[list[int]]]:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_new]
    was = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = onednn
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        return time.perf_counter() - t0, [o.token_ids for o in outs]
    finally:
        torch.backends.mkldnn.enabled = was


def weight_bytes(llm: LLM) -> int:
    """Bytes of weights one decode step reads: the linear layers as stored (dense or packed)
    and the LM head's matmul weight (a tied embedding is read whole as the head; an untied
    one a row per token, left out, as are the norms' 0.1 MB)."""
    from bench.int4_bench import footprint

    f = footprint(llm)
    return int((f["linear_MB"] + f["lm_head_MB"]) * 1e6)


def measure(engines: dict, hf, batch: int, repeats: int) -> tuple[list[dict], dict]:
    prompts, max_new = workload(batch)
    useful = sum(max_new)
    times: dict[str, list[float]] = {name: [] for name in [*engines, "hf"]}
    copies, tokens = [], {}
    steps: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        copies.append(memcpy_bandwidth())
        for name, llm in engines.items():
            onednn = name not in MKL_TWIN.values()
            dt, tokens[name] = run_ours(llm, prompts, max_new, onednn)
            times[name].append(dt)
            if batch == 1:  # the decode steps' own time: less the prefill and first token
                first, _ = run_ours(llm, prompts, [1], onednn)
                steps[name].append((dt - first) / (max_new[0] - 1))
            print(f"batch {batch} {name}: {useful / dt:.3g} tok/s", flush=True)
        if hf is not None:
            dt, tokens["hf"] = run_hf(hf, prompts, max_new)
            times["hf"].append(dt)
            print(f"batch {batch} hf: {useful / dt:.3g} tok/s", flush=True)
    dense = [tokens[n] for n in engines if ENGINES[n].get("quantization") == "none"]
    assert all(t == dense[0] for t in dense), "pdserve's dense engines disagree on greedy tokens"
    if batch == 1 and hf is not None and dense:
        assert tokens["hf"] == dense[0], "pdserve and HF disagree on greedy tokens"
    baseline = dense[0] if dense else tokens.get("hf")
    rows = []
    for name, ts in times.items():
        if not ts:
            continue
        row = {"batch": batch, "engine": name, "tok_s": useful / statistics.median(ts)}
        if steps.get(name):
            row["step_ms"] = statistics.median(steps[name]) * 1e3
        if baseline is not None and name != "hf":
            same = sum(a == b for a, b in zip(tokens[name], baseline, strict=True))
            row["same_greedy"] = f"{same}/{batch}"
        if hf is not None and name != "hf":
            row["vs_hf"] = statistics.median(h / t for h, t in zip(times["hf"], ts,
                                                                    strict=True))
        for base, column in ((PYTHON_LAYERS, "vs_py_layers"), (MKL_TWIN.get(name), "vs_mkl")):
            if times.get(base) and name != "hf":
                row[column] = statistics.median(
                    b / t for b, t in zip(times[base], ts, strict=True))
        rows.append(row)
    return rows, {"memcpy_GB_s": statistics.median(copies) / 1e9, "times_s": times}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32], choices=[1, 32])
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--kv-gb", type=float, default=None,
                    help="KV cache per engine (default: 0.15 GB for batch 1 only, else 1.0)")
    ap.add_argument("--output", default="bench/results/decode.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    model = ensure_default_model()
    kv_gb = a.kv_gb or (0.15 if a.batches == [1] else 1.0)  # batch 32 holds ~20k tokens
    engines = {n: LLM(str(model), dtype="float32", enable_prefix_caching=False,
                      kv_cache_memory_gb=kv_gb, **ENGINES[n]) for n in a.configs}
    if PYTHON_LAYERS in engines:
        runner = engines[PYTHON_LAYERS].engine.runner
        runner.decode_step = FlatDecode(runner.model, native=False)
    hf = None if a.skip_hf else load_hf()
    warm = workload(32)
    for name, llm in engines.items():  # compile (inductor) and warm every engine first
        run_ours(llm, warm[0][:1], [4])
        run_ours(llm, warm[0][:3], [4, 4, 4])
        print(f"warmed {name}", flush=True)
    result: dict = {"threads": a.threads, "repeats": a.repeats}
    rows, bw = [], []
    for batch in a.batches:
        got, extra = measure(engines, hf, batch, a.repeats)
        rows += got
        result.update({f"batch{batch}": got, f"batch{batch}_raw": extra})
        if batch == 1:
            bw = bandwidth_rows(got, {n: weight_bytes(llm) for n, llm in engines.items()},
                                extra["memcpy_GB_s"])
            result["bandwidth"] = bw
    print(f"\nDecode, SmolLM2-135M-Instruct, {a.threads} threads, medians of {a.repeats}")
    print_table(rows, ["batch", "engine", "tok_s", "vs_hf", "vs_py_layers", "vs_mkl",
                       "same_greedy"])
    if bw:
        print("\nBatch 1: weight bytes read per second over memory-copy bandwidth")
        print("(end to end, the prompt's prefill in the time; and over the decode steps alone)")
        print_table(bw, ["engine", "weight_MB", "weight_GB_s", "memcpy_GB_s", "utilisation",
                         "step_ms", "step_GB_s", "step_utilisation"])
    print(f"\nwrote {write_json(a.output, result)}")


def bandwidth_rows(rows: list[dict], wb: dict[str, int], memcpy_gb_s: float) -> list[dict]:
    out = []
    for r in rows:
        if r["engine"] == "hf":
            continue
        b = wb[r["engine"]]
        step_s = r["step_ms"] / 1e3
        out.append({"engine": r["engine"], "weight_MB": b / 1e6,
                    "weight_GB_s": b * r["tok_s"] / 1e9, "memcpy_GB_s": memcpy_gb_s,
                    "utilisation": b * r["tok_s"] / (memcpy_gb_s * 1e9),
                    "step_ms": r["step_ms"], "step_GB_s": b / step_s / 1e9,
                    "step_utilisation": b / step_s / (memcpy_gb_s * 1e9)})
    return out


if __name__ == "__main__":
    main()
