"""radixengine: an LLM serving engine with a radix-tree prefix cache, cache-aware scheduling and an
overlap loop. `Engine`, `SamplingParams` and `ServerArgs` are imported lazily, so that
`import radixengine` stays cheap."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "ServerArgs"]

_LAZY = {
    "Engine": "radixengine.engine",
    "SamplingParams": "radixengine.sampling.sampling_params",
    "ServerArgs": "radixengine.server_args",
}

if TYPE_CHECKING:
    from radixengine.engine import Engine
    from radixengine.sampling.sampling_params import SamplingParams
    from radixengine.server_args import ServerArgs


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'radixengine' has no attribute {name!r}")
