"""The `--help` text of ServerArgs' flags (field name -> text); fields without one get none."""

SERVER_ARGS_HELP = {
    "speculative_algorithm": (
        "Speculative decoding. NGRAM drafts each request's next tokens from its own prompt and output (what "
        "followed earlier occurrences of its last tokens); STANDALONE from a smaller draft model of the same "
        "tokenizer (--speculative-draft-model-path). The drafts are verified in one forward: greedy output is "
        "unchanged, sampling keeps the model's distribution. Runs in the overlap loop unless "
        "--disable-overlap-schedule."
    ),
    "speculative_num_draft_tokens": (
        "Tokens verified per request per step, its last token included (NGRAM default 8; STANDALONE: "
        "--speculative-num-steps + 1)."
    ),
    "speculative_num_steps": "Tokens the draft model proposes per step (STANDALONE; default 3).",
    "speculative_draft_model_path": "The draft model for STANDALONE: a folder or GGUF of the same tokenizer.",
    "speculative_ngram_min_match_window_size": "Shortest suffix of the context an n-gram draft matches.",
    "speculative_ngram_max_match_window_size": "Longest suffix of the context an n-gram draft matches.",
    "speculative_ngram_min_bfs_breadth": "Draft-tree breadth at the deepest level (1: a chain).",
    "speculative_ngram_max_bfs_breadth": "Draft-tree breadth at the root (only 1, chains, for now).",
    "speculative_ngram_branch_length": "Longest branch of an n-gram draft.",
    "speculative_ngram_capacity": "Tokens of recent finished requests kept to draft from, emptied by /flush_cache (0: none).",
    "speculative_max_verify_tokens": (
        "Draft tokens (last tokens included) one verify step may hold: each request drafts at most this "
        "divided by the batch size, and a batch too large for 2 a request decodes plainly."
    ),
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
        "natively (AMX-BF16 or AVX512-BF16, unless RADIXENGINE_CPU_ISA or ONEDNN_MAX_CPU_ISA rule them out), "
        "else float32; there a 16-bit checkpoint's weights stay bf16 (panels widened to fp32 in the native "
        "GEMM: half the bytes, the same products). bfloat16 on a CPU without native bf16 runs its linears "
        "on the same panels. /get_server_info names the choice and why (resolved_dtype, linear_kernel)."
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
        "How many lines of /v1/batches, of all batches together, are in the engine at once (each yields to "
        "interactive requests); the rest wait in their batch. Default: 16."
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
    "cuda_graph_max_bs": "CUDA: largest decode batch captured in a CUDA graph (lowered to "
    "--max-running-requests and to what a quarter of the free GPU memory holds).",
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
    "test_mode": (
        "Tests: the idle token-accounting check raises instead of logging; under tensor parallelism "
        "the ranks compare their schedulers' requests and tokens every step and raise if they differ."
    ),
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
        "timeout and exits, the pending requests fail with that message and the HTTP server starts a new "
        "scheduler (--max-scheduler-restarts; SGLang's server exits)."
    ),
    "max_scheduler_restarts": (
        "HTTP server: when the scheduler process dies (an uncontained error, a native crash, a kill), "
        "its requests fail with a 503 and a new scheduler (and detokenizer) starts with the same "
        "arguments, at most this many times within --scheduler-restart-window; one more death and the "
        "server exits with code 1. 0: exit at the first death. The offline Engine never restarts."
    ),
    "scheduler_restart_window": ("Seconds over which --max-scheduler-restarts counts restarts."),
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
}
