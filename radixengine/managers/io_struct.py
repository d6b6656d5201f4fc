"""Messages between the tokenizer manager, the scheduler and the detokenizer (pickled over ZMQ)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from radixengine.sampling.sampling_params import SamplingParams

# Front end (Engine, HTTP) -> tokenizer manager ------------------------------------------------


@dataclass
class GenerateReqInput:
    """One request as the front end hands it to the tokenizer manager: exactly one of `text`,
    `input_ids` or `messages` (chat, rendered with the tokenizer's chat template, given
    `chat_template_kwargs` and `tools`; `continue_final_message` continues the last assistant
    message instead of opening a new one). `log_metrics=False` keeps it out of the metrics (SGLang's
    health checks)."""

    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict] | None = None
    sampling_params: dict | None = None
    rid: str | None = None
    stream: bool = False
    # SGLang's logprob fields: with return_logprob, the chosen tokens' logprobs, the
    # top_logprobs_num most likely tokens' at each position, and the prompt's from
    # logprob_start_len (-1: none); return_text_in_logprobs decodes each token's text.
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False
    priority: int | None = None
    routing_key: str | None = None  # the tenant, for --schedule-policy dlpm (SGLang's field)
    chat_template_kwargs: dict | None = None
    continue_final_message: bool = False
    tools: list[dict] | None = None  # OpenAI tool definitions, for the chat template
    log_metrics: bool = True


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
class GetInternalStateReq:
    pass


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
    # Per request: seconds from arrival to its first prefill batch (None while it waits); empty
    # when the scheduler does not report it. Feeds the per-priority queue-time metric.
    queue_times: list[float | None] = field(default_factory=list)


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


# Finish reasons (SGLang's JSON shapes) ---------------------------------------------------------


def finish_length(length: int) -> dict:
    return {"type": "length", "length": length}


def finish_matched_token(token_id: int) -> dict:
    return {"type": "stop", "matched": token_id}


def finish_matched_str(stop: str) -> dict:
    return {"type": "stop", "matched": stop}


def finish_abort(message: str, status_code: int = 400, err_type: str = "BadRequestError") -> dict:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}
