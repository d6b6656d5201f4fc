"""ModelRunner: loads the model, sizes and owns the KV pools, runs forward passes and sampling."""

from __future__ import annotations

import logging

import psutil
import torch

from radixengine.distributed import get_tp_group, tensor_model_parallel_all_reduce_min
from radixengine.layers.attention.attention_registry import create_attention_backend
from radixengine.layers.linear import head_ranges
from radixengine.layers.logits_processor import LogitsProcessorOutput
from radixengine.layers.sampler import Sampler, argmax_rows, logprobs_of
from radixengine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixengine.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixengine.model_executor.forward_batch_info import ForwardBatch
from radixengine.model_executor.lora_setup import make_lora_manager
from radixengine.model_loader import ModelConfig, get_model
from radixengine.models import ModelRegistry
from radixengine.server_args import ServerArgs
from radixengine.utils.random_seed import set_random_seed

logger = logging.getLogger(__name__)

# CPU KV pool default: at most this many tokens and this share of the available RAM
# (raise it with --max-total-tokens).
CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536
CPU_DEFAULT_RAM_FRACTION = 0.2
# An explicit --max-total-tokens may take at most this share of the available RAM (KV cache and
# req_to_token together); the rest is left for activations and the process.
CPU_MAX_RAM_FRACTION = 0.9


class ModelRunner:
    def __init__(self, server_args: ServerArgs) -> None:
        self.server_args = server_args
        self.device = torch.device(server_args.device)
        self.page_size = server_args.page_size
        if server_args.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(server_args.num_threads)
        set_random_seed(server_args.random_seed)
        self.model_config = ModelConfig(
            server_args.model_path,
            server_args.context_length,
            server_args.dtype,
            server_args.device,
            revision=server_args.revision,
        )
        self.tp_rank, self.tp_size = get_tp_group().rank, get_tp_group().world_size
        check_tensor_parallel(self.model_config, self.tp_size)
        c = self.model_config
        _, (_, self.num_kv_heads) = head_ranges(
            c.num_attention_heads, c.num_key_value_heads, self.tp_size, self.tp_rank
        )  # this rank's share of the KV cache
        self.dtype = self.model_config.dtype
        self.kv_cache_dtype = resolve_kv_cache_dtype(server_args.kv_cache_dtype, self.dtype)
        self.context_len = self.model_config.context_len
        self.model = get_model(
            self.model_config, self.device, server_args.load_format, gguf_blocks=self._use_gguf_blocks()
        )
        self.linear_kernel, self.linear_kernel_reason = "torch", f"device {self.device.type}"
        self.amx_linears = self.dpbf16_linears = self.bf16_panel_linears = 0
        if self.device.type == "cpu":
            self._pack_cpu_linears()
        self.lora_manager = make_lora_manager(server_args, self.model, self.dtype, self.device)
        self.init_memory_pool()
        self.attn_backend = create_attention_backend(server_args.attention_backend, self)
        self.sampler = Sampler(sync_free=self.device.type != "cpu")
        self.cuda_graph_runner = self._make_cuda_graph_runner()

    def _use_gguf_blocks(self) -> bool:
        """Whether the linears keep their GGUF blocks (`--quantization`)."""
        mode = self.server_args.quantization
        if mode == "none":
            return False
        reasons = self._gguf_blocks_unavailable()
        if reasons and mode == "gguf":
            raise ValueError(f"--quantization gguf cannot run here: {'; '.join(reasons)}")
        if reasons:
            logger.info("GGUF block kernels off: %s", "; ".join(reasons))
        return not reasons

    def _pack_cpu_linears(self) -> None:
        """Pick the CPU linears' kernel for this dtype and CPU and pack the weights for it
        (layers/cpu_linear_plan.py)."""
        from radixengine.layers.cpu_linear_plan import apply_cpu_linear_plan, plan_cpu_linears

        plan, count = apply_cpu_linear_plan(self.model, plan_cpu_linears(self.dtype))
        self.linear_kernel, self.linear_kernel_reason = plan.kernel, plan.reason
        if plan.kernel == "amx":
            self.amx_linears = count
        elif plan.kernel == "dpbf16":
            self.dpbf16_linears = count
        elif plan.kernel == "bf16_panels":
            self.bf16_panel_linears = count
        logger.info("linears on %s (%d packed): %s", plan.kernel, count, plan.reason)

    def _gguf_blocks_unavailable(self) -> list[str]:
        from radixengine.model_loader.gguf_loader import is_gguf

        if not is_gguf(self.model_config.model_path) or self.server_args.load_format == "dummy":
            return ["the weights do not come from a GGUF file"]
        reasons = []
        if self.device.type != "cpu":
            reasons.append("the device is not a CPU")
        if self.dtype != torch.float32:
            reasons.append(f"the dtype is {self.dtype}, not float32")
        from radixengine.layers.gguf_quant_ops import quant_native_available

        if not quant_native_available():
            reasons.append("the native CPU kernels are not built")
        return reasons

    def _make_cuda_graph_runner(self):
        from radixengine.model_executor.cuda_graph_runner import CudaGraphRunner, cuda_graph_supported

        if self.lora_manager is not None and not self.lora_manager.graph_safe:
            if self.device.type == "cuda" and not self.server_args.disable_cuda_graph:
                logger.info("CUDA graphs off: the LoRA delta's torch forms (RADIXENGINE_TRITON_LORA=0)")
            return None
        if self.device.type == "cuda" and self.tp_size > 1 and not self.server_args.disable_cuda_graph:
            logger.info(
                "CUDA graphs off: --tp-size %d (graphs around NCCL collectives are not captured yet)",
                self.tp_size,
            )
            return None
        if not cuda_graph_supported(self):
            if self.device.type == "cuda" and not self.server_args.disable_cuda_graph:
                logger.info(
                    "CUDA graphs off: attention backend %s is not graph-safe",
                    type(self.attn_backend).__name__,
                )
            return None
        return CudaGraphRunner(self)

    # Memory ------------------------------------------------------------------------------------

    def cell_size(self) -> int:
        """Bytes of K and V per token, all layers (this rank's key/value heads)."""
        c = self.model_config
        itemsize = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return self.num_kv_heads * c.head_dim * c.num_hidden_layers * 2 * itemsize

    def req_to_token_row_bytes(self) -> int:
        """Bytes of one `req_to_token` row (int32 per token of the context, plus 4)."""
        return (self.context_len + 4) * 4

    def req_to_token_rows(self, max_total_tokens: int) -> int:
        """ReqToTokenPool rows: --max-running-requests, else SGLang's rule from the pool size."""
        return self.server_args.max_running_requests or min(
            max(int(max_total_tokens / self.context_len * 512), 2048), 4096
        )

    def pool_bytes(self, max_total_tokens: int) -> tuple[int, int]:
        """`(KV cache bytes, req_to_token bytes)` for a pool of `max_total_tokens`."""
        kv = (max_total_tokens + self.page_size) * self.cell_size()
        return kv, self.req_to_token_rows(max_total_tokens) * self.req_to_token_row_bytes()

    def available_memory(self) -> int:
        """Bytes the pools may come from: free device memory on CUDA, available RAM on a CPU."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)[0]
        return psutil.virtual_memory().available

    def profile_max_num_token(self) -> int:
        if self.server_args.max_total_tokens is not None:
            tokens = self.server_args.max_total_tokens
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            tokens = self._tokens_within(free - total * (1.0 - self.server_args.mem_fraction_static), None)
        else:
            ram = self.available_memory() * CPU_DEFAULT_RAM_FRACTION
            tokens = self._tokens_within(ram, CPU_DEFAULT_MAX_TOTAL_TOKENS)
        # Every rank runs the same schedule: the pool is the size the smallest rank can hold.
        tokens = tensor_model_parallel_all_reduce_min(tokens // self.page_size * self.page_size)
        if tokens <= 0:
            raise RuntimeError(
                "not enough memory for the KV cache; lower --mem-fraction-static's share "
                "taken by others or set --max-total-tokens"
            )
        return tokens

    def _tokens_within(self, budget: float, cap: int | None) -> int:
        """The most tokens whose KV cache and req_to_token rows together fit in `budget` bytes.
        The rows grow with the pool, so size the pool without them first, then take their bytes
        off: fewer tokens never need more rows."""
        tokens = int(budget // self.cell_size()) - self.page_size
        if cap is not None:
            tokens = min(cap, tokens)
        rows = self.req_to_token_rows(max(tokens, 1)) * self.req_to_token_row_bytes()
        return min(tokens, int((budget - rows) // self.cell_size()) - self.page_size)

    def check_pool_fits(self, max_total_tokens: int) -> None:
        """Refuse at start a pool that the machine cannot hold: the CPU pool is mapped lazily,
        so it would otherwise start and be killed for memory mid-serving."""
        kv, rows = self.pool_bytes(max_total_tokens)
        available = self.available_memory()
        limit = available * (CPU_MAX_RAM_FRACTION if self.device.type == "cpu" else 1.0)
        if kv + rows <= limit:
            return
        row_count = self.req_to_token_rows(max_total_tokens)
        raise RuntimeError(
            f"the KV cache for --max-total-tokens {max_total_tokens} ({_gb(kv)}) and req_to_token for "
            f"{row_count} requests (--max-running-requests; {_gb(rows)}, {self.context_len + 4} tokens a row) "
            f"need {_gb(kv + rows)}, but {self.device.type} memory has {_gb(available)} available"
            f" (the pools may take {_gb(limit)}); lower --max-total-tokens, --max-running-requests "
            "or --context-length"
        )

    def init_memory_pool(self) -> None:
        c, args = self.model_config, self.server_args
        self.max_total_num_tokens = self.profile_max_num_token()
        self.check_pool_fits(self.max_total_num_tokens)
        pool_size = self.req_to_token_rows(self.max_total_num_tokens)
        self.max_running_requests = min(
            args.max_running_requests or self.max_total_num_tokens // 2, pool_size
        )
        self.req_to_token_pool = ReqToTokenPool(pool_size, self.context_len + 4, self.device)
        self.token_to_kv_pool = MHATokenToKVPool(
            self.max_total_num_tokens,
            self.page_size,
            self.kv_cache_dtype,
            self.num_kv_heads,
            c.head_dim,
            c.num_hidden_layers,
            self.device,
        )
        self.token_to_kv_pool_allocator = self._make_allocator()
        logger.info(
            "KV cache: %d tokens (%.2f GB, %s), %d request rows",
            self.max_total_num_tokens,
            self.max_total_num_tokens * self.cell_size() / 1e9,
            str(self.kv_cache_dtype).removeprefix("torch."),
            pool_size,
        )

    def _make_allocator(self):
        # The allocator's checks of slot values sync with the device; keep them on the CPU only.
        checks = self.device.type == "cpu"
        if self.page_size == 1:
            return TokenToKVPoolAllocator(
                self.max_total_num_tokens,
                self.kv_cache_dtype,
                self.device,
                self.token_to_kv_pool,
                device_checks=checks,
            )
        return PagedTokenToKVPoolAllocator(
            self.max_total_num_tokens,
            self.page_size,
            self.kv_cache_dtype,
            self.device,
            self.token_to_kv_pool,
            device_checks=checks,
        )

    # Forward -----------------------------------------------------------------------------------

    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        if self.lora_manager is not None and not forward_batch.forward_mode.is_idle():
            tokens = forward_batch.extend_seq_lens_cpu or [1] * forward_batch.batch_size
            lora_ids = forward_batch.lora_ids or [None] * forward_batch.batch_size
            self.lora_manager.prepare_lora_batch(lora_ids, tokens)
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(forward_batch)
        if forward_batch.forward_mode.has_extend_layout():
            return self.forward_extend(forward_batch)
        return self.forward_idle(forward_batch)

    @torch.no_grad()
    def forward_extend(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    @torch.no_grad()
    def forward_decode(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch):
            return self.cuda_graph_runner.replay(forward_batch)
        self.attn_backend.init_forward_metadata(forward_batch)
        return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

    def forward_idle(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        logits = torch.empty((0, self.model_config.vocab_size), dtype=torch.float32, device=self.device)
        return LogitsProcessorOutput(next_token_logits=logits)

    @torch.no_grad()
    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> torch.Tensor:
        """Next token ids (int64 `[bs]`); on request sets the chosen tokens' logprobs in
        `logits_output.logprobs` and the top `max(top_logprobs_nums)` logprobs of every row."""
        logits = logits_output.next_token_logits
        top_num = max(forward_batch.top_logprobs_nums or [0])
        if forward_batch.sampling_info is None:  # no sampling parameters: greedy
            next_ids = argmax_rows(logits)
            logprobs = top = None
            if forward_batch.return_logprob:
                logprobs, top = logprobs_of(logits, next_ids, top_num)
        else:
            next_ids, logprobs, logits_output.invalid_rows, top = self.sampler(
                logits, forward_batch.sampling_info, forward_batch.return_logprob, top_num
            )
            forward_batch.sampling_info.cumulate_output_tokens(next_ids)
        out = logits_output.logprobs
        out.next_token_logprobs = logprobs
        if top is not None:
            out.next_token_top_logprobs_val, out.next_token_top_logprobs_idx = top.val, top.idx
        return next_ids


def check_tensor_parallel(model_config: ModelConfig, tp_size: int) -> None:
    """Refuse at start-up a model that cannot be split over `tp_size` ranks, saying why."""
    if tp_size == 1:
        return
    c = model_config
    model_cls, arch = ModelRegistry.resolve_model_cls(c.architectures)
    if not getattr(model_cls, "supports_tp", False):
        raise ValueError(
            f"{arch} does not run with --tp-size {tp_size}: tensor parallelism covers the Llama family "
            "(Llama, Mistral, SmolLM), Qwen2, Qwen3 and Gemma 2/3; use --tp-size 1"
        )
    head_ranges(c.num_attention_heads, c.num_key_value_heads, tp_size, 0)
    intermediate = getattr(c.hf_config, "intermediate_size", None)
    if intermediate is not None and intermediate % tp_size:
        raise ValueError(
            f"the model's MLP width (intermediate_size {intermediate}) cannot be split evenly over "
            f"--tp-size {tp_size} ranks; pick a --tp-size that divides it"
        )
    if c.vocab_size % tp_size:
        logger.info(
            "vocabulary of %d padded to %d rows to split it over %d ranks",
            c.vocab_size,
            -(-c.vocab_size // tp_size) * tp_size,
            tp_size,
        )


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """`--kv-cache-dtype`: auto is the model's dtype; a 16-bit cache under a float32 model stores K/V
    rounded (math stays float32). Storing more bits than the model computes in gains nothing."""
    if name == "auto":
        return model_dtype
    dtype = getattr(torch, name)
    if model_dtype != torch.float32 and dtype != model_dtype:
        raise ValueError(
            f"--kv-cache-dtype {name} needs a float32 model or auto; the model runs in {model_dtype}"
        )
    return dtype


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.1f} MB"
