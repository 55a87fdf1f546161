"""Building a model and loading a checkpoint's weights into it, one tensor at a time.

The checkpoint (pdserve/engine/checkpoint) hides the file format: it yields Hugging Face
parameter names with dense tensors, or `Int4Weight`s when 4-bit weights are asked for and the
file stores them natively.
"""

from __future__ import annotations

import torch

from pdserve.engine.checkpoint import Checkpoint
from pdserve.engine.model_config import ModelConfig
from pdserve.engine.models import MODEL_CLASSES
from pdserve.engine.parallel import SINGLE, ParallelContext
from pdserve.engine.quant.checkpoint import (
    adapt_fp8_checkpoint,
    install_quantization,
    resolve_quantization,
)


def load_model(checkpoint: Checkpoint, cfg: ModelConfig, dtype: torch.dtype,
               device: torch.device, tp: ParallelContext = SINGLE,
               max_positions: int | None = None,
               quantization: str | None = None) -> torch.nn.Module:
    """Build and load the model; `quantization` ("fp8") quantises its linear layers, and an
    FP8 checkpoint (quantization_config in config.json) is loaded as FP8 whatever it says."""
    scheme = resolve_quantization(quantization, checkpoint.path)
    with torch.device(device):
        model = MODEL_CLASSES[cfg.family](cfg, dtype, tp, max_positions)
        if scheme is not None:  # before loading: FP8 checkpoints load into FP8 parameters
            install_quantization(model, scheme)
    weights = checkpoint.iter_weights(prefer_int4=quantization == "int4")
    if scheme is not None and scheme.serialized:
        weights = adapt_fp8_checkpoint(weights, checkpoint.weight_shapes())
    loaded = model.load_weights(weights)
    expected = {n for n, _ in model.named_parameters()}
    missing = expected - loaded
    if missing:
        raise ValueError(f"checkpoint is missing weights: {sorted(missing)[:5]}")
    for module in model.modules():
        method = getattr(module, "method", None)
        if method is not None:
            method.finalize(module)
    return model.eval()
