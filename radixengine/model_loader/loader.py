"""Building a model from a ModelConfig: real weights (safetensors or .bin, AWQ / GPTQ dequantized),
or random (`dummy`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from radixengine.model_loader.gguf_loader import gguf_block_weights_iterator
from radixengine.model_loader.model_config import ModelConfig
from radixengine.model_loader.quantized_checkpoint import dequantized_weights, unquantized_weights
from radixengine.model_loader.weight_utils import weights_iterator
from radixengine.models import ModelRegistry

logger = logging.getLogger(__name__)

# Rows (tokens) up to which a linear reads its GGUF blocks rather than its float32 weight. On the
# 30 layers of SmolLM2 with 2 threads the block kernel is 1.5x MKL's sgemm at 64 rows, 1.2x at
# 128, 1.07x at 256 and 0.87-0.96x from 512 (`benchmarks/bench_quant_linear.py --without-lm-head`).
GGUF_BLOCK_MAX_TOKENS = 256


def get_model(
    model_config: ModelConfig,
    device: torch.device | str,
    load_format: str = "auto",
    gguf_blocks: bool = False,
) -> nn.Module:
    """The model with its weights; `gguf_blocks`: also keep the linears' GGUF blocks (see
    `layers.linear.BlockWeight`), the model must come from a GGUF file."""
    start = time.perf_counter()
    model = _build(model_config, torch.device(device))
    if load_format == "dummy":
        init_dummy_weights(model)
    else:
        _load_checkpoint(model, model_config)
    if gguf_blocks:
        load_gguf_block_weights(model, model_config)
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


MISSING_NAMES_SHOWN = 8


def _load_checkpoint(model: nn.Module, model_config: ModelConfig) -> None:
    """Load every weight; a checkpoint that lacks any (a whole parameter or one part of a fused
    one) is refused, naming what it lacks: the model's memory would stay uninitialised."""
    expected = model.expected_weight_names()
    weights = weights_iterator(model_config.hf_path)
    quant = model_config.quant_config
    if quant is None:
        weights = unquantized_weights(weights, expected)
    else:
        logger.info("%s checkpoint: weights dequantized to %s at load", quant.describe(), model_config.dtype)
        weights = dequantized_weights(weights, quant, expected)
    loaded = model.load_weights(weights)
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:MISSING_NAMES_SHOWN])
        more = f" and {len(missing) - MISSING_NAMES_SHOWN} more" if len(missing) > MISSING_NAMES_SHOWN else ""
        raise ValueError(f"checkpoint {model_config.hf_path} lacks {len(missing)} weight(s): {shown}{more}")


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


def load_gguf_block_weights(model: nn.Module, model_config: ModelConfig) -> int:
    """Attach the GGUF blocks of every linear (and LM head), each shard in its own block type; a
    module keeps them only if every shard is in a type the block kernel runs, else it computes
    with its dequantized float weights (one log line names those tensors and their types).
    Returns the modules kept."""
    from radixengine.layers.gguf_quant_ops import FORMATS

    loads = _BlockLoads()
    tensors = gguf_block_weights_iterator(model_config.model_path, model_config.hf_config, frozenset(FORMATS))
    for name, gguf_name, qtype, rows in tensors:
        tied = getattr(model, "tie_word_embeddings", False)
        if name == ("lm_head.weight" if tied else "model.embed_tokens.weight"):
            continue  # the embedding's blocks serve only as a tied LM head
        loads.attach(model, name, gguf_name, qtype, rows)
    kept = _keep_whole_blocks(model, loads.fallback_modules)
    loads.log()
    logger.info("GGUF block weights for %d modules (batches of at most %d rows)", kept, GGUF_BLOCK_MAX_TOKENS)
    return kept


@dataclass
class _BlockLoads:
    """What attaching the blocks left out: the modules that compute with float weights instead,
    and why (for the log)."""

    no_kernel: dict[str, list[str]] = field(default_factory=dict)  # type name -> GGUF tensors
    unsplit: list[str] = field(default_factory=list)  # GGUF tensors a rank slice would cut blocks of
    fallback_modules: set[str] = field(default_factory=set)

    def attach(self, model: nn.Module, name: str, gguf_name: str, qtype: int, rows) -> None:
        """Hand one tensor's blocks (`rows`; None: a type without a kernel) to its module."""
        import gguf

        from radixengine.layers.linear import BlockShardError

        param_name, shard_id = model._param_for(name)
        module_name = param_name.rsplit(".", 1)[0]
        module = model.get_submodule(module_name)
        if not hasattr(module, "block_weight_loader"):
            return
        if rows is None:
            if qtype != gguf.GGMLQuantizationType.F32:
                self.no_kernel.setdefault(gguf.GGMLQuantizationType(qtype).name, []).append(gguf_name)
            self.fallback_modules.add(module_name)
            return
        try:
            module.block_weight_loader(rows, qtype, GGUF_BLOCK_MAX_TOKENS, shard_id)
        except BlockShardError as e:
            self.unsplit.append(f"{gguf_name} ({e})")
            self.fallback_modules.add(module_name)

    def log(self) -> None:
        if self.no_kernel:
            logger.info(
                "GGUF tensors in types without a block kernel use dequantized float32 weights: %s",
                "; ".join(f"{t}: {_names(names)}" for t, names in sorted(self.no_kernel.items())),
            )
        if self.unsplit:
            logger.warning(
                "GGUF tensors that cannot be split over the TP ranks in whole blocks use dequantized "
                "float32 weights: %s",
                _names(self.unsplit),
            )


def _keep_whole_blocks(model: nn.Module, fallback_modules: set[str]) -> int:
    """Drop the blocks of the modules that fall back, or whose blocks do not cover every output
    row; returns how many modules keep theirs."""
    kept = 0
    for module_name, module in model.named_modules():
        block = getattr(module, "block_weight", None)
        if block is None:
            continue
        if module_name in fallback_modules or not block.covers(module.weight.shape[0]):
            module.block_weight = None
        else:
            kept += 1
    return kept


NAMES_SHOWN = 6


def _names(names: list[str]) -> str:
    more = f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
    return ", ".join(names[:NAMES_SHOWN]) + more
