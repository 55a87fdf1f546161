"""The CPU anchor: llama.cpp (llama-cpp-python) and pdserve on the same GGUF file, decode
tokens/s at batch 1 and batch 8, side by side in one run. Issue 15.

    .venv/bin/pip install llama-cpp-python      # bench-only; builds llama.cpp (~11 min)

On a CPU with AMX (e.g. a Sapphire Rapids Xeon), llama.cpp's native build (GGML_NATIVE) turns
on its AMX path, and that segfaulted in `llama_decode` on the development machine. Build it
without AMX, keeping AVX-512 where the CPU has it, and `GGML_AVX_VNNI` (the VEX-coded VNNI)
only where /proc/cpuinfo lists `avx_vnni`: Zen 4 has AVX-512 VNNI but not it, and a build
with it dies there with SIGILL. `--no-cache-dir`: pip's wheel cache would otherwise hand back
a wheel built earlier for another CPU.

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
      -DGGML_AVX_VNNI=$(grep -qw avx_vnni /proc/cpuinfo && echo ON || echo OFF) \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
      .venv/bin/pip install --no-cache-dir --no-deps llama-cpp-python
    .venv/bin/pip install diskcache
    .venv/bin/python bench/cpu_anchor.py [--repeats 3] [--threads 2] [--new 128]
        [--quantization int4] [--without-llama-cpp]

Both read the default model's file (SmolLM2-135M-Instruct, Q4_1): llama.cpp computes on the
4-bit blocks as stored; so does pdserve by default (a Q4 GGUF runs as int4: W4A16 through its
fp32-activation kernel, the Q8_0 embedding as the int8 LM head), and `--quantization none`
dequantises to fp32. Workload: `batch` random 128-token prompts, `--new` greedy tokens
each. Decode tokens/s = (batch x (new - 1)) / the time from every request's first token to the
last token: prefill is left out on both sides. llama.cpp runs a batch as `batch` sequences of
one context (n_seq_max = batch), one `llama_decode` per step over all of them; pdserve is
its engine stepping its continuous batch. Engines alternate within each repeat; medians.
`--without-llama-cpp` (where the package is not built): the comparison is pdserve with
`--quantization` against pdserve dense fp32 on the same file, in the same run, no anchor.
Writes bench/results/cpu_anchor.json.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from pdserve.default_model import ensure_default_model, source_file  # noqa: E402
from pdserve.engine import LLM, SamplingParams  # noqa: E402


def prompts_for(batch: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 4096) for _ in range(128)] for _ in range(batch)]


class LlamaCpp:
    """A llama.cpp context with `max_seqs` sequences, driven through the C API."""

    def __init__(self, path: Path, threads: int, max_seqs: int, n_ctx: int) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=512,
                                   n_threads=threads, n_threads_batch=threads, verbose=False)
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, 512, 512
        params.n_seq_max, params.n_threads, params.n_threads_batch = max_seqs, threads, threads
        self.ctx = llama_cpp.llama_init_from_model(self.llm._model.model, params)
        self.vocab = self.llm.n_vocab()
        self.batch = llama_cpp.llama_batch_init(512, 0, max_seqs)

    def _clear(self) -> None:
        lib = self.lib
        if hasattr(lib, "llama_memory_clear"):
            lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        else:
            lib.llama_kv_self_clear(self.ctx)

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> list[int]:
        """items: (token, position, sequence, wants logits) -> argmax of each wanted row."""
        b = self.batch
        b.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, 1 if logits else 0
        if self.lib.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        out = []
        for i, (_, _, _, logits) in enumerate(items):
            if logits:
                ptr = self.lib.llama_get_logits_ith(self.ctx, i)
                row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                            shape=(self.vocab,))
                out.append(int(row.argmax()))
        return out

    def run(self, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
        """(decode seconds, greedy tokens per sequence)."""
        self._clear()
        last = []
        for s, p in enumerate(prompts):  # prefill each sequence, logits of its last token
            last += self._decode([(t, j, s, j == len(p) - 1) for j, t in enumerate(p)])
        outs = [[t] for t in last]
        t0 = time.perf_counter()
        for step in range(new - 1):
            items = [(o[-1], len(p) + step, s, True)
                     for s, (p, o) in enumerate(zip(prompts, outs, strict=True))]
            for o, t in zip(outs, self._decode(items), strict=True):
                o.append(t)
        return time.perf_counter() - t0, outs


def run_pdserve(llm: LLM, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    engine = llm.engine
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    ids = [f"anchor-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, p, params)
    outs: dict[str, list[int]] = {rid: [] for rid in ids}
    t0 = None
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id].extend(out.new_token_ids)
        if t0 is None and all(outs.values()):  # every request has its first token
            t0 = time.perf_counter()
    return time.perf_counter() - t0, [outs[r] for r in ids]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--quantization", default=None,
                    help="pdserve weights: None (as stored: int4), none (dense fp32), int4")
    ap.add_argument("--compile-decode", default="off")
    ap.add_argument("--without-llama-cpp", action="store_true",
                    help="llama-cpp-python not installed: pdserve's weights against pdserve "
                         "fp32 in the same run instead (no anchor ratio)")
    ap.add_argument("--output", default="bench/results/cpu_anchor.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    gguf = source_file()
    ours = LLM(str(ensure_default_model()), quantization=a.quantization,
               compile_decode=a.compile_decode, enable_prefix_caching=False,
               kv_cache_memory_gb=0.5)
    if a.without_llama_cpp:
        other_name = "pdserve_fp32"
        fp32 = LLM(str(ensure_default_model()), enable_prefix_caching=False,
                   kv_cache_memory_gb=0.5, quantization="none")
        run_pdserve(fp32, prompts_for(2), 4)

        def theirs_run(prompts, new):
            return run_pdserve(fp32, prompts, new)
    else:
        other_name = "llama_cpp"
        theirs = LlamaCpp(gguf, a.threads, max(a.batches), n_ctx=max(a.batches) * (128 + a.new))
        theirs.run(prompts_for(1), 4)
        theirs_run = theirs.run
    run_pdserve(ours, prompts_for(2), 4)  # warm (and compile) first
    rows, raw = [], {}
    for batch in a.batches:
        prompts = prompts_for(batch, seed=batch)
        t_ours, t_theirs = [], []
        for _ in range(a.repeats):
            dt, tok_ours = run_pdserve(ours, prompts, a.new)
            t_ours.append(dt)
            dt, tok_theirs = theirs_run(prompts, a.new)
            t_theirs.append(dt)
            print(f"batch {batch}: pdserve {t_ours[-1]:.2f} s, {other_name} {dt:.2f} s",
                  flush=True)
        decoded = batch * (a.new - 1)
        same = sum(x == y for x, y in zip(tok_ours, tok_theirs, strict=True))
        rows.append({"batch": batch, "pdserve_tok_s": decoded / statistics.median(t_ours),
                     f"{other_name}_tok_s": decoded / statistics.median(t_theirs),
                     "ratio": statistics.median(t / o for o, t in zip(t_ours, t_theirs,
                                                                       strict=True)),
                     "same_greedy_seqs": f"{same}/{batch}"})
        raw[batch] = {"pdserve_s": t_ours, f"{other_name}_s": t_theirs}
    weights = a.quantization or "as stored"
    print(f"\npdserve ({weights}) vs {other_name}, {gguf.name}, {a.threads} threads, "
          f"decode tokens/s, medians of {a.repeats}")
    print_table(rows, ["batch", "pdserve_tok_s", f"{other_name}_tok_s", "ratio",
                       "same_greedy_seqs"])
    out = write_json(a.output, {"threads": a.threads, "pdserve_weights": weights,
                                "compile_decode": a.compile_decode, "against": other_name,
                                "rows": rows, "raw": raw})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
