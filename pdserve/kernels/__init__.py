"""Triton kernels (GPU; on a CPU under TRITON_INTERPRET=1) with torch references as oracles.

- `paged_attention`: paged decode attention (split-KV) and multi-token causal attention.
- `kv_write`: storing new K/V into the paged cache at slot_mapping.
- `fp8`: per-token dynamic FP8 activation quantisation, per-channel weight quantisation.
- `w4a16`: 4-bit weight x 16-bit activation matmul; `int4_pack` its weight layout and torch
  reference (pure torch).
- `runtime`: where kernels can run, launch-shape helpers.

Submodules import triton; import them directly (this package's __init__ imports nothing), so
that TRITON_INTERPRET can still be set before the first kernel is defined.
"""
