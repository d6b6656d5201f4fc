"""ServerArgs: every flag of the engine, its default and its validation (SGLang's names)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
from dataclasses import dataclass, field

from radixengine.function_call.function_call_parser import TOOL_CALL_PARSERS
from radixengine.mem_cache.evict_policy import RADIX_EVICTION_POLICIES
from radixengine.parser.reasoning_parser import REASONING_PARSERS
from radixengine.server_args_hicache import HICACHE_CHOICES, HICACHE_HELP, validate_hicache
from radixengine.utils.stream_layouts import CPU_STREAM_LAYOUTS

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "hrrn", "shortest-prefill-first", "dlpm")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
QUANTIZATIONS = ("auto", "gguf", "none")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
ATTENTION_BACKENDS = ("auto", "torch_native", "native_cpu", "flashinfer", "triton")
CPU_FORWARD_STREAMS = CPU_STREAM_LAYOUTS
SAMPLING_DEFAULTS = ("openai", "model")
LOG_REQUESTS_LEVELS = (0, 1, 2, 3)
TOOL_CALL_PARSER_NAMES = tuple(TOOL_CALL_PARSERS)
REASONING_PARSER_NAMES = tuple(REASONING_PARSERS)
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")
RETRACTION_POLICIES = ("length", "priority")


@dataclass
class ServerArgs:
    # Model
    model_path: str | None = None  # None: the bundled SmolLM2-135M-Instruct GGUF
    tokenizer_path: str | None = None
    revision: str | None = None  # see _HELP
    served_model_name: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"  # resolved in __post_init__: cuda when available, else cpu
    context_length: int | None = None
    random_seed: int | None = None  # None: a random seed, drawn in __post_init__ (as SGLang)
    attention_backend: str = "auto"
    disable_shared_prefix_attention: bool = False  # see _HELP
    shared_prefix_attention_min_len: int = 64  # see _HELP
    quantization: str = "auto"  # see _HELP
    chat_template: str | None = None  # see _HELP
    sampling_defaults: str = "model"  # see _HELP
    tool_call_parser: str | None = None  # see _HELP
    reasoning_parser: str | None = None  # see _HELP
    grammar_backend: str = "xgrammar"  # see _HELP
    constrained_json_disable_any_whitespace: bool = False

    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    log_requests: bool = False
    # The Responses API's store and the Batch API (entrypoints/response_store.py, batch_runner.py)
    response_store_max_count: int = 1000
    response_store_max_bytes: int = 64 << 20
    batch_dir: str | None = None  # None: ~/.cache/radixengine/batches
    batch_max_running: int = 16
    max_batch_file_bytes: int = 200 << 20
    max_batch_lines: int = 50000
    log_requests_level: int = 2

    # Memory
    max_total_tokens: int | None = None
    mem_fraction_static: float = 0.85  # CUDA only
    page_size: int = 1
    kv_cache_dtype: str = "auto"  # see _HELP
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None  # None: device default; -1 disables
    enable_mixed_chunk: bool = False  # see _HELP
    disable_radix_cache: bool = False

    # Scheduling
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    lpm_fallback_queue_len: int = 128
    disable_in_batch_prefix_caching: bool = False
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    retract_decode_steps: int = 20
    disable_overlap_schedule: bool = False
    stream_interval: int = 1  # see _HELP
    cpu_forward_stream: str = "auto"  # see _HELP
    # Fair and cache-aware scheduling (managers/fair_policy.py, mem_cache/evict_policy.py)
    lpm_aging_tokens_per_pass: int = 0
    dlpm_quantum_tokens: int = 2048
    retraction_policy: str = "length"
    radix_eviction_policy: str = "lru"
    soft_priority_preemption: bool = False

    # Hierarchical cache (SGLang's HiCache flags; server_args_hicache.py)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str | None = None
    hicache_storage_max_bytes: int = 0
    hicache_storage_prefetch_policy: str = "best_effort"

    # Runtime
    num_threads: int | None = None  # CPU intra-op threads; None: all cores
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 160
    trace_file: str | None = None
    enable_metrics: bool = False
    decode_log_interval: int = 40
    test_mode: bool = False  # the idle self-check raises instead of logging
    watchdog_timeout: float = 300.0

    # Tensor parallelism (SGLang's flags; see _HELP and README "Tensor parallel")
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = _auto_device()
        if self.random_seed is None:
            self.random_seed = random.randint(0, 1 << 30)
        self.validate()

    def validate(self) -> None:
        _check_choice("--schedule-policy", self.schedule_policy, SCHEDULE_POLICIES)
        _check_choice("--dtype", self.dtype, DTYPES)
        _check_choice("--device", self.device, DEVICES)
        _check_choice("--load-format", self.load_format, LOAD_FORMATS)
        _check_choice("--attention-backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("--cpu-forward-stream", self.cpu_forward_stream, CPU_FORWARD_STREAMS)
        _check_choice("--quantization", self.quantization, QUANTIZATIONS)
        _check_choice("--kv-cache-dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        _check_choice("--sampling-defaults", self.sampling_defaults, SAMPLING_DEFAULTS)
        if self.tool_call_parser is not None:
            _check_choice("--tool-call-parser", self.tool_call_parser, TOOL_CALL_PARSER_NAMES)
        if self.reasoning_parser is not None:
            _check_choice("--reasoning-parser", self.reasoning_parser, REASONING_PARSER_NAMES)
        _check_choice("--grammar-backend", self.grammar_backend, GRAMMAR_BACKENDS)
        if self.chat_template is not None and not (
            os.path.isfile(self.chat_template) or "{{" in self.chat_template or "{%" in self.chat_template
        ):
            raise ValueError(f"--chat-template {self.chat_template!r} is neither a file nor a Jinja template")
        if self.kv_cache_dtype != "auto" and self.device != "cpu":
            raise ValueError(
                f"--kv-cache-dtype {self.kv_cache_dtype} runs on a CPU only; use auto (the model's dtype) "
                f"on {self.device}"
            )
        _check_positive("--page-size", self.page_size)
        _check_positive("--shared-prefix-attention-min-len", self.shared_prefix_attention_min_len)
        _check_positive("--max-prefill-tokens", self.max_prefill_tokens)
        _check_positive("--max-total-tokens", self.max_total_tokens, optional=True)
        _check_positive("--max-running-requests", self.max_running_requests, optional=True)
        _check_positive("--max-queued-requests", self.max_queued_requests, optional=True)
        _check_positive("--context-length", self.context_length, optional=True)
        _check_positive("--lpm-fallback-queue-len", self.lpm_fallback_queue_len)
        _check_positive("--new-token-ratio-decay-steps", self.new_token_ratio_decay_steps)
        _check_positive("--num-threads", self.num_threads, optional=True)
        _check_positive("--cuda-graph-max-bs", self.cuda_graph_max_bs)
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1:
            _check_positive("--chunked-prefill-size", self.chunked_prefill_size)
            if self.chunked_prefill_size % self.page_size:
                raise ValueError(
                    f"--chunked-prefill-size ({self.chunked_prefill_size}) must be a multiple of "
                    f"--page-size ({self.page_size})"
                )
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1), got {self.mem_fraction_static}")
        if not 0.0 < self.init_new_token_ratio <= 1.0:
            raise ValueError(f"--init-new-token-ratio must be in (0, 1], got {self.init_new_token_ratio}")
        if not 0.0 <= self.min_new_token_ratio_factor <= 1.0:
            raise ValueError(
                f"--min-new-token-ratio-factor must be in [0, 1], got {self.min_new_token_ratio_factor}"
            )
        if self.schedule_conservativeness <= 0:
            raise ValueError(f"--schedule-conservativeness must be > 0, got {self.schedule_conservativeness}")
        _check_positive("--stream-interval", self.stream_interval)
        _check_positive("--decode-log-interval", self.decode_log_interval)
        _check_choice("--log-requests-level", self.log_requests_level, LOG_REQUESTS_LEVELS)
        if not self.watchdog_timeout > 0:
            raise ValueError(f"--watchdog-timeout must be > 0 seconds, got {self.watchdog_timeout}")
        if self.retract_decode_steps < 0:
            raise ValueError(f"--retract-decode-steps must be >= 0, got {self.retract_decode_steps}")
        for flag in ("response_store_max_count", "response_store_max_bytes", "batch_max_running",
                     "max_batch_file_bytes", "max_batch_lines"):  # fmt: skip
            _check_positive("--" + flag.replace("_", "-"), getattr(self, flag))
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535, got {self.port}")
        self._validate_fair_scheduling()
        self._validate_tensor_parallel()
        validate_hicache(self)

    def _validate_fair_scheduling(self) -> None:
        aging = self.lpm_aging_tokens_per_pass
        if not isinstance(aging, int) or isinstance(aging, bool) or aging < 0:
            raise ValueError(f"--lpm-aging-tokens-per-pass must be an integer >= 0, got {aging!r}")
        if aging and self.schedule_policy != "lpm":
            raise ValueError(
                f"--lpm-aging-tokens-per-pass ages --schedule-policy lpm only; got --schedule-policy "
                f"{self.schedule_policy}"
            )
        _check_positive("--dlpm-quantum-tokens", self.dlpm_quantum_tokens)
        _check_choice("--retraction-policy", self.retraction_policy, RETRACTION_POLICIES)
        if self.retraction_policy == "priority" and not self.enable_priority_scheduling:
            raise ValueError("--retraction-policy priority requires --enable-priority-scheduling")
        _check_choice("--radix-eviction-policy", self.radix_eviction_policy, RADIX_EVICTION_POLICIES)
        if self.radix_eviction_policy == "priority" and self.schedule_low_priority_values_first:
            raise ValueError(
                "--radix-eviction-policy priority evicts lower priority values first, the opposite of "
                "--schedule-low-priority-values-first"
            )

    def _validate_tensor_parallel(self) -> None:
        _check_positive("--tp-size", self.tp_size)
        _check_positive("--nnodes", self.nnodes)
        if self.tp_size % self.nnodes:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError(
                "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)"
            )
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--dist-init-addr must be HOST:PORT, got {self.dist_init_addr!r}")

    # Derived values --------------------------------------------------------------------------

    @property
    def chunked_prefill_enabled(self) -> bool:
        return self.effective_chunked_prefill_size is not None

    @property
    def effective_chunked_prefill_size(self) -> int | None:
        if self.chunked_prefill_size == -1:
            return None
        if self.chunked_prefill_size is None:
            return 8192 if self.device == "cuda" else 2048
        return self.chunked_prefill_size

    @property
    def init_ratio(self) -> float:
        return min(self.init_new_token_ratio * self.schedule_conservativeness, 1.0)

    @property
    def min_ratio(self) -> float:
        return min(self.init_ratio * self.min_new_token_ratio_factor, 1.0)

    @property
    def ratio_decay(self) -> float:
        return (self.init_ratio - self.min_ratio) / self.new_token_ratio_decay_steps

    # Command line ----------------------------------------------------------------------------

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            if f.name == "extra":
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", default=default, help=_HELP.get(f.name))
                continue
            kind = _cli_type(f.type)
            kwargs: dict = {"type": kind, "default": default}
            choices = _CHOICES.get(f.name)
            if choices:
                kwargs["choices"] = choices
            if f.name in _HELP:
                kwargs["help"] = _HELP[f.name]
            parser.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    @classmethod
    def from_kwargs(cls, **kwargs) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


_CHOICES = {
    "schedule_policy": SCHEDULE_POLICIES,
    "dtype": DTYPES,
    "device": DEVICES,
    "load_format": LOAD_FORMATS,
    "attention_backend": ATTENTION_BACKENDS,
    "quantization": QUANTIZATIONS,
    "kv_cache_dtype": KV_CACHE_DTYPES,
    "cpu_forward_stream": CPU_FORWARD_STREAMS,
    "sampling_defaults": SAMPLING_DEFAULTS,
    "tool_call_parser": TOOL_CALL_PARSER_NAMES,
    "reasoning_parser": REASONING_PARSER_NAMES,
    "grammar_backend": GRAMMAR_BACKENDS,
    "log_level": ("debug", "info", "warning", "error"),
    "log_requests_level": LOG_REQUESTS_LEVELS,
    "retraction_policy": RETRACTION_POLICIES,
    "radix_eviction_policy": RADIX_EVICTION_POLICIES,
    **HICACHE_CHOICES,
}

_HELP = {
    "tool_call_parser": (
        "How /v1/chat/completions reads tool calls in the model's text into `tool_calls` (SGLang's "
        "names): llama3 (Llama 3.x, <|python_tag|> / JSON), qwen25 or qwen (Qwen2.5 / Qwen3, "
        "<tool_call>...</tool_call>), pythonic ([f(x=1)]). Without it, tool_choice auto leaves the text "
        "as it is; tool_choice required or a named function always works: a grammar forces a JSON "
        "array of calls (or the parser's own format where it has a structural tag)."
    ),
    "reasoning_parser": (
        "Split a reasoning model's <think>...</think> block into `reasoning_content` on "
        "/v1/chat/completions (SGLang's names): qwen3 (thinking unless chat_template_kwargs "
        "enable_thinking is false), qwen3-thinking and deepseek-r1 (always thinking, the opening "
        "<think> optional)."
    ),
    "grammar_backend": (
        "The backend of constrained decoding (response_format json_object / json_schema, and the "
        "json_schema, regex, ebnf and structural_tag sampling parameters): xgrammar (default), "
        "llguidance, or none (such requests get a 400)."
    ),
    "constrained_json_disable_any_whitespace": (
        "JSON grammars allow no whitespace beyond single spaces (compact JSON): a small model cannot "
        "then loop on newlines inside a JSON object."
    ),
    "chat_template": (
        "The chat template for /v1/chat/completions: a file holding a Jinja template, or the template "
        "itself. Default: the tokenizer's own."
    ),
    "sampling_defaults": (
        "Where the chat API's defaults for temperature, top_p, top_k, min_p and repetition_penalty come "
        "from when a request leaves them unset. model (default): the model's generation_config.json, "
        "where it sets them; openai: the OpenAI / SGLang defaults (temperature 1, top_p 1, ...)."
    ),
    "model_path": (
        "A Hugging Face model folder (config.json + safetensors or PyTorch .bin weights, AWQ / GPTQ "
        "included), a .gguf file, or a Hugging Face repo id found in the local Hugging Face cache "
        "(HF_HUB_CACHE, else HF_HOME/hub; never downloaded): org/name, org/name/file.gguf or "
        "org/name:Q4_K_M (the repo's .gguf of that type). Default: the bundled SmolLM2-135M-Instruct GGUF."
    ),
    "tokenizer_path": (
        "The tokenizer's folder, .gguf file or cached repo id (as --model-path). Default: --model-path."
    ),
    "revision": (
        "The version of a repo id in the Hugging Face cache: a branch, a tag or a commit hash. Applies to "
        "--model-path, and to --tokenizer-path when that is unset or the same repo. Default: main."
    ),
    "served_model_name": (
        "The model name /v1/models reports and the metrics' model_name label carry. Default: --model-path. "
        "Requests may name any model (a single-model server)."
    ),
    "load_format": (
        "auto: safetensors (else PyTorch .bin) for a folder, gguf for a .gguf file; dummy: random weights "
        "of the config's shapes (benchmarks)."
    ),
    "dtype": (
        "dtype of the weights and activations. auto: bfloat16 on CUDA and on a CPU that multiplies bf16 "
        "natively, else float32."
    ),
    "device": (
        "Where the model runs. auto (default): cuda when torch.cuda.is_available(), else cpu. A device "
        "this machine does not have is refused at start."
    ),
    "context_length": "Maximum tokens of one request (prompt + output). Default: the model config's.",
    "random_seed": (
        "Seed of Python's random, NumPy and torch (CPU and CUDA) in the engine's processes, as SGLang: "
        "it fixes the draws of unseeded sampling. Default: a random seed chosen at start (shown by "
        "/get_server_info)."
    ),
    "attention_backend": (
        "auto: triton on CUDA; native_cpu (the built C++ kernels), else torch_native on a CPU. A backend "
        "that is not installed or cannot run on --device is refused at start with the reason; flashinfer "
        "(SGLang's name) is not implemented yet and is refused."
    ),
    "disable_shared_prefix_attention": (
        "Decode attention reads every request's whole KV, also where requests of the batch share a "
        "cached prefix. By default a prefix shared by two or more requests of a decode batch (the same "
        "KV slots, as a radix-cache hit gives) is computed once for all their queries and merged with "
        "each request's own part by log-sum-exp (cascade attention; exact). native_cpu and "
        "torch_native backends; not for sliding-window layers."
    ),
    "shared_prefix_attention_min_len": (
        "Shortest shared prefix (tokens) given its own pass in shared-prefix attention; shorter ones "
        "are read per request. Default 64."
    ),
    "host": "Address the HTTP server listens on. Default: 127.0.0.1.",
    "port": "Port the HTTP server listens on. Default: 30000.",
    "api_key": (
        "Require `Authorization: Bearer KEY` on every route but /health and /metrics (as SGLang). "
        "Default: no key."
    ),
    "log_level": "Logging level of the server and its processes.",
    "response_store_max_count": (
        "How many stored /v1/responses answers are kept (for GET and previous_response_id); past it, "
        "the oldest are dropped. Default: 1000."
    ),
    "response_store_max_bytes": "The same bound in bytes of JSON (default 64 MiB).",
    "batch_dir": (
        "Folder of /v1/files and /v1/batches (uploads, results, batch state); a restarted server resumes "
        "its unfinished batches from it. Default: ~/.cache/radixengine/batches."
    ),
    "batch_max_running": (
        "How many lines of /v1/batches are in the engine at once (at the lowest priority); the rest wait "
        "in the batch. Default: 16."
    ),
    "max_batch_file_bytes": "Largest /v1/files upload, in bytes (default 200 MiB, as OpenAI).",
    "max_batch_lines": "Most request lines in one batch input file (default 50000, as OpenAI).",
    "log_requests": (
        "Log every request when it arrives (`Receive: obj=...`) and when it finishes (`Finish: obj=..., "
        "out=...`: input, output and meta_info), at info level; how much is set by --log-requests-level."
    ),
    "log_requests_level": (
        "0: metadata only (no text, ids or sampling parameters); 1: metadata and sampling parameters; 2 "
        "(default): also the input and output, strings and lists cut to 2048; 3: everything, uncut."
    ),
    "max_total_tokens": "Size of the KV cache pool in tokens. Default: from the memory available.",
    "mem_fraction_static": "CUDA: fraction of the GPU memory for the weights and the KV pool.",
    "page_size": "Tokens per KV cache page (the radix cache matches whole pages).",
    "max_running_requests": "Most requests in the running batch. Default: from the pool size.",
    "max_queued_requests": "Most requests waiting; a request past it gets 503. Default: no limit.",
    "max_prefill_tokens": "Most prompt tokens one prefill batch computes.",
    "chunked_prefill_size": (
        "Prefill a long prompt in chunks of this many tokens. Default: 8192 on CUDA, 2048 on a CPU; -1: no "
        "chunking."
    ),
    "disable_radix_cache": "Do not reuse the KV of shared prompt prefixes (no radix cache).",
    "schedule_policy": (
        "Order of the waiting queue: fcfs (arrival), lpm (longest cached prefix first), dfs-weight, lof "
        "(longest output first), random, hrrn (highest response ratio: wait in computed prefill tokens "
        "over uncached length), shortest-prefill-first (fewest uncached tokens), dlpm (per-tenant "
        "deficit counters over lpm: each tenant, the request's routing_key, gets an equal share of "
        "prefill tokens, cache hits first within it)."
    ),
    "lpm_aging_tokens_per_pass": (
        "lpm with aging: a waiting request's prefix score grows by this many tokens per scheduling pass, "
        "so no request waits more than about context-length / N passes. 0 (default): plain lpm."
    ),
    "dlpm_quantum_tokens": (
        "dlpm: tokens each waiting tenant is credited per round (a request is charged its uncached prompt "
        "tokens and its max_new_tokens when admitted, whatever the chunk size). Smaller: finer fairness; larger: a tenant's bursts stay in credit."
    ),
    "retraction_policy": (
        "Which running requests are retracted first when decode runs out of KV memory: length (fewest "
        "decoded tokens, then longest prompt) or priority (least important first; needs "
        "--enable-priority-scheduling)."
    ),
    "soft_priority_preemption": (
        "With --enable-priority-scheduling: a preempted request's computed KV goes to the radix cache "
        "(evictable, newest last) instead of being freed, and evictions take only the pages they need "
        "from a cached prefix's end, so on its return it recomputes only what was evicted meanwhile. "
        "Preemption still happens only when the free and evictable tokens do not fit the important request."
    ),
    "radix_eviction_policy": (
        "Which cached prefixes are evicted first: lru, lfu (fewest requests), slru (prefixes one request "
        "used before those two or more requests used, LRU within each) or priority (prefixes of low-priority "
        "requests first, a prefix keeping its highest user's priority)."
    ),
    "schedule_conservativeness": (
        "Scales how many future tokens the scheduler reserves for running requests: > 1 admits fewer new "
        "requests (fewer retractions), < 1 more."
    ),
    "lpm_fallback_queue_len": "lpm / dfs-weight fall back to fcfs when the queue is longer than this.",
    "disable_in_batch_prefix_caching": (
        "Admit requests that share a prefix with one being prefilled in the same round (each computes it) "
        "instead of holding them one round to hit the cache."
    ),
    "enable_priority_scheduling": "Order and preempt by the request's `priority`.",
    "schedule_low_priority_values_first": "With priority scheduling: a lower value is more important.",
    "priority_scheduling_preemption_threshold": (
        "A waiting request preempts a running one only when its priority is better by more than this."
    ),
    "init_new_token_ratio": (
        "Initial fraction of each running request's remaining max_new_tokens reserved when admitting."
    ),
    "min_new_token_ratio_factor": "The reserved fraction decays to init ratio x this factor.",
    "new_token_ratio_decay_steps": "Decode steps over which the reserved fraction decays to its minimum.",
    "retract_decode_steps": "Decode steps of room a retraction frees for each remaining request.",
    "disable_overlap_schedule": (
        "Run schedule, forward and result processing in order, instead of processing batch N-1 while "
        "batch N computes."
    ),
    "num_threads": "CPU: intra-op threads of the forward. Default: all cores.",
    "disable_cuda_graph": "CUDA: run decode without CUDA graphs.",
    "cuda_graph_max_bs": "CUDA: largest decode batch captured in a CUDA graph.",
    "trace_file": "Write a Chrome trace (chrome://tracing) of the scheduler's phases to this file.",
    "enable_metrics": (
        "Serve Prometheus metrics on /metrics, with SGLang's names and labels (sglang:num_running_reqs, "
        "sglang:gen_throughput, sglang:time_to_first_token_seconds, ...), so SGLang's Grafana dashboard "
        "reads them. Off by default, as in SGLang: /metrics then answers 404."
    ),
    "decode_log_interval": (
        "Log a `Decode batch, #running-req: ..., gen throughput (token/s): ...` line every N decode "
        "steps (SGLang's default 40); a `Prefill batch, ...` line is logged for every prefill batch."
    ),
    "test_mode": "Tests: the idle token-accounting check raises instead of logging.",
    "tp_size": (
        "Tensor parallelism: split the model over N ranks (processes), each holding its slice of every "
        "layer and of the KV cache; torch.distributed with gloo on a CPU, NCCL on CUDA (one GPU a rank)."
    ),
    "nnodes": "Tensor parallel over several machines: how many (each runs --tp-size / --nnodes ranks).",
    "node_rank": "This machine's index among --nnodes (0 serves HTTP; the others run their ranks only).",
    "dist_init_addr": (
        "HOST:PORT where the ranks meet (torch.distributed's TCP store on node 0); needed with --nnodes > 1. "
        "Default: a free port on 127.0.0.1."
    ),
    "watchdog_timeout": (
        "Seconds one scheduler step (a forward batch) may take. Past it the scheduler process logs the "
        "timeout and exits, the pending requests fail with that message and the server exits (as SGLang)."
    ),
    "stream_interval": (
        "Stream a request's tokens every N tokens (the first one at once, and the rest when it "
        "finishes): fewer messages through the detokenizer and the HTTP front end per step."
    ),
    "enable_mixed_chunk": (
        "Run a prefill chunk and the running requests' decode step in one forward, under one token "
        "budget, so decode does not stall while a long prompt is prefilled (not with logprobs)."
    ),
    "kv_cache_dtype": (
        "dtype the KV cache stores K and V in. auto (default): the model's dtype, results as exact as the "
        "model's. bfloat16 / float16 with a float32 model: half the cache's bytes (twice the tokens, about "
        "half the memory traffic of decode attention), math still in float32; K/V rounded to 16 bits, so "
        "logits move slightly (float16 keeps 3 more mantissa bits than bfloat16). CPU only."
    ),
    "quantization": (
        "gguf: for a GGUF model, the linears also keep their GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
        "Q4_K, Q5_K, Q6_K; a linear in another type keeps float weights only) and small batches "
        "(decode) read those instead of the float32 weights: the same values, 4-6x fewer bytes (CPU, "
        "float32, native kernels built; an error where that does not hold). none: float weights only. "
        "auto (default): gguf wherever it applies."
    ),
    "cpu_forward_stream": (
        "CPU only, with the overlap schedule: where the forward runs. thread: on a worker thread beside "
        "the scheduler thread (batch N computes while N-1 is processed and N+1 scheduled); inline: on the "
        "scheduler thread, in the normal step order; auto (default): thread only when the intra-op threads "
        "(--num-threads) leave a core free, else inline (a worker thread competing with the forward's "
        "threads for the cores makes decode slower)."
    ),
    **HICACHE_HELP,
}


def _auto_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _cli_type(annotation: str):
    text = str(annotation)
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def _check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(map(str, choices))}; got {value!r}")


def _check_positive(flag: str, value: int | None, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{flag} must be a positive integer, got {value!r}")
