"""LlamaForCausalLM: Llama 2/3, SmolLM/SmolLM2, Mistral (its sliding window applied in attention)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixengine.layers.activation import SiluAndMul
from radixengine.layers.attention.base_attn_backend import FusedSetKVBufferArg, fused_set_kv_buffer_arg
from radixengine.layers.layernorm import RMSNorm
from radixengine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixengine.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
from radixengine.layers.radix_attention import RadixAttention, sliding_window_size
from radixengine.layers.rotary_embedding import RotaryEmbedding, get_rope, partial_rotary_dim, rope_config
from radixengine.layers.vocab_embedding import LMHead, VocabEmbedding

if TYPE_CHECKING:
    from radixengine.layers.forward_batch_view import ForwardBatchView


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, total_heads, total_kv_heads, self.qkv_bias(config)
        )
        # This rank's heads (all of them with one rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(
            total_heads * self.head_dim, config.hidden_size, self.o_bias(config), self.qkv_proj.q_range
        )
        self.rotary_emb = self.make_rotary_emb(config, layer_id)
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.attn_scaling(config),
            self.num_kv_heads,
            layer_id,
            logit_cap=self.logit_cap(config),
            sliding_window_size=sliding_window_size(config, layer_id),
        )

    def make_rotary_emb(self, config, layer_id: int) -> RotaryEmbedding:
        theta, scaling = rope_config(config)
        rotary_dim = partial_rotary_dim(config, self.head_dim)
        return get_rope(self.head_dim, rotary_dim, config.max_position_embeddings, theta, scaling)

    def attn_scaling(self, config) -> float:
        return self.head_dim**-0.5

    def logit_cap(self, config) -> float:
        return 0.0

    def qkv_bias(self, config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def o_bias(self, config) -> bool:
        return bool(getattr(config, "attention_bias", False))

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch: ForwardBatchView
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = self.split_qk_v(qkv)
        qk = self.norm_qk(qk)
        kv_write = self.fused_kv_write(positions, qk, v, forward_batch)
        qk = self.rotary_emb(positions, qk, kv_write)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn(q, k, v, forward_batch, save_kv_cache=kv_write is None)
        return self.o_proj(out)

    def fused_kv_write(
        self, positions: torch.Tensor, qk: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatchView
    ) -> FusedSetKVBufferArg | None:
        """The K/V write the Triton rotary does in its own launch; None: the attention writes it."""
        if not self.rotary_emb.runs_triton(positions, qk):
            return None
        return fused_set_kv_buffer_arg(qk[:, self.num_heads :], v, self.attn, forward_batch)

    def split_qk_v(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.num_heads + self.num_kv_heads
        return qkv[:, :n], qkv[:, n:]

    def norm_qk(self, qk: torch.Tensor) -> torch.Tensor:
        return qk


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(self, config, layer_id: int) -> None:
        super().__init__()
        self.self_attn = self.attention_cls(config, layer_id)
        mlp_bias = bool(getattr(config, "mlp_bias", False))
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, bias=mlp_bias)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatchView,
        residual: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    layer_cls = LlamaDecoderLayer

    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatchView
    ) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    model_cls = LlamaModel
    supports_tp = True  # every layer is split over the tensor-parallel ranks

    # (fused parameter, checkpoint name, shard id)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = self.model_cls(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        self.logits_processor = LogitsProcessor(
            config.vocab_size, getattr(config, "final_logit_softcapping", None)
        )

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatchView
    ) -> LogitsProcessorOutput:
        hidden_states = self.model(input_ids, positions, forward_batch)
        return self.logits_processor(hidden_states, self.lm_head, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; returns the checkpoint names
        loaded, to compare with `expected_weight_names` (a fused parameter counts as loaded only
        when each of its parts is)."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if _skip(name) or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            param_name, shard_id = self._param_for(name)
            if param_name not in params:
                raise KeyError(f"checkpoint tensor {name} has no parameter in {type(self).__name__}")
            param = params[param_name]
            tensor = tensor.to(param.dtype)
            if shard_id is not None or not _adopt(param, tensor):
                owner = self.get_submodule(param_name.rsplit(".", 1)[0])
                weight_loader = getattr(owner, "weight_loader", default_weight_loader)
                weight_loader(param, tensor, shard_id)
            loaded.add(name)
        return loaded

    def expected_weight_names(self) -> set[str]:
        """The checkpoint names a complete checkpoint loads: every parameter, each fused one as
        its parts (`qkv_proj` as `q_proj`, `k_proj` and `v_proj`)."""
        names: set[str] = set()
        for param_name, _ in self.named_parameters():
            parts = [
                param_name.replace(fused + ".", part + ".")
                for fused, part, _ in self.stacked_params_mapping
                if fused + "." in param_name
            ]
            names.update(parts or [param_name])
        return names

    def _param_for(self, name: str) -> tuple[str, object]:
        for fused, part, shard_id in self.stacked_params_mapping:
            if part + "." in name:
                return name.replace(part + ".", fused + "."), shard_id
        return name, None


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def _adopt(param: nn.Parameter, loaded: torch.Tensor) -> bool:
    """Use the loaded tensor itself as the parameter's storage when it fits (saves a copy)."""
    fits = param.shape == loaded.shape and param.device == loaded.device and loaded.is_contiguous()
    if fits:
        param.data = loaded
    return fits


def _skip(name: str) -> bool:
    return "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name


EntryClass = [LlamaForCausalLM]
