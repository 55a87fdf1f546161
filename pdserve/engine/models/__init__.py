"""Model registry: architecture family -> module class."""

from __future__ import annotations

from pdserve.engine.models.deepseek import DeepseekForCausalLM
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.engine.models.moe import MoEForCausalLM
from pdserve.engine.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mixtral": MoEForCausalLM,
    "qwen2_moe": MoEForCausalLM,
    "qwen3_moe": MoEForCausalLM,
    "deepseek_v2": DeepseekForCausalLM,
    "deepseek_v3": DeepseekForCausalLM,
}

__all__ = ["MODEL_CLASSES", "DeepseekForCausalLM", "LlamaForCausalLM", "MoEForCausalLM",
           "Qwen3ForCausalLM"]
