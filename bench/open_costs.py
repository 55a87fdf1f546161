"""Two costs every worker pays before it serves, each beside its old way in the same run:

- opening a GGUF: the real default model's raw file (49k-token vocabulary) read by pdserve's
  header reader (`checkpoint/gguf_reader.py`) and by the gguf package's `GGUFReader`;
- allocating a CPU KV cache: SmolLM2's layout (30 layers, 3 KV heads of 64, fp32) over the
  default 1 GiB budget, by `KVLayout.new_caches` (calloc'd: zero pages as touched) and by
  `torch.zeros` (every byte written up front). Wall, user and system time of this process.

    python bench/open_costs.py [--repeats 5] [--cache-gb 1] [--json out.json]

Each figure is the median of --repeats; a ratio over 1 means the old way is that many times
slower.
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import print_table, write_json  # noqa: E402


def timed(fn, repeats: int) -> dict[str, float]:
    """Median wall, user and system seconds of `fn()` (its result dropped before the next)."""
    walls, users, syss = [], [], []
    for _ in range(repeats):
        gc.collect()
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        out = fn()
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        del out
        walls.append(t1 - t0)
        users.append(r1.ru_utime - r0.ru_utime)
        syss.append(r1.ru_stime - r0.ru_stime)
    return {"wall_s": statistics.median(walls), "user_s": statistics.median(users),
            "sys_s": statistics.median(syss)}


def gguf_rows(repeats: int) -> list[dict]:
    import gguf

    from pdserve.default_model import source_file
    from pdserve.engine.checkpoint.gguf_reader import GGUFFile

    path = source_file()
    ours = timed(lambda: GGUFFile(path), repeats)
    theirs = timed(lambda: gguf.GGUFReader(path), repeats)
    return [{"what": "open raw GGUF", "new": "pdserve GGUFFile", "old": "gguf.GGUFReader",
             "new_wall_s": ours["wall_s"], "old_wall_s": theirs["wall_s"],
             "ratio": theirs["wall_s"] / ours["wall_s"], "new_sys_s": ours["sys_s"],
             "old_sys_s": theirs["sys_s"]}]


def cache_rows(repeats: int, cache_gb: float) -> list[dict]:
    import torch

    from pdserve.engine.kv_layout import KVLayout
    from pdserve.engine.quant.kv_format import KVCacheFormat

    layout = KVLayout.gqa(30, 3, 64, 16, KVCacheFormat(torch.float32))
    blocks = int(cache_gb * 2**30) // layout.block_bytes()
    shape = layout.cache_shape(blocks, 1)
    cpu = torch.device("cpu")
    ours = timed(lambda: layout.new_caches(blocks, 1, cpu), repeats)
    theirs = timed(lambda: [torch.zeros(shape, dtype=torch.float32) for _ in range(30)],
                   repeats)
    return [{"what": f"CPU KV cache {cache_gb:g} GiB", "new": "calloc (new_caches)",
             "old": "torch.zeros", "new_wall_s": ours["wall_s"], "old_wall_s": theirs["wall_s"],
             "ratio": theirs["wall_s"] / ours["wall_s"], "new_sys_s": ours["sys_s"],
             "old_sys_s": theirs["sys_s"]}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cache-gb", type=float, default=1.0)
    ap.add_argument("--json", default="bench/results/open_costs.json")
    a = ap.parse_args()
    rows = gguf_rows(a.repeats) + cache_rows(a.repeats, a.cache_gb)
    print_table(rows, ["what", "new", "old", "new_wall_s", "old_wall_s", "ratio", "new_sys_s",
                       "old_sys_s"])
    print(f"wrote {write_json(a.json, {'repeats': a.repeats, 'rows': rows})}")


if __name__ == "__main__":
    main()
