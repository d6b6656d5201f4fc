"""What the tokenizer manager yields for a generate request: SGLang's output dict."""

from __future__ import annotations

from typing import NotRequired, TypedDict

# (logprob, token id, the token's text or None)
LogprobTriple = tuple[float, int, str | None]


class MetaInfo(TypedDict):
    id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    finish_reason: dict | None  # None while the request runs
    e2e_latency: float
    spec_verify_ct: NotRequired[int]  # with speculative decoding: the request's verify steps
    # With return_logprob:
    input_token_logprobs: NotRequired[list[LogprobTriple]]
    output_token_logprobs: NotRequired[list[LogprobTriple]]
    output_token_logprobs_length: NotRequired[int]
    # With top_logprobs_num > 0 (None at a position without a distribution: the first prompt token):
    input_top_logprobs: NotRequired[list[list[LogprobTriple] | None]]
    output_top_logprobs: NotRequired[list[list[LogprobTriple] | None]]


class GenerateOutput(TypedDict):
    text: str
    output_ids: list[int]
    meta_info: MetaInfo
