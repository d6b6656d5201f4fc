"""What this machine can run: a flag choice that cannot work here is refused at start, with the
reason (a device it lacks, an attention backend that is not installed or not for this device, a
dtype the GPU cannot compute in), instead of failing later or silently running something else."""

from __future__ import annotations

import torch

from radixengine.layers.attention.attention_registry import attention_backend_unavailable
from radixengine.server_args import ServerArgs


def runtime_support_error(server_args: ServerArgs) -> str | None:
    """The first flag this machine cannot honour, and why; None when all can be."""
    device = server_args.device
    if device == "cuda" and not torch.cuda.is_available():
        return (
            f"--device cuda: CUDA is not available here (torch {torch.__version__}: "
            "torch.cuda.is_available() is False); use --device cpu or auto"
        )
    if device == "cuda" and server_args.dtype == "bfloat16" and not torch.cuda.is_bf16_supported():
        return "--dtype bfloat16: this GPU does not compute in bfloat16; use float16 or float32"
    if server_args.attention_backend != "auto":
        reason = attention_backend_unavailable(server_args.attention_backend, device)
        if reason is not None:
            return f"--attention-backend {server_args.attention_backend}: {reason}"
    return None


def check_runtime_support(server_args: ServerArgs) -> None:
    error = runtime_support_error(server_args)
    if error is not None:
        raise ValueError(error)
