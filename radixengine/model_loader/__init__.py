"""Model loading: HF folders (safetensors, .bin, AWQ / GPTQ), GGUF files, Hugging Face cache ids;
tokenizers; the default model."""

from __future__ import annotations

from radixengine.model_loader.default_model import default_model_path
from radixengine.model_loader.loader import get_model, init_dummy_weights
from radixengine.model_loader.model_config import ModelConfig
from radixengine.model_loader.model_paths import (
    locate_model,
    resolve_model_path,
    resolve_tokenizer_path,
)
from radixengine.model_loader.weight_utils import resolve_dtype


def get_tokenizer(
    model_path: str | None = None, revision: str | None = None, tokenizer_path: str | None = None, **kwargs
):
    """`transformers.AutoTokenizer` of the model (or of `tokenizer_path`): an HF folder, a GGUF
    file (its converted cache) or a Hugging Face repo id in the local cache."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        resolve_tokenizer_path(model_path, tokenizer_path, revision), **kwargs
    )


__all__ = [
    "ModelConfig",
    "default_model_path",
    "get_model",
    "get_tokenizer",
    "init_dummy_weights",
    "locate_model",
    "resolve_dtype",
    "resolve_model_path",
    "resolve_tokenizer_path",
]
