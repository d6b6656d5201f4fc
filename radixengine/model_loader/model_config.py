"""ModelConfig: where the model lives, its HF config, dtype and the numbers the engine sizes by."""

from __future__ import annotations

import json
from pathlib import Path

from radixengine.model_loader.model_paths import locate_model, resolve_model_path
from radixengine.model_loader.quantized_checkpoint import QuantConfig
from radixengine.model_loader.weight_utils import resolve_dtype_with_reason


class ModelConfig:
    def __init__(
        self,
        model_path: str | None = None,
        context_length: int | None = None,
        dtype: str = "auto",
        device: str = "cpu",
        revision: str | None = None,
    ) -> None:
        from transformers import AutoConfig

        self.model_path = locate_model(model_path, revision)  # on disk: a folder or a .gguf file
        self.hf_path = resolve_model_path(self.model_path)
        self.hf_config = AutoConfig.from_pretrained(self.hf_path)
        self.quant_config: QuantConfig | None = QuantConfig.from_model(self.hf_config, self.hf_path)
        self.dtype, self.dtype_reason = resolve_dtype_with_reason(dtype, device)
        c = self.hf_config
        self.architectures: list[str] = list(getattr(c, "architectures", None) or [])
        self.hidden_size: int = c.hidden_size
        self.num_hidden_layers: int = c.num_hidden_layers
        self.num_attention_heads: int = c.num_attention_heads
        self.num_key_value_heads: int = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.head_dim: int = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.vocab_size: int = c.vocab_size
        self.context_len: int = self._context_len(context_length)
        self.eos_token_ids: list[int] = self._eos_token_ids()

    def decode_weight_elements(self) -> int:
        """Weights a decode step reads: each layer's attention and MLP (the experts a token uses)
        and the LM head; the embedding table is only looked up."""
        c = self.hf_config
        h = self.hidden_size
        attention = h * self.head_dim * 2 * (self.num_attention_heads + self.num_key_value_heads)
        inter = getattr(c, "moe_intermediate_size", None) or getattr(c, "intermediate_size", None) or 4 * h
        experts = getattr(c, "num_experts_per_tok", None) or 1
        return self.num_hidden_layers * (attention + 3 * h * inter * experts) + self.vocab_size * h

    def _context_len(self, requested: int | None) -> int:
        limit = int(self.hf_config.max_position_embeddings)
        if requested is not None and requested > limit:
            raise ValueError(f"--context-length {requested} exceeds the model's limit {limit}")
        return requested or limit

    def _eos_token_ids(self) -> list[int]:
        ids = _as_list(getattr(self.hf_config, "eos_token_id", None))
        gen = Path(self.hf_path, "generation_config.json")
        if gen.exists():
            ids += _as_list(json.loads(gen.read_text()).get("eos_token_id"))
        return sorted(set(ids))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
