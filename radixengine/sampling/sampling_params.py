"""SamplingParams: SGLang's per-request sampling fields, defaults and validation."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields

_EPS = 1e-6
MAX_N = 128  # samples per prompt, OpenAI's documented maximum
DEFAULT_MAX_NEW_TOKENS = 128
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")


@dataclass
class SamplingParams:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # Regular expressions searched in the decoded output's tail after each token: the first match
    # ends the request (SGLang's; finish_reason `{"type": "stop", "matched": pattern}`).
    stop_regex: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # token id (a string, as OpenAI's JSON has it) -> bias
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # SGLang's; only slow (Python) tokenizers use it
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    n: int = 1
    # Constrained decoding (at most one): a JSON schema as a JSON string ("$$ANY$$" = any JSON),
    # a regular expression, an EBNF grammar, or an xgrammar structural tag as a JSON string.
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_strs: list[str] = field(default_factory=list, init=False, repr=False)
    stop_regex_strs: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.verify()
        self.stop_strs = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_regex_strs = _as_list(self.stop_regex)
        if self.temperature < _EPS:
            # Greedy: argmax, whatever top_k / top_p say.
            self.temperature, self.top_k = 1.0, 1

    @classmethod
    def from_dict(cls, params: dict | None) -> SamplingParams:
        params = dict(params or {})
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**params)

    @property
    def is_greedy(self) -> bool:
        return self.top_k == 1

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar (the compile cache's key), or None."""
        for kind in GRAMMAR_FIELDS:
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler needs this request's output token counts."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0

    def logit_bias_by_id(self) -> dict[int, float]:
        """logit_bias keyed by int token id (of keys naming the same id, the last wins, as in SGLang)."""
        return {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first parameter that is out of range or of the wrong type."""
        _verify_lengths(self)
        _verify_sampling(self)
        _verify_penalties(self)
        _verify_logit_bias(self.logit_bias, vocab_size)
        _verify_n_and_seed(self)
        _verify_stops(self)
        _verify_stop_regex(self.stop_regex)
        _verify_grammar_fields(self)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")


def _verify_lengths(params: SamplingParams) -> None:
    _int("max_new_tokens", params.max_new_tokens, minimum=0)
    _int("min_new_tokens", params.min_new_tokens, minimum=0)
    if params.min_new_tokens > params.max_new_tokens:
        raise ValueError(
            f"min_new_tokens ({params.min_new_tokens}) must be <= max_new_tokens ({params.max_new_tokens})"
        )


def _verify_sampling(params: SamplingParams) -> None:
    _number("temperature", params.temperature)
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    _number("top_p", params.top_p)
    if not 0.0 < params.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    _int("top_k", params.top_k)
    if params.top_k == 0 or params.top_k < -1:
        raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {params.top_k}")
    _number("min_p", params.min_p)
    if not 0.0 <= params.min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")


def _verify_penalties(params: SamplingParams) -> None:
    for name in ("frequency_penalty", "presence_penalty"):
        _number(name, getattr(params, name))
        if not -2.0 <= getattr(params, name) <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(params, name)}")
    _number("repetition_penalty", params.repetition_penalty)
    if not 0.0 < params.repetition_penalty <= 2.0:
        raise ValueError(
            f"repetition_penalty must be in (0, 2] (1 = no penalty), got {params.repetition_penalty}"
        )


def _verify_n_and_seed(params: SamplingParams) -> None:
    _int("n", params.n, minimum=1)
    if params.n > MAX_N:
        raise ValueError(f"n must be at most {MAX_N}, got {params.n}")
    if params.sampling_seed is not None:
        _int("sampling_seed", params.sampling_seed, minimum=0)


def _verify_stops(params: SamplingParams) -> None:
    if params.stop is not None:
        stops = [params.stop] if isinstance(params.stop, str) else params.stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
    if params.stop_token_ids is not None:
        if not isinstance(params.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in params.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be a list of non-negative integers")


def _as_list(value: str | list[str] | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _verify_stop_regex(stop_regex) -> None:
    patterns = _as_list(stop_regex) if isinstance(stop_regex, (str, list, type(None))) else [None]
    if not all(isinstance(p, str) and p for p in patterns):
        raise ValueError("stop_regex must be a non-empty string or a list of non-empty strings")
    for pattern in patterns:
        try:
            re.compile(pattern)
        except (re.error, RecursionError, OverflowError) as e:
            raise ValueError(f"stop_regex {pattern!r} is not a valid regular expression: {e}") from None


def _verify_grammar_fields(params: SamplingParams) -> None:
    set_fields = [name for name in GRAMMAR_FIELDS if getattr(params, name) is not None]
    for name in set_fields:
        if not isinstance(getattr(params, name), str) or not getattr(params, name):
            raise ValueError(f"{name} must be a non-empty string, got {getattr(params, name)!r}")
    if len(set_fields) > 1:
        raise ValueError(
            f"Only one of regex, json_schema, ebnf or structural_tag can be set, got {', '.join(set_fields)}"
        )


def _verify_logit_bias(logit_bias, vocab_size: int | None) -> None:
    if logit_bias is None:
        return
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be an object mapping token ids to biases, got {logit_bias!r}")
    for key, bias in logit_bias.items():
        is_id = isinstance(key, int) and not isinstance(key, bool) and key >= 0
        if not (is_id or (isinstance(key, str) and key.isascii() and key.isdigit())):
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        if vocab_size is not None and int(key) >= vocab_size:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size - 1}], got {key}")
        if not isinstance(bias, (int, float)) or isinstance(bias, bool) or not -100.0 <= bias <= 100.0:
            raise ValueError(
                f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {key}"
            )


def _int(name: str, value, minimum: int | None = None) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _number(name: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
