"""KV bytes, transfer time and tier TTFT: an MLA model against GQA and MHA models of the same
width, in one run.

    python bench/mla_kv_bench.py [--tokens 2048] [--prompts 5] [--repeats 2]
                                 [--output bench/results/mla_kv.json]

Three small random checkpoints (saved with `transformers`, nothing downloaded) share hidden
512, 8 query heads, 4 layers, a dense MLP of 1024, vocabulary 1024, fp32:

- `mha`: Llama, 8 KV heads of 64;
- `gqa`: Llama, 2 KV heads of 64 (4 query heads per KV head, Llama 3's ratio);
- `mla`: DeepSeek-V2 attention with DeepSeek-V2-Lite's proportions scaled to this width
  (kv_lora_rank = hidden / 4 = 128, rope key 32, no q bottleneck, every layer dense).

For each: the engine's `KVLayout` bytes per token and per `--tokens`-token prompt (to a TP=1
and to a TP=2 decode group: an MLA latent goes once to every receiving rank, GQA heads split);
the time the transfer engine takes to move one prompt's blocks, every layer, over gloo on
loopback to a receiver process that copies them into a paged cache (median of `--prompts`,
after a warm-up); and TTFT of a one-token request whose `--tokens` prefix is uncached, in the
host tier or on the SSD tier (single-process engine, best of `--repeats`; the same measurement
as bench/tier_bench.py). Ratios are against GQA in the same run. Arithmetic rows give the same
bytes for the published DeepSeek-V3 shape against a GQA model of its width (no checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import print_table, write_json  # noqa: E402
from bench.tier_bench import measure as tier_ttft  # noqa: E402
from kv_store.transfer import KVReceiver, KVSender, TransferConfig  # noqa: E402
from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.engine import LLMEngine  # noqa: E402
from pdserve.engine.kv_layout import KVLayout  # noqa: E402
from pdserve.engine.quant.kv_format import KVCacheFormat  # noqa: E402

BLOCK = 16
WIDTH = dict(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
             num_attention_heads=8, max_position_embeddings=4096, bos_token_id=1,
             eos_token_id=2)


def save_checkpoint(kind: str, out: Path) -> Path:
    import transformers

    from pdserve.demo_model import write_tokenizer_files

    torch.manual_seed(0)
    if kind == "mla":
        cfg = transformers.DeepseekV2Config(
            **WIDTH, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=None,
            qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
            first_k_dense_replace=WIDTH["num_hidden_layers"], n_routed_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=256, n_shared_experts=1)
    else:
        cfg = transformers.LlamaConfig(**WIDTH, num_key_value_heads=8 if kind == "mha" else 2)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    write_tokenizer_files(out, vocab_size=WIDTH["vocab_size"])
    return out


# -- transfer: a receiver process with a paged cache of the layout's shape ------------------
class CacheSink:
    def __init__(self, layers: int, shape: tuple[int, ...]) -> None:
        self.cache = [torch.zeros(shape) for _ in range(layers)]

    def on_layer(self, request_id, layer, block_ids, kv, head_start=0):
        self.cache[layer][block_ids] = kv

    def on_done(self, request_id, body):
        pass

    def on_failed(self, request_id, reason):
        print(json.dumps({"failed": request_id, "reason": reason}), file=sys.stderr, flush=True)


def run_receiver(layers: int, shape: tuple[int, ...]) -> None:
    torch.set_num_threads(1)
    with KVReceiver("127.0.0.1", 0, CacheSink(layers, shape), TransferConfig()) as receiver:
        receiver.start()
        print(json.dumps({"address": receiver.address}), flush=True)
        for _ in sys.stdin:  # EOF ends the receiver
            pass


def transfer_seconds(layout: KVLayout, tokens: int, prompts: int) -> tuple[list[float], int]:
    """Seconds to move one prompt's blocks (every layer) to a receiver process."""
    blocks = -(-tokens // BLOCK)
    shape = layout.cache_shape(blocks)
    child = subprocess.Popen(
        [sys.executable, __file__, "--role", "receiver", "--layers", str(layout.num_layers),
         "--shape", json.dumps(list(shape))], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True)
    try:
        address = json.loads(child.stdout.readline())["address"]
        g = torch.Generator().manual_seed(0)
        kvs = [torch.randn(shape, generator=g) for _ in range(layout.num_layers)]
        seconds, nbytes = [], 0
        with KVSender(TransferConfig()) as sender:
            for i in range(prompts + 1):
                t0 = time.perf_counter()
                for layer, kv in enumerate(kvs):
                    sender.send_layer(address, f"p{i}", layer, list(range(blocks)), kv)
                nbytes = sender.finish(address, f"p{i}", b"").result(120).bytes_sent
                if i:  # the first prompt pays for the pair's rendezvous
                    seconds.append(time.perf_counter() - t0)
    finally:
        child.stdin.close()
        child.wait(30)
    return seconds, nbytes


# -- tiers ---------------------------------------------------------------------------------
def tiers(model: Path, tokens: int, repeats: int, tmp: Path) -> dict:
    base = dict(model=str(model), dtype="float32", device="cpu", block_size=BLOCK,
                max_num_batched_tokens=4096, num_gpu_blocks=(tokens // BLOCK + 4) * 2,
                enable_prefix_caching=True)
    out = {}
    host = LLMEngine(EngineConfig(**base, kv_host_gb=1.0))
    out["host"] = tier_ttft(host, tokens, repeats, "host")
    out["host_hits"] = host.stats().get("kv_tier_host_hits", 0)
    host.close()
    ssd = LLMEngine(EngineConfig(**base, kv_ssd_dir=str(tmp), kv_ssd_gb=2.0))
    out["ssd"] = tier_ttft(ssd, tokens, repeats, "ssd")
    out["ssd_hits"] = ssd.stats().get("kv_tier_ssd_hits", 0)
    ssd.close()
    return out


def arithmetic_rows(tokens: int) -> list[dict]:
    """DeepSeek-V3 (61 layers, latent 512 + rope 64) against a GQA model of its width (61
    layers, 8 KV heads of 128), bf16: bytes only, from the layout arithmetic."""
    bf16 = KVCacheFormat(torch.bfloat16)
    shapes = {"deepseek-v3 mla": KVLayout.mla(61, 512, 64, BLOCK, bf16),
              "same width gqa-8": KVLayout.gqa(61, 8, 128, BLOCK, bf16)}
    gqa = shapes["same width gqa-8"].bytes_per_token()
    return [{"model": name, "bytes_per_token": lay.bytes_per_token(),
             "prompt_MiB_tp1": lay.transfer_bytes(tokens) / 2**20,
             "prompt_MiB_tp2": lay.transfer_bytes(tokens, receiver_tp=2) / 2**20,
             "gqa_over_this": gqa / lay.bytes_per_token()} for name, lay in shapes.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default="bench/results/mla_kv.json")
    ap.add_argument("--role", choices=["bench", "receiver"], default="bench")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--shape", default="[]")
    a = ap.parse_args()
    if a.role == "receiver":
        run_receiver(a.layers, tuple(json.loads(a.shape)))
        return
    torch.set_num_threads(a.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("mha", "gqa", "mla"):
            model = save_checkpoint(kind, Path(tmp) / kind)
            engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", device="cpu",
                                            block_size=BLOCK, num_gpu_blocks=8))
            layout = engine.kv_layout
            engine.close()
            seconds, nbytes = transfer_seconds(layout, a.tokens, a.prompts)
            assert nbytes >= layout.transfer_bytes(a.tokens), (nbytes, layout)
            t = tiers(model, a.tokens, a.repeats, Path(tmp) / f"ssd-{kind}")
            rows.append({
                "model": kind, "layout": str(layout),
                "bytes_per_token": layout.bytes_per_token(),
                "prompt_MiB_tp1": layout.transfer_bytes(a.tokens) / 2**20,
                "prompt_MiB_tp2": layout.transfer_bytes(a.tokens, receiver_tp=2) / 2**20,
                "wire_bytes": nbytes, "transfer_s": statistics.median(seconds),
                "transfer_s_all": seconds,
                "ttft_uncached_s": min(t["host"]["uncached"], t["ssd"]["uncached"]),
                "ttft_host_s": t["host"]["host"], "ttft_ssd_s": t["ssd"]["ssd"],
                "host_hits": t["host_hits"], "ssd_hits": t["ssd_hits"]})
    gqa = next(r for r in rows if r["model"] == "gqa")
    for r in rows:
        r["gqa_bytes_over_this"] = gqa["bytes_per_token"] / r["bytes_per_token"]
        r["transfer_vs_gqa"] = r["transfer_s"] / gqa["transfer_s"]
    print(f"\nKV per model ({a.tokens}-token prompt, fp32, block {BLOCK}, "
          f"{torch.get_num_threads()} threads; load {os.getloadavg()[0]:.1f})")
    print_table(rows, ["model", "bytes_per_token", "gqa_bytes_over_this", "prompt_MiB_tp1",
                       "prompt_MiB_tp2", "transfer_s", "transfer_vs_gqa"])
    print()
    print_table(rows, ["model", "ttft_uncached_s", "ttft_host_s", "ttft_ssd_s", "host_hits",
                       "ssd_hits"])
    arith = arithmetic_rows(a.tokens)
    print("\nArithmetic (KVLayout, bf16, no checkpoint)")
    print_table(arith, ["model", "bytes_per_token", "gqa_over_this", "prompt_MiB_tp1",
                        "prompt_MiB_tp2"])
    path = write_json(a.output, {"bench": "mla_kv", "tokens": a.tokens, "rows": rows,
                                 "arithmetic": arith,
                                 "load_average_1_5_15m": list(os.getloadavg())})
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
