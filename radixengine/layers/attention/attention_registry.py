"""Attention backends, chosen by name (`--attention-backend`)."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os

import torch

from radixengine.layers.attention.base_attn_backend import AttentionBackend

logger = logging.getLogger(__name__)

# name -> "module:Class"; imported on first use so optional dependencies stay optional.
ATTENTION_BACKENDS: dict[str, str] = {
    "torch_native": "radixengine.layers.attention.torch_native_backend:TorchNativeAttnBackend",
    "native_cpu": "radixengine.layers.attention.native_cpu_backend:NativeCpuAttnBackend",
    "triton": "radixengine.layers.attention.triton_backend:TritonAttnBackend",
}

# SGLang's backend names that --attention-backend accepts but this build does not implement:
# refused at start with the reason, never picked by `auto`.
UNIMPLEMENTED_BACKENDS: dict[str, str] = {
    "flashinfer": (
        "radixengine has no flashinfer backend yet; on CUDA use --attention-backend triton "
        "(what auto picks there) or torch_native"
    ),
}


def register_attention_backend(name: str, target: str) -> None:
    ATTENTION_BACKENDS[name] = target


def resolve_attention_backend(
    name: str, device: str, dtype: torch.dtype | None = None, head_dim: int | None = None
) -> str:
    """`auto`: on CUDA triton when it is installed; on a CPU native_cpu when its kernels are built
    and cover the model; else torch_native."""
    if name != "auto":
        return name
    if device == "cpu" and dtype is not None and head_dim is not None:
        from radixengine.layers.attention import native_cpu_ops

        if native_cpu_ops.native_supports(dtype, head_dim):
            return "native_cpu"
        logger.info(
            "attention backend: torch_native (%s)",
            native_cpu_ops.native_unavailable_reason()
            or f"no native kernel for {dtype} / head_dim {head_dim}",
        )
    if device == "cuda" and _available("triton"):
        return "triton"
    return "torch_native"


def attention_backend_unavailable(name: str, device: str) -> str | None:
    """Why backend `name` cannot run on `device` here (not implemented, not installed, wrong device);
    None if it can."""
    if name in UNIMPLEMENTED_BACKENDS:
        return UNIMPLEMENTED_BACKENDS[name]
    if name not in ATTENTION_BACKENDS:
        return f"unknown attention backend {name!r}; known: {', '.join(ATTENTION_BACKENDS)}"
    if not _available(_module(name)):
        return f"radixengine has no {name} attention backend ({_module(name)} is missing)"
    if name == "triton":
        interpreted = device == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"  # tests, slowly
        if device != "cuda" and not interpreted:
            return f"the {name} backend runs on CUDA only (the device is {device})"
        if not _available(name):
            return f"the {name} package is not installed"
    if name == "native_cpu":
        if device != "cpu":
            return f"the native_cpu backend runs on a CPU only (the device is {device})"
        from radixengine.layers.attention import native_cpu_ops

        return native_cpu_ops.native_unavailable_reason()
    return None


def create_attention_backend(name: str, model_runner) -> AttentionBackend:
    device = str(model_runner.device.type)
    name = resolve_attention_backend(name, device, model_runner.dtype, model_runner.model_config.head_dim)
    reason = attention_backend_unavailable(name, device)
    if reason is not None:
        raise ValueError(f"--attention-backend {name}: {reason}")
    module_name, cls_name = ATTENTION_BACKENDS[name].split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise RuntimeError(f"attention backend {name!r} is not available: {e}") from e
    return getattr(module, cls_name)(model_runner)


def _module(name: str) -> str:
    return ATTENTION_BACKENDS[name].split(":")[0]


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False
