"""CUDA graphs for DECODE: one graph per captured batch size, replayed with the batch padded to
the next captured size. Padded rows read request row 0 with length 1 and write their K/V to the
padding slot 0, so they never touch a live request's cache; their logits are dropped.

Needs a graph-safe attention backend (`supports_cuda_graph`): no host-side shapes may depend on
the batch's sequence lengths.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from radixengine.layers.logits_processor import LogitsProcessorOutput
from radixengine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ForwardResources

if TYPE_CHECKING:
    from radixengine.server_args import ServerArgs

logger = logging.getLogger(__name__)


class GraphModelRunner(ForwardResources, Protocol):
    """What the graphs take of the `ModelRunner` that owns them."""

    server_args: ServerArgs
    max_running_requests: int
    model: nn.Module


def capture_batch_sizes(max_bs: int) -> list[int]:
    sizes = [bs for bs in [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 1025, 16)] if bs <= max_bs]
    if not sizes or sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def cuda_graph_supported(model_runner: GraphModelRunner) -> bool:
    args = model_runner.server_args
    return (
        model_runner.device.type == "cuda"
        and not args.disable_cuda_graph
        and getattr(model_runner.attn_backend, "supports_cuda_graph", False)
    )


class CudaGraphRunner:
    def __init__(self, model_runner: GraphModelRunner) -> None:
        self.model_runner = model_runner
        max_bs = min(model_runner.server_args.cuda_graph_max_bs, model_runner.max_running_requests)
        self.capture_bs = capture_batch_sizes(max_bs)
        self.max_bs = self.capture_bs[-1]
        device = model_runner.device
        zeros = lambda: torch.zeros(self.max_bs, dtype=torch.int64, device=device)  # noqa: E731
        self.input_ids, self.req_pool_indices = zeros(), zeros()
        self.out_cache_loc, self.positions = zeros(), zeros()
        self.seq_lens = torch.ones(self.max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, LogitsProcessorOutput] = {}
        start = time.perf_counter()
        self.capture()
        logger.info(
            "CUDA graphs captured for decode batch sizes %s in %.1f s",
            self.capture_bs,
            time.perf_counter() - start,
        )

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return forward_batch.forward_mode.is_decode() and 0 < forward_batch.batch_size <= self.max_bs

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

    def _forward(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        runner = self.model_runner
        runner.attn_backend.init_forward_metadata(fb)
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
        self.graphs[padded].replay()
        # A copy: the graph's output buffer is overwritten by the next replay.
        logits = self.outputs[padded].next_token_logits[:bs].clone()
        return LogitsProcessorOutput(next_token_logits=logits)
