"""A generate request from the front end checked and tokenized once, here, before it goes to the
scheduler (which keeps assertion-level checks only): the prompt (text, chat messages through the
chat template, or input ids in the vocabulary), its length against the context, the sampling
params (the grammar checked by the backend), priority, routing_key and the logprob fields. Every refusal is a
RequestError (a 400) naming the field."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from radixengine.constrained.backend_factory import validate_grammar
from radixengine.managers.io_struct import GenerateReqInput, TokenizedGenerateReqInput
from radixengine.managers.request_errors import RequestError
from radixengine.managers.served_model import max_chars_per_token
from radixengine.sampling.sampling_params import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from radixengine.utils.unicode_check import first_unencodable_path


@dataclass(frozen=True)
class RequestLimits:
    """The scheduler's limits (from its ready message); None where it gave none (test stubs)."""

    vocab_size: int
    context_len: int | None = None
    max_req_input_len: int | None = None  # a prompt has fewer tokens than this
    max_req_len: int | None = None  # prompt + max_new_tokens, at most

    @classmethod
    def from_scheduler_info(cls, info: dict, tokenizer) -> RequestLimits:
        context_len = info.get("context_len")
        return cls(
            vocab_size=info.get("vocab_size") or len(tokenizer),
            context_len=context_len,
            max_req_input_len=info.get("max_req_input_len"),
            max_req_len=info.get("max_req_len") or context_len,
        )


class RequestValidator:
    def __init__(self, tokenizer, limits: RequestLimits, grammar_backend: str) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.vocab_size = limits.vocab_size
        self.grammar_backend = grammar_backend
        self.max_chars_per_token = max_chars_per_token(tokenizer)

    def tokenize_request(self, obj: GenerateReqInput, rid: str) -> TokenizedGenerateReqInput:
        """The request for the scheduler under `rid`; a RequestError if it is refused."""
        check_unicode_fields(obj, rid)
        input_text, input_ids, param = self.tokenize_prompt(obj)
        sampling_params = self.make_sampling_params(obj.sampling_params, len(input_ids))
        self.validate_input_ids(input_ids, sampling_params, param)
        check_scheduling_fields(obj)
        check_logprob_params(obj, len(input_ids), self.vocab_size)
        return TokenizedGenerateReqInput(
            rid=rid,
            input_text=input_text,
            input_ids=input_ids,
            sampling_params=sampling_params,
            stream=obj.stream,
            return_logprob=obj.return_logprob,
            top_logprobs_num=obj.top_logprobs_num if obj.return_logprob else 0,
            logprob_start_len=obj.logprob_start_len if obj.return_logprob else -1,
            priority=obj.priority,
            routing_key=obj.routing_key,
            interactive=obj.interactive,
        )

    def make_sampling_params(self, params: dict | SamplingParams | None, prompt_len: int) -> SamplingParams:
        """`max_new_tokens: None` means up to the end of the context (OpenAI's chat default), and
        absent the default (128) clipped to the room the context leaves; any other None is the
        field's default."""
        if isinstance(params, SamplingParams):
            return self._with_vocab_checked(params)
        if params is not None and not isinstance(params, dict):
            raise RequestError("sampling_params must be an object", param="sampling_params")
        params = self._with_max_new_tokens(params or {}, prompt_len)
        try:
            sampling_params = SamplingParams.from_dict(params)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e), param=_param_of(str(e), params)) from None
        if sampling_params.n != 1:
            raise RequestError(
                "n > 1 is expanded by the front end; the tokenizer manager takes n == 1", param="n"
            )
        return self._with_vocab_checked(sampling_params)

    def _with_max_new_tokens(self, params: dict, prompt_len: int) -> dict:
        """`params` without its None values but max_new_tokens', which becomes the room the context
        leaves; an absent one, the default clipped to that room (SGLang's init_req_max_new_tokens:
        an explicit max_new_tokens past the context stays a 400)."""
        room = (self.limits.max_req_len or prompt_len + DEFAULT_MAX_NEW_TOKENS) - prompt_len
        explicit = {k: v for k, v in params.items() if v is not None}
        if "max_new_tokens" in explicit:
            return explicit
        if "max_new_tokens" in params:  # None: up to the end of the context
            return dict(explicit, max_new_tokens=max(room, 1))
        return dict(explicit, max_new_tokens=max(min(DEFAULT_MAX_NEW_TOKENS, room), 1))

    def _with_vocab_checked(self, sampling_params: SamplingParams) -> SamplingParams:
        """The checks that need the vocabulary (logit_bias's token ids) or the grammar backend."""
        try:
            sampling_params.verify(self.vocab_size)
        except ValueError as e:
            raise RequestError(str(e), param="logit_bias") from None
        if sampling_params.grammar_key is not None:
            self.check_grammar(*sampling_params.grammar_key)
        return sampling_params

    def check_grammar(self, kind: str, text: str, param: str | None = None) -> None:
        """A 400 naming the problem for a grammar the backend cannot use (checked here, before
        the scheduler compiles it)."""
        error = _grammar_error(self.grammar_backend, kind, text)
        if error is not None:
            raise RequestError(error, param=param or kind)

    def tokenize_prompt(self, obj: GenerateReqInput) -> tuple[str | None, list[int], str]:
        obj.prompt_field()
        if obj.messages is not None:
            text = self.apply_chat_template(
                obj.messages, obj.chat_template_kwargs, obj.continue_final_message, obj.tools
            )
            self.check_text_length(text, "messages")
            return text, self.tokenizer.encode(text, add_special_tokens=False), "messages"
        if obj.text is not None:
            if not isinstance(obj.text, str):
                raise RequestError("text must be a string", param="text")
            self.check_text_length(obj.text, "text")
            return obj.text, self.tokenizer.encode(obj.text), "text"
        ids = obj.input_ids
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("input_ids must be a list of integers", param="input_ids")
        return None, list(ids), "input_ids"

    def check_text_length(self, text: str, param: str) -> None:
        """A text longer than the most tokens a prompt may have can cover is refused before it
        is tokenized (a long text would hold the event loop for seconds)."""
        max_tokens, per_token = self.limits.max_req_input_len, self.max_chars_per_token
        if max_tokens is None or per_token is None or len(text) <= (max_tokens - 1) * per_token:
            return
        raise RequestError(
            f"the prompt is too long: {len(text)} characters, more than {max_tokens - 1} tokens (the "
            f"maximum) can cover at {per_token} characters a token at most",
            param=param,
        )

    def apply_chat_template(
        self,
        messages: list[dict],
        kwargs: dict | None = None,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
    ) -> str:
        """The conversation rendered by the chat template; `kwargs` go to the template (e.g.
        Qwen3's enable_thinking), and `tools` (OpenAI function definitions; a template without
        tool support ignores them); `continue_final_message` leaves the last (assistant) message
        open for the model to continue instead of starting a new turn."""
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list", param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise RequestError(f"messages[{i}] must be an object with a role", param="messages")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        if continue_final_message and messages[-1]["role"] != "assistant":
            raise RequestError(
                "continue_final_message needs an assistant message last", param="continue_final_message"
            )
        options = dict(kwargs or {})
        options.update(add_generation_prompt=not continue_final_message, tokenize=False)
        if continue_final_message:
            options["continue_final_message"] = True
        if tools:
            options["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(messages, **options)
        except Exception as e:  # a template that rejects the conversation
            raise RequestError(f"cannot apply the chat template: {e}", param="messages") from None

    def validate_input_ids(self, input_ids: list[int], sampling_params: SamplingParams, param: str) -> None:
        """The prompt's ids in the vocabulary (a tokenizer may know more tokens than the model), its
        length against the context, and room for max_new_tokens."""
        n, limits = len(input_ids), self.limits
        if n == 0:
            raise RequestError("the prompt is empty", param=param)
        bad = next((t for t in input_ids if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            name = "input_ids" if param == "input_ids" else "the prompt's token ids"
            raise RequestError(f"{name} must be in [0, {limits.vocab_size}); got {bad}", param=param)
        if limits.max_req_input_len is not None and n >= limits.max_req_input_len:
            raise RequestError(
                f"the prompt is too long: {n} tokens, the maximum is {limits.max_req_input_len - 1}",
                param=param,
            )
        max_new = sampling_params.max_new_tokens
        if limits.max_req_len is not None and n + max_new > limits.max_req_len:
            raise RequestError(
                f"the prompt ({n} tokens) plus max_new_tokens ({max_new}) exceeds the {limits.max_req_len} "
                f"tokens a request may have (context length {limits.context_len})",
                param="max_new_tokens" if n < limits.max_req_len else param,
            )


def check_unicode_fields(obj: GenerateReqInput, rid: str) -> None:
    """Every string of the request encodable as UTF-8 (JSON's `"\\ud800"` gives a lone surrogate,
    which the tokenizer, the stop-string window and the answer's encoder refuse); the field named
    by its path (`text`, `messages[0].content`, `stop[1]`, ...)."""
    params = obj.sampling_params
    fields = {
        "rid": rid,
        "text": obj.text,
        "messages": obj.messages,
        "tools": obj.tools,
        "chat_template_kwargs": obj.chat_template_kwargs,
        "routing_key": obj.routing_key,
        "": vars(params) if isinstance(params, SamplingParams) else params,
    }
    for root, value in fields.items():
        path = first_unencodable_path(value, root)
        if path is not None:
            if path == "body":
                path = "sampling_params"
            raise RequestError(f"{path}: not valid Unicode text (a lone UTF-16 surrogate)", param=path)


def check_scheduling_fields(obj: GenerateReqInput) -> None:
    """priority (an integer) and routing_key (a string, the tenant of --schedule-policy dlpm)."""
    if obj.priority is not None and (not isinstance(obj.priority, int) or isinstance(obj.priority, bool)):
        raise RequestError(f"priority must be an integer, got {obj.priority!r}", param="priority")
    if obj.routing_key is not None and not isinstance(obj.routing_key, str):
        raise RequestError(f"routing_key must be a string, got {obj.routing_key!r}", param="routing_key")


def check_logprob_params(obj: GenerateReqInput, input_len: int, vocab_size: int) -> None:
    """SGLang's logprob fields: `None` means the default; top_logprobs_num in [0, vocab size];
    logprob_start_len -1 (no prompt logprobs) or a position in the prompt (with return_logprob)."""
    for name, default in (("top_logprobs_num", 0), ("logprob_start_len", -1)):
        value = getattr(obj, name)
        if value is None:
            setattr(obj, name, default)
        elif not isinstance(value, int) or isinstance(value, bool):
            raise RequestError(f"{name} must be an integer, got {value!r}", param=name)
    for name in ("return_logprob", "return_text_in_logprobs"):
        if getattr(obj, name) is None:
            setattr(obj, name, False)
        elif not isinstance(getattr(obj, name), bool):
            raise RequestError(f"{name} must be a boolean", param=name)
    if not 0 <= obj.top_logprobs_num <= vocab_size:
        raise RequestError(
            f"top_logprobs_num must be in [0, {vocab_size}] (the vocabulary size), got {obj.top_logprobs_num}",
            param="top_logprobs_num",
        )
    if obj.return_logprob and not -1 <= obj.logprob_start_len <= input_len:
        raise RequestError(
            f"logprob_start_len must be -1 (no prompt logprobs) or in [0, {input_len}] (the number of "
            f"input tokens), got {obj.logprob_start_len}",
            param="logprob_start_len",
        )


@functools.lru_cache(maxsize=256)
def _grammar_error(backend: str, kind: str, text: str) -> str | None:
    return validate_grammar(backend, kind, text)


def _param_of(message: str, params: dict | None) -> str:
    """The sampling parameter an error message names: the longest one it starts with (`stop_regex`,
    not `stop`), else the first it mentions."""
    starts = [name for name in params or {} if message.startswith(name)]
    if starts:
        return max(starts, key=len)
    for name in params or {}:
        if message.startswith(name) or f" {name}" in message or f"{name} " in message:
            return name
    return "sampling_params"
