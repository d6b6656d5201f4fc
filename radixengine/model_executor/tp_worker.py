"""TpModelWorker: ModelWorkerBatch -> ForwardBatch -> forward -> sample (one device, no TP)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixengine.layers.forward_logprobs import ForwardLogprobs
from radixengine.layers.logits_processor import LogitsProcessorOutput
from radixengine.model_executor.forward_batch_info import ForwardBatch, ModelWorkerBatch
from radixengine.model_executor.model_runner import ModelRunner
from radixengine.model_executor.runtime_support import check_runtime_support
from radixengine.server_args import ServerArgs
from radixengine.speculative.spec_tree import DraftTrees
from radixengine.speculative.spec_verify import (
    VerifyResult,
    cumulate_accepted,
    takes_argmax_only,
    verify_tree,
    verify_tree_argmax,
)
from radixengine.utils.fault_injection import fault_point

# Tests only (as SGLang's SGLANG_TEST_STUCK_* variables): every forward first sleeps this many
# seconds, a forward that hangs, for the --watchdog-timeout test.
TEST_FORWARD_STALL_ENV = "RADIXENGINE_TEST_FORWARD_STALL_S"


@dataclass
class GenerationBatchResult:
    next_token_ids: torch.Tensor | None  # int64 [bs], on the model's device; None until sampled
    invalid_rows: torch.Tensor | None = None  # bool [bs]: nothing to sample (NaN logits); None if none
    # The logprob results the requests asked for (see LogitsProcessorOutput); None when none did.
    logprobs: ForwardLogprobs[torch.Tensor] | None = None
    delay_sample_func: Callable[[], GenerationBatchResult] | None = None
    # TARGET_VERIFY: the accepted drafts and the bonus token of each request (next_token_ids is
    # then its output_ids, [bs, n], -1 after the bonus).
    verify: VerifyResult | None = None


@dataclass
class WorkerInfo:
    max_total_num_tokens: int
    max_running_requests: int
    max_req_len: int  # prompt + output tokens of one request
    max_req_input_len: int
    context_len: int
    vocab_size: int
    eos_token_ids: list[int]
    page_size: int
    device: str
    amx_linear_layers: int = 0  # linears computing from AMX-packed bf16 weights (layers/amx_linear.py)
    dpbf16_linear_layers: int = 0  # linears computing from AVX512-BF16 dot products (layers/dpbf16_linear.py)
    bf16_panel_linear_layers: int = 0  # linears computing from bf16 panels (layers/bf16_linear.py)
    linear_kernel: str = "torch"  # amx, dpbf16, bf16_panels or torch (layers/cpu_linear_plan.py)
    linear_kernel_reason: str = ""
    resolved_dtype: str = ""  # the compute dtype --dtype resolved to, and why
    resolved_dtype_reason: str = ""
    resolved_kv_cache_dtype: str = ""


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, model_runner: ModelRunner | None = None) -> None:
        self.server_args = server_args
        if model_runner is None:
            check_runtime_support(server_args)
            model_runner = ModelRunner(server_args)
        self.model_runner = model_runner
        self.test_forward_stall_s = float(os.environ.get(TEST_FORWARD_STALL_ENV, "0"))
        runner = self.model_runner
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.max_running_requests = runner.max_running_requests
        self.max_req_len = min(runner.context_len - 1, self.max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.device = runner.device

    def get_worker_info(self) -> WorkerInfo:
        runner = self.model_runner
        return WorkerInfo(
            max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            max_req_len=self.max_req_len,
            max_req_input_len=self.max_req_input_len,
            context_len=runner.context_len,
            vocab_size=runner.model_config.vocab_size,
            eos_token_ids=list(runner.model_config.eos_token_ids),
            page_size=runner.page_size,
            device=str(runner.device),
            amx_linear_layers=runner.amx_linears,
            bf16_panel_linear_layers=runner.bf16_panel_linears,
            dpbf16_linear_layers=runner.dpbf16_linears,
            linear_kernel=runner.linear_kernel,
            linear_kernel_reason=runner.linear_kernel_reason,
            resolved_dtype=str(runner.dtype).removeprefix("torch."),
            resolved_dtype_reason=runner.model_config.dtype_reason,
            resolved_kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
        )

    def num_shared_prefix_forwards(self) -> int:
        """Forwards whose decode attention ran the shared-prefix pass (0: a backend without it)."""
        return getattr(self.model_runner.attn_backend, "num_shared_prefix_forwards", 0)

    def load_lora_adapter(self, lora_id: str, lora_path: str, pinned: bool) -> None:
        """Into host memory (docs/lora.md); raises `LoRALoadError` naming what is refused."""
        self._lora_manager().load_adapter(lora_id, lora_path, pinned)

    def unload_lora_adapter(self, lora_id: str) -> None:
        self._lora_manager().unload_adapter(lora_id)

    def lora_adapter_digest(self, lora_id: str) -> bytes | None:
        """The digest of a loaded adapter's weights; None if it is not loaded (or LoRA is off)."""
        manager = self.model_runner.lora_manager
        return None if manager is None else manager.adapter_digest(lora_id)

    def _lora_manager(self):
        if self.model_runner.lora_manager is None:
            raise ValueError("LoRA is not enabled (start the server with --enable-lora)")
        return self.model_runner.lora_manager

    def get_memory_pool(self):
        """`(req_to_token_pool, token_to_kv_pool_allocator)`."""
        return self.model_runner.req_to_token_pool, self.model_runner.token_to_kv_pool_allocator

    def forward_batch_generation(
        self, model_worker_batch: ModelWorkerBatch, delay_sample: bool = False
    ) -> GenerationBatchResult:
        """Forward and sample; with `delay_sample` (the overlap loop, a batch with a grammar) only
        the forward: the result's `delay_sample_func` samples later, once the masks are filled."""
        if self.test_forward_stall_s:
            time.sleep(self.test_forward_stall_s)
        fault_point("forward")
        forward_batch = ForwardBatch.init_new(model_worker_batch, self.model_runner)
        logits_output = self.model_runner.forward(forward_batch)
        result = GenerationBatchResult(next_token_ids=None)
        trees = model_worker_batch.spec_trees
        if trees is not None:
            if delay_sample:
                result.delay_sample_func = lambda: self._verify(logits_output, forward_batch, trees)
                return result
            return self._verify(logits_output, forward_batch, trees)

        def sample() -> GenerationBatchResult:
            fault_point("sample")
            result.next_token_ids = self.model_runner.sample(logits_output, forward_batch)
            result.invalid_rows = logits_output.invalid_rows
            if forward_batch.return_logprob:
                result.logprobs = logits_output.logprobs
            result.delay_sample_func = None
            return result

        if delay_sample:
            result.delay_sample_func = sample
            return result
        return sample()

    @torch.no_grad()
    def _verify(
        self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch, trees: DraftTrees
    ) -> GenerationBatchResult:
        """A verify forward's logits (one row per draft node) against the drafts: the accepted
        tokens and the bonus token of each request, as the sampler would have drawn them."""
        fault_point("sample")
        logits = logits_output.next_token_logits
        info = forward_batch.sampling_info
        verify = None
        if takes_argmax_only(info, forward_batch.return_logprob):
            verify = verify_tree_argmax(logits, trees)
        if verify is None:
            padded = logits.new_zeros((trees.batch_size, trees.width, logits.shape[-1]))
            padded[trees.valid()] = logits
            top = max(forward_batch.top_logprobs_nums or [0])
            verify = verify_tree(padded, trees, info, forward_batch.return_logprob, top)
        cumulate_accepted(info.output_token_counts_out, verify)
        return GenerationBatchResult(
            next_token_ids=verify.output_ids, invalid_rows=verify.invalid_rows, verify=verify
        )
