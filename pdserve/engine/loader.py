"""Building a model and loading a checkpoint's weights into it, one tensor at a time.

The checkpoint (pdserve/engine/checkpoint) hides the file format: it yields Hugging Face
parameter names with dense tensors, or `Int4Weight`s when 4-bit weights are asked for and the
file stores them natively.
"""

from __future__ import annotations

import torch

from pdserve.engine.checkpoint import Checkpoint
from pdserve.engine.huge_pages import model_tensors, weights_to_huge_pages
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models import MODEL_CLASSES
from pdserve.engine.parallel import SINGLE, ParallelContext
from pdserve.engine.quant.checkpoint import resolve_quantization
from pdserve.engine.quant.lm_head import install_lm_head, resolve_lm_head
from pdserve.engine.quant.scheme import install_quantization


def load_model(checkpoint: Checkpoint, cfg: ModelConfig, dtype: torch.dtype,
               device: torch.device, tp: ParallelContext = SINGLE,
               max_positions: int | None = None,
               quantization: str | None = None, lm_head_dtype: str = "auto",
               fp8_full_precision: tuple[str, ...] | None = None,
               int4_kernel: str = "auto") -> torch.nn.Module:
    """Build and load the model; `quantization` ("fp8", "int4") quantises its linear layers,
    and a quantised checkpoint (quantization_config in config.json) loads as it is stored;
    `lm_head_dtype` picks the LM head's precision (see `quant.lm_head`);
    `fp8_full_precision` the layers FP8 leaves alone (None: its default); `int4_kernel` the
    W4A16 matmul."""
    scheme = resolve_quantization(quantization, checkpoint.path, fp8_full_precision,
                                  int4_kernel, checkpoint.native_quantization())
    with torch.device(device):
        model = MODEL_CLASSES[cfg.family](cfg, dtype, tp, max_positions)
        if scheme is not None:  # before loading: quantised layers load into their own layout
            install_quantization(model, scheme)
        install_lm_head(model, resolve_lm_head(lm_head_dtype, scheme), cfg.tie_word_embeddings)
    # Under W4A16 a format with native 4-bit blocks (GGUF Q4_*) hands them over as Int4Weight.
    int4 = scheme is not None and scheme.family == "int4"
    weights = checkpoint.iter_weights(prefer_int4=int4)
    if scheme is not None:
        weights = scheme.adapt(weights, checkpoint.weight_shapes)
    loaded = model.load_weights(weights)
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
    for name, module in model.named_modules():
        method = getattr(module, "method", None)
        if method is not None:
            try:
                method.finalize(module)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
    if torch.device(device).type == "cpu":  # a decode step streams them all (huge_pages.py)
        weights_to_huge_pages(model_tensors(model))
    return model.eval()
