"""Messages between the tokenizer manager, the scheduler and the detokenizer (pickled over ZMQ)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from radixengine.managers.request_errors import RequestError
from radixengine.sampling.sampling_params import MAX_N, SamplingParams

# The most requests one call expands to (prompts x n): a bigger batch is a 400, not a server that
# queues a million requests.
MAX_BATCH_REQUESTS = 4096

# Front end (Engine, HTTP) -> tokenizer manager ------------------------------------------------


@dataclass
class GenerateReqInput:
    """A generate call as the front end (Engine, HTTP /generate, the OpenAI routes) hands it over:
    exactly one of `text`, `input_ids` or `messages` (chat, rendered with the tokenizer's chat
    template, given `chat_template_kwargs` and `tools`; `continue_final_message` continues the
    last assistant message instead of opening a new one). SGLang's batch form: a list of prompts,
    with `sampling_params`, `rid`, `priority`, `routing_key` and the logprob fields each given once or one per
    prompt; `normalize_batch_and_arguments` turns it into one request per prompt and sample, the
    form the tokenizer manager takes. `log_metrics=False` keeps it out of the metrics (SGLang's
    health checks)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    messages: list[dict] | list[list[dict]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    # SGLang's logprob fields: with return_logprob, the chosen tokens' logprobs, the
    # top_logprobs_num most likely tokens' at each position, and the prompt's from
    # logprob_start_len (-1: none); return_text_in_logprobs decodes each token's text.
    return_logprob: bool | list[bool] = False
    top_logprobs_num: int | list[int] = 0
    logprob_start_len: int | list[int] = -1
    return_text_in_logprobs: bool = False
    priority: int | list[int] | None = None
    routing_key: str | list[str] | None = None  # the tenant, for --schedule-policy dlpm (SGLang's field)
    # False: a line of /v1/batches, which yields to interactive requests (see managers/req.py).
    # Not a field of any HTTP body.
    interactive: bool = True
    lora_path: str | list[str | None] | None = None  # a loaded LoRA adapter's name (None: the base model)
    chat_template_kwargs: dict | None = None
    continue_final_message: bool = False
    tools: list[dict] | None = None  # OpenAI tool definitions, for the chat template
    log_metrics: bool = True
    # The field the grammar came from where it is not the grammar's own sampling parameter (chat's
    # response_format, tools): the `param` of the scheduler's errors about the grammar.
    grammar_field: str | None = None

    def prompt_field(self) -> str:
        """The name of the one prompt field given (text, input_ids or messages)."""
        given = [name for name in PROMPT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            names = "text, input_ids or messages" if self.messages is not None else "text or input_ids"
            raise RequestError(f"give exactly one of {names}", param="text")
        return given[0]

    def normalize_batch_and_arguments(self) -> tuple[list[GenerateReqInput], bool]:
        """SGLang's rules, in one place for every front end: one request per prompt and sample,
        prompt by prompt, n samples each (`sampling_params.n`, the same for every prompt; the j-th
        sample's seed is seed + j); a per-prompt field is given once or as a list with one entry
        per prompt; a string `rid` names a single request and is suffixed `_k` when it stands for
        several, a list gives one per prompt (suffixed `_j` per sample). Returns the requests and
        whether the answer is a single object (one prompt, n == 1). A bad shape is a RequestError
        naming the field."""
        kind = self.prompt_field()
        prompts, single = _prompt_batch(getattr(self, kind), kind)
        per_prompt = {
            name: _per_prompt(getattr(self, name), len(prompts), name) for name in PER_PROMPT_FIELDS
        }
        for name in ("stream", "log_metrics", "return_text_in_logprobs", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be a boolean", param=name)
        n = _num_samples(per_prompt["sampling_params"])
        if len(prompts) * n > MAX_BATCH_REQUESTS:
            raise RequestError(
                f"{len(prompts)} prompts x n = {n} is {len(prompts) * n} requests; at most "
                f"{MAX_BATCH_REQUESTS} in one call",
                param="n",
            )
        rids = _expand_rids(self.rid, len(prompts), n, single)
        reqs = []
        for i, prompt in enumerate(prompts):
            fields_i = {name: values[i] for name, values in per_prompt.items()}
            for j in range(n):
                sampling_params = _sample_params(fields_i["sampling_params"], j, n)
                fields_ij = {**NO_PROMPT, **fields_i, kind: prompt, "sampling_params": sampling_params}
                reqs.append(dataclasses.replace(self, **fields_ij, rid=rids[i * n + j]))
        return reqs, single and n == 1


PROMPT_FIELDS = ("text", "input_ids", "messages")
NO_PROMPT = dict.fromkeys(PROMPT_FIELDS)
# Given once for every prompt, or as a list with one per prompt (SGLang's batch form).
PER_PROMPT_FIELDS = (
    "sampling_params",
    "priority",
    "routing_key",
    "lora_path",
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
)


def _prompt_batch(value: object, kind: str) -> tuple[list, bool]:
    """The prompts and whether one was given: a text is a string; input ids and chat messages a
    list (a batch of them: a non-empty list of lists)."""
    if kind == "text":
        single = isinstance(value, str)
    else:
        single = not (isinstance(value, list) and value and isinstance(value[0], list))
    prompts = [value] if single else value
    if not isinstance(prompts, list) or not prompts:
        raise RequestError(f"{kind} must be a prompt or a non-empty list of prompts", param=kind)
    if len(prompts) > MAX_BATCH_REQUESTS:
        raise RequestError(
            f"{kind} has {len(prompts)} prompts; at most {MAX_BATCH_REQUESTS} in one call", param=kind
        )
    if not single:
        _check_batch_items(prompts, kind)
    return prompts, single


def _check_batch_items(prompts: list, kind: str) -> None:
    """Each prompt of a batch is of its field's type (what is inside is checked per request)."""
    expected, name = (str, "a string") if kind == "text" else (list, "a list")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, expected):
            got = "None" if prompt is None else type(prompt).__name__
            raise RequestError(f"{kind}[{i}] must be {name}, got {got}", param=kind)


def _per_prompt(value: object, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} entries for {n} prompts", param=name)
        return value
    return [value] * n


def _num_samples(params: list) -> int:
    """n of the sampling params: the same for every prompt (SGLang's rule)."""
    values = set()
    for p in params:
        if p is not None and not isinstance(p, dict):
            raise RequestError(
                "sampling_params must be an object (or a list of them)", param="sampling_params"
            )
        n = (p or {}).get("n")
        n = 1 if n is None else n
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}", param="n")
        values.add(n)
    if len(values) > 1:
        raise RequestError("n must be the same in every prompt's sampling_params", param="n")
    return values.pop()


def _sample_params(params: dict | None, j: int, n: int) -> dict | None:
    if n == 1:
        return params
    sample = dict(params, n=1)
    seed = sample.get("sampling_seed")
    if isinstance(seed, int) and not isinstance(seed, bool):  # anything else is refused later
        sample["sampling_seed"] = seed + j
    return sample


def _expand_rids(rid: object, num_prompts: int, n: int, single: bool) -> list[str | None]:
    """One rid per request, prompt by prompt, n samples each."""
    total = num_prompts * n
    if rid is None:
        return [None] * total
    if isinstance(rid, str):
        return [rid] if single and n == 1 else [f"{rid}_{k}" for k in range(total)]
    if not isinstance(rid, list) or not all(isinstance(r, str) for r in rid):
        raise RequestError(
            f"rid must be a string or a list of strings, got {type(rid).__name__}", param="rid"
        )
    if single:
        raise RequestError("rid must be a string for a single prompt (a list is for a batch)", param="rid")
    if len(rid) != num_prompts:
        raise RequestError(f"rid has {len(rid)} entries for {num_prompts} prompts", param="rid")
    return list(rid) if n == 1 else [f"{r}_{j}" for r in rid for j in range(n)]


# Tokenizer manager -> scheduler ---------------------------------------------------------------


@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    priority: int | None = None
    routing_key: str | None = None
    interactive: bool = True
    lora_id: str | None = None  # its LoRA adapter (LoRARef.lora_id); None: the base model
    # A request the front end already knows is bad: the scheduler finishes it at once with this
    # error instead of running it (keeps one path for every finish).
    error: str | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReqInput:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class ClearHiCacheReqInput:
    pass


@dataclass
class ClearHiCacheReqOutput:
    success: bool
    message: str = ""


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class LoadLoRAAdapterReqInput:
    lora_id: str
    lora_name: str
    lora_path: str
    pinned: bool = False


@dataclass
class UnloadLoRAAdapterReqInput:
    lora_id: str
    lora_name: str


@dataclass
class LoRAAdapterReqOutput:
    """The answer to a load or an unload."""

    success: bool
    error_message: str = ""


@dataclass
class GetInternalStateReqOutput:
    state: dict[str, Any]


# Scheduler -> detokenizer ---------------------------------------------------------------------

# How many prompt tokens the detokenizer decodes the output after, so that the first output token
# decodes the way it does in the full sequence (SentencePiece tokenizers keep its leading space).
INIT_INCREMENTAL_DETOKENIZATION_OFFSET = 5


@dataclass(kw_only=True)
class LogprobOutputs:
    """Per request of a message, None for one that did not ask for logprobs: the output tokens'
    logprobs new since its previous message (the chosen token's; with top_logprobs_num, the
    most likely tokens' values and ids per position), and once, in the message after its prompt
    is prefilled, the prompt's (from logprob_start_len: values, the first None, and ids; top
    ones likewise). Empty lists when no request of the message asked."""

    output_token_logprobs: list[list[float] | None] = field(default_factory=list)
    output_top_logprobs_val: list[list[list[float]] | None] = field(default_factory=list)
    output_top_logprobs_idx: list[list[list[int]] | None] = field(default_factory=list)
    input_token_logprobs_val: list[list[float | None] | None] = field(default_factory=list)
    input_token_logprobs_idx: list[list[int] | None] = field(default_factory=list)
    input_top_logprobs_val: list[list[list[float] | None] | None] = field(default_factory=list)
    input_top_logprobs_idx: list[list[list[int] | None] | None] = field(default_factory=list)

    def logprob_outputs(self) -> dict[str, list]:
        """These fields by name (to pass them on)."""
        return {f.name: getattr(self, f.name) for f in fields(LogprobOutputs)}


@dataclass
class BatchTokenIDOut(LogprobOutputs):
    """One step's outputs. Per request only what is new since its previous message: the output
    ids (and their logprobs) sent before are not sent again, so a long generation costs the same
    per step; the detokenizer keeps each request's ids until its finish reason comes."""

    rids: list[str]
    finished_reasons: list[dict | None]
    output_ids: list[list[int]]  # the output ids new since the request's previous message
    # The last INIT_INCREMENTAL_DETOKENIZATION_OFFSET prompt ids while no output id has been sent
    # (the detokenizer decodes the output after them), None afterwards.
    prompt_tail_ids: list[list[int] | None]
    prompt_tokens: list[int]
    cached_tokens: list[int]
    skip_special_tokens: list[bool]
    no_stop_trim: list[bool]
    spaces_between_special_tokens: list[bool] = field(default_factory=list)  # empty: all True
    # Per request: seconds from arrival to its first prefill batch (None while it waits); empty
    # when the scheduler does not report it. Feeds the per-priority queue-time metric.
    queue_times: list[float | None] = field(default_factory=list)
    # Per request: its verify steps so far (speculative decoding); empty when speculation is off.
    spec_verify_ct: list[int] = field(default_factory=list)
    # Per request, of cached_tokens those read from the storage tier; empty without one.
    cached_tokens_storage: list[int] = field(default_factory=list)
    # Per request, of cached_tokens those loaded back from the host tier; empty without one.
    cached_tokens_host: list[int] = field(default_factory=list)


# Detokenizer -> tokenizer manager -------------------------------------------------------------


@dataclass
class BatchStrOut(LogprobOutputs):
    """Per request, like BatchTokenIDOut, only what is new since its previous message; the text
    of a finished request is its whole final text (decoded once, stop strings trimmed)."""

    rids: list[str]
    finished_reasons: list[dict | None]
    output_strs: list[str]  # unfinished: the text decoded since the previous message; finished: all of it
    output_ids: list[list[int]]  # the output ids new since the previous message
    prompt_tokens: list[int]
    cached_tokens: list[int]
    queue_times: list[float | None] = field(default_factory=list)
    spec_verify_ct: list[int] = field(default_factory=list)  # see BatchTokenIDOut
    # Per request, of cached_tokens those read from the storage tier; empty without one.
    cached_tokens_storage: list[int] = field(default_factory=list)
    # Per request, of cached_tokens those loaded back from the host tier; empty without one.
    cached_tokens_host: list[int] = field(default_factory=list)


# Finish reasons (SGLang's JSON shapes) ---------------------------------------------------------


def finish_length(length: int) -> dict:
    return {"type": "length", "length": length}


def finish_matched_token(token_id: int) -> dict:
    return {"type": "stop", "matched": token_id}


def finish_matched_str(stop: str) -> dict:
    return {"type": "stop", "matched": stop}


def finish_abort(
    message: str, status_code: int = 400, err_type: str = "BadRequestError", param: str | None = None
) -> dict:
    """An aborted request's reason; `param`, when known, names the request field at fault."""
    reason = {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}
    if param is not None:
        reason["param"] = param
    return reason
