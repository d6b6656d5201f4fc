"""Model loading: HF folders (safetensors) and GGUF files; tokenizers; the default model."""

from __future__ import annotations

from radixengine.model_loader.default_model import default_model_path
from radixengine.model_loader.loader import get_model, init_dummy_weights
from radixengine.model_loader.model_config import ModelConfig, resolve_model_path
from radixengine.model_loader.weight_utils import resolve_dtype


def get_tokenizer(model_path: str | None = None, **kwargs):
    """`transformers.AutoTokenizer` for an HF folder or a GGUF file (its converted cache)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_path(model_path), **kwargs)


__all__ = [
    "ModelConfig",
    "default_model_path",
    "get_model",
    "get_tokenizer",
    "init_dummy_weights",
    "resolve_dtype",
    "resolve_model_path",
]
