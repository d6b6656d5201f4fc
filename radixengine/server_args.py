"""ServerArgs: every flag of the engine, its default and its validation (SGLang's names)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from radixengine.function_call.function_call_parser import TOOL_CALL_PARSERS
from radixengine.mem_cache.evict_policy import RADIX_EVICTION_POLICIES
from radixengine.parser.reasoning_parser import REASONING_PARSERS
from radixengine.server_args_help import SERVER_ARGS_HELP
from radixengine.server_args_hicache import (
    DEFAULT_HICACHE_RATIO,
    HICACHE_CHOICES,
    HICACHE_HELP,
    validate_hicache,
)
from radixengine.server_args_lora import LORA_EVICTION_POLICIES, LORA_HELP, validate_lora_args
from radixengine.speculative.spec_args import SPECULATIVE_ALGORITHMS, validate_speculative_args
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
    revision: str | None = None  # see SERVER_ARGS_HELP
    served_model_name: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"  # resolved in __post_init__: cuda when available, else cpu
    context_length: int | None = None
    random_seed: int | None = None  # None: a random seed, drawn in __post_init__ (as SGLang)
    attention_backend: str = "auto"
    disable_shared_prefix_attention: bool = False  # see SERVER_ARGS_HELP
    shared_prefix_attention_min_len: int = 64  # see SERVER_ARGS_HELP
    quantization: str = "auto"  # see SERVER_ARGS_HELP
    chat_template: str | None = None  # see SERVER_ARGS_HELP
    sampling_defaults: str = "model"  # see SERVER_ARGS_HELP
    tool_call_parser: str | None = None  # see SERVER_ARGS_HELP
    reasoning_parser: str | None = None  # see SERVER_ARGS_HELP
    grammar_backend: str = "xgrammar"  # see SERVER_ARGS_HELP
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
    kv_cache_dtype: str = "auto"  # see SERVER_ARGS_HELP
    max_running_requests: int | None = None
    max_queued_requests: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None  # None: device default; -1 disables
    enable_mixed_chunk: bool = False  # see SERVER_ARGS_HELP
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
    stream_interval: int = 1  # see SERVER_ARGS_HELP
    cpu_forward_stream: str = "auto"  # see SERVER_ARGS_HELP
    # Fair and cache-aware scheduling (managers/fair_policy.py, mem_cache/evict_policy.py)
    lpm_aging_tokens_per_pass: int = 0
    dlpm_quantum_tokens: int = 2048
    retraction_policy: str = "length"
    radix_eviction_policy: str = "lru"
    soft_priority_preemption: bool = False

    # Hierarchical cache (SGLang's HiCache flags; server_args_hicache.py)
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = DEFAULT_HICACHE_RATIO
    hicache_size: int = 0
    hicache_write_policy: str = "write_through"
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str | None = None
    hicache_storage_max_bytes: int | None = None  # None: the variable, else 8 GiB; 0: no bound
    hicache_storage_prefetch_policy: str = "best_effort"
    hicache_host_tier_on_cpu: bool = False  # the host tier over a CPU pool (tests its logic)

    # Runtime
    num_threads: int | None = None  # CPU intra-op threads; None: all cores
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 512
    trace_file: str | None = None
    enable_metrics: bool = False
    decode_log_interval: int = 40
    test_mode: bool = False  # the idle self-check raises instead of logging
    watchdog_timeout: float = 300.0
    max_scheduler_restarts: int = 3  # HTTP server: restarts of a dead scheduler per window (0: exit)
    scheduler_restart_window: float = 600.0

    # Tensor parallelism (SGLang's flags; see SERVER_ARGS_HELP and README "Tensor parallel")
    tp_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None

    # Speculative decoding (SGLang's flags; see SERVER_ARGS_HELP and docs/api.md "Speculative decoding")
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_num_steps: int | None = None
    speculative_draft_model_path: str | None = None
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 1
    speculative_ngram_branch_length: int = 18
    speculative_ngram_capacity: int = 0
    speculative_max_verify_tokens: int = 32

    # LoRA adapters (SGLang's flags; server_args_lora.py, docs/lora.md)
    enable_lora: bool = False
    lora_paths: list[str] | None = None
    max_loras_per_batch: int = 8
    max_loaded_loras: int | None = None
    lora_eviction_policy: str = "lru"
    max_lora_rank: int | None = None
    lora_target_modules: list[str] | None = None

    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = _auto_device()
        if self.random_seed is None:
            self.random_seed = random.randint(0, 1 << 30)
        self.validate()

    def validate(self) -> None:
        """Refuse the first broken rule of SERVER_ARGS_RULES (in its order) with its message, then
        the speculative decoding flags' (speculative/spec_args.py) and the hierarchical cache's."""
        for rule in SERVER_ARGS_RULES:
            if rule.broken(self):
                raise ValueError(rule.message(self))
        validate_speculative_args(self)
        validate_hicache(self)
        validate_lora_args(self)

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
            if "list" in str(f.type):
                kwargs["nargs"] = "+"
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


_HELP = {**SERVER_ARGS_HELP, **HICACHE_HELP, **LORA_HELP}

_CHOICES = {
    "speculative_algorithm": SPECULATIVE_ALGORITHMS,
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
    "lora_eviction_policy": LORA_EVICTION_POLICIES,
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


@dataclass(frozen=True)
class Rule:
    """A refusal of ServerArgs: when `broken(args)`, a ValueError of `message(args)`."""

    broken: Callable[[ServerArgs], bool]
    message: Callable[[ServerArgs], str]


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _choice(name: str, choices: tuple, optional: bool = False) -> Rule:
    """`--name` is one of `choices` (or None, when `optional`)."""
    return Rule(
        lambda a: not (optional and getattr(a, name) is None) and getattr(a, name) not in choices,
        lambda a: f"{_flag(name)} must be one of {', '.join(map(str, choices))}; got {getattr(a, name)!r}",
    )


def _positive(name: str, optional: bool = False, applies: Callable[[ServerArgs], bool] | None = None) -> Rule:
    """`--name` is a positive integer (or None, when `optional`), where `applies` (default: always)."""
    return Rule(
        lambda a: (
            (applies is None or applies(a))
            and not (optional and getattr(a, name) is None)
            and not _is_positive_int(getattr(a, name))
        ),
        lambda a: f"{_flag(name)} must be a positive integer, got {getattr(a, name)!r}",
    )


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _chunked(a: ServerArgs) -> bool:
    return a.chunked_prefill_size is not None and a.chunked_prefill_size != -1


def _is_template(text: str) -> bool:
    return os.path.isfile(text) or "{{" in text or "{%" in text


def _is_host_port(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


# Checked in this order; the first broken one is the refusal.
SERVER_ARGS_RULES: tuple[Rule, ...] = (
    _choice("schedule_policy", SCHEDULE_POLICIES),
    _choice("dtype", DTYPES),
    _choice("device", DEVICES),
    _choice("load_format", LOAD_FORMATS),
    _choice("attention_backend", ATTENTION_BACKENDS),
    _choice("cpu_forward_stream", CPU_FORWARD_STREAMS),
    _choice("quantization", QUANTIZATIONS),
    _choice("kv_cache_dtype", KV_CACHE_DTYPES),
    _choice("sampling_defaults", SAMPLING_DEFAULTS),
    _choice("tool_call_parser", TOOL_CALL_PARSER_NAMES, optional=True),
    _choice("reasoning_parser", REASONING_PARSER_NAMES, optional=True),
    _choice("grammar_backend", GRAMMAR_BACKENDS),
    Rule(
        lambda a: a.chat_template is not None and not _is_template(a.chat_template),
        lambda a: f"--chat-template {a.chat_template!r} is neither a file nor a Jinja template",
    ),
    Rule(
        lambda a: a.kv_cache_dtype != "auto" and a.device != "cpu",
        lambda a: (
            f"--kv-cache-dtype {a.kv_cache_dtype} runs on a CPU only; use auto (the model's dtype) on {a.device}"
        ),
    ),
    _positive("page_size"),
    _positive("shared_prefix_attention_min_len"),
    _positive("max_prefill_tokens"),
    _positive("max_total_tokens", optional=True),
    _positive("max_running_requests", optional=True),
    _positive("max_queued_requests", optional=True),
    _positive("context_length", optional=True),
    _positive("lpm_fallback_queue_len"),
    _positive("new_token_ratio_decay_steps"),
    _positive("num_threads", optional=True),
    _positive("cuda_graph_max_bs"),
    _positive("chunked_prefill_size", applies=_chunked),
    Rule(
        lambda a: _chunked(a) and a.chunked_prefill_size % a.page_size != 0,
        lambda a: (
            f"--chunked-prefill-size ({a.chunked_prefill_size}) must be a multiple of "
            f"--page-size ({a.page_size})"
        ),
    ),
    Rule(
        lambda a: not 0.0 < a.mem_fraction_static < 1.0,
        lambda a: f"--mem-fraction-static must be in (0, 1), got {a.mem_fraction_static}",
    ),
    Rule(
        lambda a: not 0.0 < a.init_new_token_ratio <= 1.0,
        lambda a: f"--init-new-token-ratio must be in (0, 1], got {a.init_new_token_ratio}",
    ),
    Rule(
        lambda a: not 0.0 <= a.min_new_token_ratio_factor <= 1.0,
        lambda a: f"--min-new-token-ratio-factor must be in [0, 1], got {a.min_new_token_ratio_factor}",
    ),
    Rule(
        lambda a: a.schedule_conservativeness <= 0,
        lambda a: f"--schedule-conservativeness must be > 0, got {a.schedule_conservativeness}",
    ),
    _positive("stream_interval"),
    _positive("decode_log_interval"),
    _choice("log_requests_level", LOG_REQUESTS_LEVELS),
    Rule(
        lambda a: not a.watchdog_timeout > 0,
        lambda a: f"--watchdog-timeout must be > 0 seconds, got {a.watchdog_timeout}",
    ),
    Rule(
        lambda a: a.max_scheduler_restarts < 0,
        lambda a: f"--max-scheduler-restarts must be >= 0, got {a.max_scheduler_restarts}",
    ),
    Rule(
        lambda a: not a.scheduler_restart_window > 0,
        lambda a: f"--scheduler-restart-window must be > 0 seconds, got {a.scheduler_restart_window}",
    ),
    Rule(
        lambda a: a.retract_decode_steps < 0,
        lambda a: f"--retract-decode-steps must be >= 0, got {a.retract_decode_steps}",
    ),
    _positive("response_store_max_count"),
    _positive("response_store_max_bytes"),
    _positive("batch_max_running"),
    _positive("max_batch_file_bytes"),
    _positive("max_batch_lines"),
    Rule(lambda a: not 0 < a.port < 65536, lambda a: f"--port must be in 1..65535, got {a.port}"),
    # Fair and cache-aware scheduling
    Rule(
        lambda a: (
            not isinstance(a.lpm_aging_tokens_per_pass, int)
            or isinstance(a.lpm_aging_tokens_per_pass, bool)
            or a.lpm_aging_tokens_per_pass < 0
        ),
        lambda a: f"--lpm-aging-tokens-per-pass must be an integer >= 0, got {a.lpm_aging_tokens_per_pass!r}",
    ),
    Rule(
        lambda a: bool(a.lpm_aging_tokens_per_pass) and a.schedule_policy != "lpm",
        lambda a: (
            f"--lpm-aging-tokens-per-pass ages --schedule-policy lpm only; got --schedule-policy "
            f"{a.schedule_policy}"
        ),
    ),
    _positive("dlpm_quantum_tokens"),
    _choice("retraction_policy", RETRACTION_POLICIES),
    Rule(
        lambda a: a.retraction_policy == "priority" and not a.enable_priority_scheduling,
        lambda a: "--retraction-policy priority requires --enable-priority-scheduling",
    ),
    _choice("radix_eviction_policy", RADIX_EVICTION_POLICIES),
    Rule(
        lambda a: a.radix_eviction_policy == "priority" and a.schedule_low_priority_values_first,
        lambda a: (
            "--radix-eviction-policy priority evicts lower priority values first, the opposite of "
            "--schedule-low-priority-values-first"
        ),
    ),
    # Tensor parallelism
    _positive("tp_size"),
    _positive("nnodes"),
    Rule(
        lambda a: a.tp_size % a.nnodes != 0,
        lambda a: f"--tp-size {a.tp_size} must be a multiple of --nnodes {a.nnodes}",
    ),
    Rule(
        lambda a: not 0 <= a.node_rank < a.nnodes,
        lambda a: f"--node-rank must be in [0, {a.nnodes}), got {a.node_rank}",
    ),
    Rule(
        lambda a: a.nnodes > 1 and a.dist_init_addr is None,
        lambda a: "--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address, the same on every node)",
    ),
    Rule(
        lambda a: a.dist_init_addr is not None and not _is_host_port(a.dist_init_addr),
        lambda a: f"--dist-init-addr must be HOST:PORT, got {a.dist_init_addr!r}",
    ),
)
