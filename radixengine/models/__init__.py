"""Model registry keyed by the HF config's `architectures`."""

from __future__ import annotations

import importlib

from torch import nn

# architecture -> "module:Class"
_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "radixengine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "radixengine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "radixengine.models.qwen2:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "radixengine.models.qwen3:Qwen3ForCausalLM",
    "Gemma2ForCausalLM": "radixengine.models.gemma2:Gemma2ForCausalLM",
    "Gemma3ForCausalLM": "radixengine.models.gemma3:Gemma3ForCausalLM",
    "Phi3ForCausalLM": "radixengine.models.phi3:Phi3ForCausalLM",
    "Qwen2MoeForCausalLM": "radixengine.models.qwen2_moe:Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM": "radixengine.models.qwen3_moe:Qwen3MoeForCausalLM",
    "MixtralForCausalLM": "radixengine.models.mixtral:MixtralForCausalLM",
}


class ModelRegistry:
    @staticmethod
    def get_supported_archs() -> list[str]:
        return sorted(_MODELS)

    @staticmethod
    def register(arch: str, target: str) -> None:
        _MODELS[arch] = target

    @staticmethod
    def resolve_model_cls(architectures: list[str] | None) -> tuple[type[nn.Module], str]:
        for arch in architectures or []:
            if arch in _MODELS:
                module_name, cls_name = _MODELS[arch].split(":")
                return getattr(importlib.import_module(module_name), cls_name), arch
        raise ValueError(
            f"model architecture(s) {architectures} not supported; "
            f"supported: {', '.join(ModelRegistry.get_supported_archs())}"
        )


__all__ = ["ModelRegistry"]
