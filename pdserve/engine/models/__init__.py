"""Model registry: architecture family -> module class (all Llama-shaped today)."""

from __future__ import annotations

from pdserve.engine.models.llama import LlamaForCausalLM

MODEL_CLASSES = {"llama": LlamaForCausalLM, "mistral": LlamaForCausalLM, "qwen2": LlamaForCausalLM}

__all__ = ["MODEL_CLASSES", "LlamaForCausalLM"]
