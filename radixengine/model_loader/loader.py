"""Building a model from a ModelConfig: real weights from safetensors, or random (`dummy`)."""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from radixengine.model_loader.model_config import ModelConfig
from radixengine.model_loader.weight_utils import safetensors_weights_iterator
from radixengine.models import ModelRegistry

logger = logging.getLogger(__name__)


def get_model(model_config: ModelConfig, device: torch.device | str, load_format: str = "auto") -> nn.Module:
    start = time.perf_counter()
    model = _build(model_config, torch.device(device))
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        _load_checkpoint(model, model_config)
    model.eval()
    logger.info("model loaded from %s in %.2f s", model_config.hf_path, time.perf_counter() - start)
    return model


def _build(model_config: ModelConfig, device: torch.device) -> nn.Module:
    model_cls, _ = ModelRegistry.resolve_model_cls(model_config.architectures)
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(model_config.dtype)
    try:
        with device:
            return model_cls(model_config.hf_config)
    finally:
        torch.set_default_dtype(old_dtype)


def _load_checkpoint(model: nn.Module, model_config: ModelConfig) -> None:
    loaded = model.load_weights(safetensors_weights_iterator(model_config.hf_path))
    expected = {name for name, _ in model.named_parameters()}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(
            f"checkpoint {model_config.hf_path} lacks {len(missing)} weights, e.g. {missing[:3]}"
        )


@torch.no_grad()
def init_dummy_weights(model: nn.Module, std: float = 0.02) -> None:
    """Random weights (norms 1, biases 0) for `--load-format dummy`."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:
            param.normal_(0.0, std)
