"""LoRAManager: the model worker's adapters. It keeps the loaded adapters in host memory, owns
the slot pool, adds the delta to the target linears' outputs (each linear's `output_delta`,
whatever the base linear is — float, GGUF blocks, AMX; under tensor parallelism with this rank's
slice of each adapter, a row-parallel linear's before the ranks' sum) and, right before each
forward, gives the batch's adapters their slots (`prepare_lora_batch`)."""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable

import torch
from torch import nn

from radixengine.layers.linear import OutputDelta
from radixengine.lora.lora_adapter import BaseShapes, LoRAAdapter, ModuleShape
from radixengine.lora.lora_backend import TRITON_ON_CUDA, apply_lora_delta
from radixengine.lora.lora_batch_info import LoRABatchInfo
from radixengine.lora.lora_config import TARGET_MODULES, LoRAConfig, LoRALoadError
from radixengine.lora.lora_graph import LoRAGraphBuffers
from radixengine.lora.mem_pool import LoRAMemoryPool

DEFAULT_MAX_LORA_RANK = 64
_MODULE = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)")


def base_shapes(model: nn.Module, target_modules: Iterable[str]) -> dict[tuple[int, str], nn.Module]:
    """The base model's linears that adapters may target (by our fused names)."""
    wanted = {TARGET_MODULES[m][0] for m in target_modules}
    found = {}
    for name, module in model.named_modules():
        m = _MODULE.fullmatch(name)
        if m and m[2] in wanted:
            found[(int(m[1]), m[2])] = module
    if not found:
        raise ValueError(
            f"--enable-lora: {type(model).__name__} has no q/k/v/o or gate/up/down linears that LoRA adapters can target"
        )
    return found


def _shape(fused: str, module: nn.Module) -> ModuleShape:
    """The checkpoint's shape of the linear and this rank's slice of it (its loader's)."""
    if fused == "qkv_proj":
        q, kv = module.total_q_size, module.total_kv_size
        return ModuleShape(module.input_size, (q, kv, kv), out_ranges=_out_ranges(module, ("q", "k", "v")))
    if fused == "gate_up_proj":
        sizes = tuple(module.total_output_sizes)
        return ModuleShape(module.input_size, sizes, out_ranges=_out_ranges(module, range(len(sizes))))
    in_range = (module.input_start, module.input_size)
    return ModuleShape(module.total_input_size, (module.output_size,), in_range=in_range)


def _out_ranges(module: nn.Module, shard_ids) -> tuple[tuple[int, int], ...]:
    return tuple(module.shard_offsets(shard_id)[1:] for shard_id in shard_ids)


class LoRAManager:
    def __init__(
        self,
        model: nn.Module,
        max_loras_per_batch: int,
        max_lora_rank: int,
        eviction_policy: str,
        max_loaded_loras: int | None,
        target_modules: Iterable[str] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.target_modules = tuple(target_modules or TARGET_MODULES)
        self.max_loras_per_batch = max_loras_per_batch
        self.max_lora_rank = max_lora_rank
        self.max_loaded_loras = max_loaded_loras
        self.dtype, self.device = dtype, device
        modules = base_shapes(model, self.target_modules)
        self.shapes: BaseShapes = {key: _shape(key[1], m) for key, m in modules.items()}
        self.pool = LoRAMemoryPool(
            self.shapes, max_loras_per_batch, max_lora_rank, eviction_policy, dtype, device
        )
        self.adapters: dict[str, LoRAAdapter] = {}
        self.pinned: set[str] = set()
        self._unloading: set[str] = set()
        self._lock = threading.Lock()
        self.batch_info: LoRABatchInfo | None = None
        for key, module in modules.items():
            module.output_delta = self._delta(key)

    def _delta(self, key: tuple[int, str]) -> OutputDelta:
        a_buf, b_buf = self.pool.buffers[key]
        pieces = list(self.shapes[key].rank_out_sizes)

        def add_delta(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            info = self.batch_info
            if info is None or not info.runs_delta:
                return y
            if y.dtype == a_buf.dtype:
                return apply_lora_delta(x, y, a_buf, b_buf, info, pieces)
            # a 16-bit model's row-parallel partial output, summed over the ranks in float32
            delta = apply_lora_delta(
                x, torch.zeros(y.shape, dtype=x.dtype, device=y.device), a_buf, b_buf, info, pieces
            )
            return y.add_(delta)

        return add_delta

    # ---- CUDA graphs ----

    @property
    def graph_safe(self) -> bool:
        """Whether CUDA graphs may capture the delta: its Triton kernels read device tables only
        (the torch forms' shapes follow the batch's adapters)."""
        return torch.device(self.device).type == "cuda" and TRITON_ON_CUDA

    def graph_buffers(self, max_bs: int) -> LoRAGraphBuffers:
        return LoRAGraphBuffers(max_bs, self.pool.num_slots, torch.device(self.device))

    # ---- adapters in host memory (the scheduler's thread) ----

    def load_adapter(self, lora_id: str, lora_path: str, pinned: bool = False) -> LoRAAdapter:
        config = LoRAConfig.from_folder(resolve_lora_path(lora_path))
        self._check_config(config)
        adapter = LoRAAdapter.load(config, self.shapes, self.dtype)
        with self._lock:
            if lora_id in self.adapters:
                raise LoRALoadError(f"adapter id {lora_id} is already loaded")
            live = len(self.adapters) - len(self._unloading)
            if self.max_loaded_loras is not None and live >= self.max_loaded_loras:
                raise LoRALoadError(f"--max-loaded-loras {self.max_loaded_loras} adapters are already loaded")
            if pinned and len(self.pinned) + 1 >= self.max_loras_per_batch:
                raise LoRALoadError(
                    f"at most --max-loras-per-batch - 1 = {self.max_loras_per_batch - 1} adapters can be pinned"
                )
            self.adapters[lora_id] = adapter
            if pinned:
                self.pinned.add(lora_id)
        return adapter

    def adapter_digest(self, lora_id: str) -> bytes | None:
        """The digest of a loaded adapter's weights (LoRAAdapter.digest); None if not loaded."""
        with self._lock:
            adapter = self.adapters.get(lora_id)
        return None if adapter is None else adapter.digest

    def _check_config(self, config: LoRAConfig) -> None:
        if config.r > self.max_lora_rank:
            raise LoRALoadError(
                f"adapter {config.path}: rank {config.r} exceeds --max-lora-rank {self.max_lora_rank}"
            )
        outside = [m for m in config.split_target_modules if m not in self.target_modules]
        if outside:
            raise LoRALoadError(
                f"adapter {config.path}: target modules {outside} are not in --lora-target-modules "
                f"{list(self.target_modules)}"
            )

    def unload_adapter(self, lora_id: str) -> None:
        """Dropped before the next forward that does not use it (a forward already queued under
        the overlap loop keeps its weights)."""
        with self._lock:
            if lora_id not in self.adapters:
                raise LoRALoadError(f"adapter id {lora_id} is not loaded")
            self._unloading.add(lora_id)
            self.pinned.discard(lora_id)

    # ---- per forward (the forward stream) ----

    def prepare_lora_batch(self, lora_ids: list[str | None], tokens_per_req: list[int]) -> None:
        with self._lock:
            in_batch = {i for i in lora_ids if i is not None}
            for lora_id in self._unloading - in_batch:
                self.adapters.pop(lora_id, None)
                self.pool.drop(lora_id)
            self._unloading &= in_batch
            missing = in_batch - set(self.adapters)
            if missing:
                raise RuntimeError(f"LoRA adapters {sorted(missing)} are not loaded")
            needed = {i: self.adapters[i] for i in sorted(in_batch | self.pinned)}
            slot_of = self.pool.prepare(needed, self.pinned)
        slots = [0 if i is None else slot_of[i] for i in lora_ids]
        ranks = {s: self.pool.rank_of(s) for s in set(slots) if s}
        self.batch_info = LoRABatchInfo.build(slots, tokens_per_req, ranks, self.device)


def resolve_lora_path(path: str) -> str:
    """A folder on disk, or a Hugging Face repo id in the local cache (as models)."""
    if os.path.isdir(path):
        return path
    from radixengine.model_loader import locate_model

    try:
        return locate_model(path, flag="lora_path")
    except (FileNotFoundError, ValueError) as e:
        raise LoRALoadError(str(e)) from None
