"""RadixAttention: the model-side attention layer; the backend in the ForwardBatch does the work."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from radixengine.layers.forward_batch_view import ForwardBatchView


def sliding_window_size(config, layer_id: int) -> int:
    """RadixAttention's `sliding_window_size` for layer `layer_id` of an HF config: the HF
    `sliding_window` minus one for a sliding layer (`layer_types`, or every layer of a model with
    a window and no layer types, as Mistral and Phi-3), -1 for a global one."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return -1
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) - 1 if layer_types[layer_id] == "sliding_attention" else -1
    return int(window) - 1 if getattr(config, "use_sliding_window", True) else -1


class RadixAttention(nn.Module):
    """`logit_cap` > 0: scores soft-capped to `cap * tanh(score / cap)` before the softmax (Gemma 2).
    `sliding_window_size` >= 0: a query at position p sees only the keys at positions
    p - sliding_window_size .. p (SGLang's convention: an HF `sliding_window` of W is W - 1 here);
    -1: every earlier key."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scaling: float,
        num_kv_heads: int,
        layer_id: int,
        logit_cap: float = 0.0,
        sliding_window_size: int = -1,
    ) -> None:
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.qk_head_dim = head_dim
        self.v_head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.logit_cap = float(logit_cap or 0.0)
        self.sliding_window_size = -1 if sliding_window_size is None else int(sliding_window_size)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        forward_batch: ForwardBatchView,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q `[T, H, D]`, k and v `[T, Hkv, D]` -> `[T, H * D]`."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)
