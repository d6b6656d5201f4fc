"""Llama-family model shapes the benchmarks run with random weights (`--load-format dummy`): a
config-only folder per shape, so no checkpoint is needed."""

from __future__ import annotations

import json
from pathlib import Path

MODEL_SHAPES: dict[str, dict] = {
    # hidden 64, 2 layers: the forward is short, so the scheduler's own cost shows
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256,
    ),
    # SmolLM2-135M-Instruct's shapes (the default model)
    "smollm2": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
    ),
    # Llama-3.2-1B's shapes (1.24 B parameters)
    "llama-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    # Llama-3.1-8B's shapes (8.03 B parameters)
    "llama-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
}  # fmt: skip


def write_shape_folder(name: str, root: Path, max_position_embeddings: int = 4096) -> str:
    """A folder holding only config.json for shape `name`; its path."""
    if name not in MODEL_SHAPES:
        raise SystemExit(f"unknown model shape {name!r}; known: {', '.join(MODEL_SHAPES)}")
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "float32",
        **MODEL_SHAPES[name],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)
