"""The LM head's precision, chosen on its own (`EngineConfig.lm_head_dtype`).

    model   multiply by the weight in the model's dtype (as every model without quantisation)
    bf16    multiply bf16 activations by a bf16 copy of the weight
    int8    multiply fp32 activations by an int8 copy, one scale per vocabulary row
    int4    multiply by a 4-bit copy quantised at load (groups of 128, halved to fit)
    auto    the weight scheme's default (`QuantScheme.default_lm_head`; "model" without one)

A tied LM head shares its weight with the token embedding, which keeps its full-precision rows
for the lookup whatever is chosen; the copies are extra memory then (a half, a quarter or an
eighth of the embedding for bf16, int8, int4); an untied head's dense weight is released
once it has its copy.
"""

from __future__ import annotations

import torch

from pdserve.engine.config import LM_HEAD_DTYPES
from pdserve.engine.layers.embedding import ParallelLMHead
from pdserve.engine.layers.linear import LinearMethod
from pdserve.engine.quant.bf16 import Bf16CopyMethod
from pdserve.engine.quant.int4 import Int4LinearMethod
from pdserve.engine.quant.int8_head import Int8HeadMethod
from pdserve.engine.quant.scheme import QuantScheme


def resolve_lm_head(choice: str, scheme: QuantScheme | None) -> str:
    if choice not in LM_HEAD_DTYPES:
        raise ValueError(f"lm_head_dtype must be one of {LM_HEAD_DTYPES}, got {choice!r}")
    if choice != "auto":
        return choice
    return scheme.default_lm_head if scheme is not None else "model"


def install_lm_head(model: torch.nn.Module, choice: str, tied: bool) -> None:
    """Give the LM head the method for `choice` (a resolved one), before loading."""
    for module in model.modules():
        if isinstance(module, ParallelLMHead):
            method = _method(choice, tied)
            if method is not None:
                module.method = method
                method.prepare(module)


def _method(choice: str, tied: bool) -> LinearMethod | None:
    if choice == "bf16":
        return Bf16CopyMethod(keep_dense=tied)
    if choice == "int8":
        return Int8HeadMethod(keep_dense=tied)
    if choice == "int4":
        return Int4LinearMethod(from_dense=True, keep_dense=tied)
    return None
