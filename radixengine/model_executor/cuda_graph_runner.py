"""CUDA graphs for DECODE: one graph per captured batch size, replayed with the batch padded to
the next captured size. Padded rows read request row 0 with length 1 and write their K/V to the
padding slot 0, so they never touch a live request's cache; their logits are dropped.

The sizes are SGLang's buckets (1, 2, 4, 8, 12, then every 8 to 256, every 16 above) up to
`--cuda-graph-max-bs` (512 by default), `--max-running-requests`, and what the graphs' memory
pool can take: the largest graph's activations, estimated per row from the model's shapes, must
fit in a quarter of the GPU memory free after the KV pool. A larger batch runs eagerly, and the
log says so once.

Needs a graph-safe attention backend (`supports_cuda_graph`): no host-side shapes may depend on
the batch's sequence lengths. With LoRA adapters the graphs capture the delta's Triton kernels
over static block tables, refilled from the batch's `LoRABatchInfo` before each replay
(lora/lora_graph.py); padded rows have no adapter.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from radixengine.layers.logits_processor import LogitsProcessorOutput
from radixengine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ForwardResources

if TYPE_CHECKING:
    from radixengine.lora.lora_manager import LoRAManager
    from radixengine.model_loader.model_config import ModelConfig
    from radixengine.server_args import ServerArgs

logger = logging.getLogger(__name__)


class GraphModelRunner(ForwardResources, Protocol):
    """What the graphs take of the `ModelRunner` that owns them."""

    server_args: ServerArgs
    max_running_requests: int
    model: nn.Module
    model_config: ModelConfig
    dtype: torch.dtype
    lora_manager: LoRAManager | None


def capture_batch_sizes(max_bs: int) -> list[int]:
    sizes = [bs for bs in [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 1025, 16)] if bs <= max_bs]
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


# Of the GPU memory free after the pools, the share the graphs' activations may take.
GRAPH_MEMORY_FRACTION = 0.25


@dataclass(frozen=True)
class DecodeShapes:
    """What one decode row's activations are made of (ModelConfig has these fields)."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int


def decode_row_bytes(shapes: DecodeShapes, dtype_bytes: int) -> int:
    """A generous estimate of one decode row's live activations in a captured forward: fp32
    logits, the gate/up and q/k/v outputs, a few hidden-size buffers, the attention's splits;
    doubled for the allocator's rounding."""
    s = shapes
    qkv = (s.num_attention_heads + 2 * s.num_key_value_heads) * s.head_dim
    per_row = 4 * s.vocab_size + dtype_bytes * (2 * s.intermediate_size + qkv + 6 * s.hidden_size)
    per_row += 4 * s.num_attention_heads * 16 * (s.head_dim + 1)  # split-KV partials
    return 2 * per_row


def graph_max_bs(requested: int, max_running_requests: int, free_bytes: int | None, row_bytes: int) -> int:
    """The largest batch captured: `--cuda-graph-max-bs`, no more than can run, and no more than
    the memory bound (`free_bytes` None: not known, no bound)."""
    max_bs = min(requested, max_running_requests)
    if free_bytes is not None:
        max_bs = min(max_bs, max(1, int(free_bytes * GRAPH_MEMORY_FRACTION) // row_bytes))
    return max(1, max_bs)


def cuda_graph_supported(model_runner: GraphModelRunner) -> bool:
    args = model_runner.server_args
    return (
        model_runner.device.type == "cuda"
        and not args.disable_cuda_graph
        and getattr(model_runner.attn_backend, "supports_cuda_graph", False)
    )


class CudaGraphRunner:
    def __init__(self, model_runner: GraphModelRunner, free_bytes: int | None = None) -> None:
        """`free_bytes`: the device memory free for the graphs (default: asked of CUDA)."""
        self.model_runner = model_runner
        requested = model_runner.server_args.cuda_graph_max_bs
        if free_bytes is None and model_runner.device.type == "cuda":
            free_bytes = torch.cuda.mem_get_info(model_runner.device)[0]
        row_bytes = decode_row_bytes(decode_shapes(model_runner), model_runner.dtype.itemsize)
        max_bs = graph_max_bs(requested, model_runner.max_running_requests, free_bytes, row_bytes)
        if max_bs < min(requested, model_runner.max_running_requests):
            logger.info(
                "CUDA graphs up to batch %d, not %d: %.2f GiB free, about %.1f MiB a row "
                "(--cuda-graph-max-bs lowers it; graphs may take %.0f%% of the free memory)",
                max_bs,
                min(requested, model_runner.max_running_requests),
                (free_bytes or 0) / 2**30,
                row_bytes / 2**20,
                100 * GRAPH_MEMORY_FRACTION,
            )
        self.capture_bs = capture_batch_sizes(max_bs)
        self._told_too_large = False
        self.max_bs = self.capture_bs[-1]
        device = model_runner.device
        zeros = lambda: torch.zeros(self.max_bs, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.req_pool_indices = zeros(), zeros()
        self.out_cache_loc, self.positions = zeros(), zeros()
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, LogitsProcessorOutput] = {}
        lora = model_runner.lora_manager
        self.lora_graph = None if lora is None else lora.graph_buffers(self.max_bs)
        start = time.perf_counter()
        self.capture()
        logger.info(
            "CUDA graphs captured for decode batch sizes %s in %.1f s",
            self.capture_bs,
            time.perf_counter() - start,
        )

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        if not forward_batch.forward_mode.is_decode() or forward_batch.batch_size <= 0:
            return False
        if forward_batch.batch_size <= self.max_bs:
            return True
        if not self._told_too_large:
            self._told_too_large = True
            logger.warning(
                "decode batch %d is above the largest CUDA graph (%d): it runs eagerly, much slower "
                "(raise --cuda-graph-max-bs; said once)",
                forward_batch.batch_size,
                self.max_bs,
            )
        return False

    @torch.no_grad()
    def capture(self) -> None:
        pool = None
        stream = torch.cuda.Stream(self.model_runner.device)
        # Largest first: the smaller graphs then fit in the memory pool the largest one made.
        for bs in reversed(self.capture_bs):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks kernels
                    self._forward(self._static_batch(bs))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # Fresh views of the static buffers: a per-forward cache keyed by the input tensors
            # (RoPE's cos/sin) must be recomputed inside the graph, not reused from the warm-up.
            fb = self._static_batch(bs)
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out = self._forward(fb)
            pool = graph.pool()
            self.graphs[bs], self.outputs[bs] = graph, out
        torch.cuda.synchronize(self.model_runner.device)
        if self.lora_graph is not None:  # eager forwards prepare their own
            self.model_runner.lora_manager.batch_info = None

    def _forward(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        runner = self.model_runner
        runner.attn_backend.init_forward_metadata(fb)
        if self.lora_graph is not None:
            runner.lora_manager.batch_info = self.lora_graph.captured_info(fb.batch_size)
        return runner.model(fb.input_ids, fb.positions, fb)

    def _static_batch(self, bs: int) -> ForwardBatch:
        runner = self.model_runner
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=[1] * bs,
            seq_lens_sum=bs,
            out_cache_loc=self.out_cache_loc[:bs],
            positions=self.positions[:bs],
            req_to_token_pool=runner.req_to_token_pool,
            token_to_kv_pool=runner.token_to_kv_pool,
            attn_backend=runner.attn_backend,
        )

    def replay(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        bs = forward_batch.batch_size
        padded = self.capture_bs[bisect.bisect_left(self.capture_bs, bs)]
        if padded > bs:
            self.input_ids[bs:padded].zero_()
            self.req_pool_indices[bs:padded].zero_()
            self.out_cache_loc[bs:padded].zero_()
            self.positions[bs:padded].zero_()
            self.seq_lens[bs:padded].fill_(1)
        self.input_ids[:bs].copy_(forward_batch.input_ids, non_blocking=True)
        self.req_pool_indices[:bs].copy_(forward_batch.req_pool_indices, non_blocking=True)
        self.seq_lens[:bs].copy_(forward_batch.seq_lens, non_blocking=True)
        self.out_cache_loc[:bs].copy_(forward_batch.out_cache_loc, non_blocking=True)
        self.positions[:bs].copy_(forward_batch.positions, non_blocking=True)
        if self.lora_graph is not None:  # the batch's LoRA info: prepared before this forward
            self.lora_graph.fill(self.model_runner.lora_manager.batch_info, padded)
        self.graphs[padded].replay()
        # A copy: the graph's output buffer is overwritten by the next replay.
        logits = self.outputs[padded].next_token_logits[:bs].clone()
        return LogitsProcessorOutput(next_token_logits=logits)


def decode_shapes(model_runner: GraphModelRunner) -> DecodeShapes:
    c = model_runner.model_config
    inter = getattr(c.hf_config, "intermediate_size", None) or 4 * c.hidden_size
    return DecodeShapes(
        c.hidden_size, inter, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size
    )
