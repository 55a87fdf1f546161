"""Quantisation for the engine: FP8 (E4M3) linear layers and the FP8 paged-KV format.

- `fp8`: the W8A8 `LinearMethod` (per-output-channel weight scales, dynamic per-token
  activation scales, `torch._scaled_mm`).
- `checkpoint`: which scheme a model runs (requested, or read from the checkpoint's
  `quantization_config`), installing it on the linear layers, routing `weight_scale` tensors.
- `kv_fp8`: pack/unpack of FP8 K/V rows with their scale (pure torch, shared by backends).
- `kv_format`: the description of a cache layout (storage dtype, row width, block-hash key).
"""
