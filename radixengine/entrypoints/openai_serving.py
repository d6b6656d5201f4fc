"""The OpenAI-compatible routes' logic: request → GenerateReqInput(s) (one per prompt and choice),
outputs → OpenAI response objects (the stream chunks: openai_streams.py)."""

from __future__ import annotations

import json

from radixengine.entrypoints.chat_output_parser import ChatOutputParser
from radixengine.entrypoints.chat_tools import (
    CONSTRAINT_FIELDS,
    add_tool_params,
    check_tools,
    is_forced,
    template_tool_calls,
    template_tools,
    tools_active,
)
from radixengine.entrypoints.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    UsageInfo,
    make_id,
    now,
)
from radixengine.managers.io_struct import GenerateReqInput
from radixengine.managers.request_errors import RequestError
from radixengine.managers.tokenizer_manager import TokenizerManager
from radixengine.sampling.sampling_params import MAX_N

MAX_LOGPROBS = 20


# Requests -------------------------------------------------------------------------------------


def check_unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Parameters we do not implement are refused unless they have their default value."""
    if isinstance(req, CompletionRequest):
        if req.best_of not in (None, 1):
            raise RequestError("best_of is not supported (only 1)", param="best_of")
        if req.suffix:
            raise RequestError("suffix is not supported", param="suffix")


def lora_adapter_of(tm: TokenizerManager, req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The LoRA adapter a request names (None: the base model): `lora_path`, else `model` when it
    is an adapter's name or SGLang's `base:adapter` (an unknown adapter there is a 400), or the
    name of an adapter that was unloaded (a 400: its requests must not get the base model's
    output); any other `model` means the one base model."""
    if req.lora_path is not None:
        tm.lora.resolve(req.lora_path)
        return req.lora_path
    model = req.model
    if model is None or model == tm.served_model_name or not tm.lora.enabled:
        return None
    if model in tm.lora.registry or tm.lora.registry.was_unloaded(model):
        tm.lora.resolve(model, param="model")
        return model
    if ":" in model:
        adapter = (
            model[len(tm.served_model_name) + 1 :]
            if model.startswith(tm.served_model_name + ":")
            else model.rsplit(":", 1)[1]
        )
        tm.lora.resolve(adapter, param="model")
        return adapter
    return None


def sampling_params_of(
    req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None, param: str, least: int = 1
) -> dict:
    if max_tokens is not None and max_tokens < least:
        raise RequestError(f"{param} must be at least {least}, got {max_tokens}", param=param)
    if req.temperature < 0:
        raise RequestError(f"temperature must be >= 0, got {req.temperature}", param="temperature")
    if not 0 < req.top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    if not 1 <= req.n <= MAX_N:
        raise RequestError(f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    if req.seed is not None and req.seed < 0:
        raise RequestError(f"seed must be >= 0, got {req.seed}", param="seed")
    params = {
        "max_new_tokens": max_tokens,
        "min_new_tokens": req.min_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "stop_regex": req.stop_regex,
        "ignore_eos": req.ignore_eos,
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
        "no_stop_trim": req.no_stop_trim,
        "sampling_seed": req.seed,
    }
    for name in ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias"):
        if getattr(req, name, None) is not None:
            params[name] = getattr(req, name)
    params.update(constraint_params(req))
    return params


def constraint_params(req: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    """The request's grammar as SGLang's sampling parameter (at most one): `response_format`
    json_object -> json_schema '{"type": "object"}', json_schema -> its schema as a JSON string,
    structural_tag -> the response_format as a JSON string; or the `json_schema` / `regex` /
    `ebnf` extras (strings) as they are."""
    params = {name: getattr(req, name) for name in ("json_schema", "regex", "ebnf") if getattr(req, name)}
    fmt = req.response_format
    kind = "text" if fmt is None else fmt.get("type", "text")
    if kind == "json_object":
        params["response_format"] = json.dumps({"type": "object"})
    elif kind == "json_schema":
        params["response_format"] = json.dumps(_response_schema(fmt))
    elif kind == "structural_tag":
        params["response_format"] = json.dumps(fmt)
    elif kind != "text":
        raise RequestError(
            f"response_format.type must be one of text, json_object, json_schema, structural_tag; got {kind!r}",
            param="response_format",
        )
    if len(params) > 1:
        raise RequestError(
            f"Only one of response_format, json_schema, regex or ebnf can be set, got {', '.join(params)}",
            param=next(name for name in params if name != "response_format"),
        )
    if "response_format" in params:
        params["structural_tag" if kind == "structural_tag" else "json_schema"] = params.pop(
            "response_format"
        )
    return params


def check_constraint(
    tm: TokenizerManager, req: CompletionRequest | ChatCompletionRequest, params: dict
) -> None:
    """A 400 naming the field the bad grammar came from (response_format or the extra)."""
    for kind in ("json_schema", "regex", "ebnf", "structural_tag"):
        if params.get(kind) is not None:
            from_format = req.response_format is not None and not getattr(req, kind, None)
            tm.check_grammar(kind, params[kind], "response_format" if from_format else kind)


def grammar_field(req: CompletionRequest | ChatCompletionRequest, params: dict) -> str | None:
    """The field the request's grammar came from where it is not the grammar's own extra (as
    check_constraint names them): response_format, or tools for a forced call."""
    kind = next((name for name in CONSTRAINT_FIELDS if params.get(name) is not None), None)
    if kind is None or getattr(req, kind, None):
        return None
    if isinstance(req, ChatCompletionRequest) and tools_active(req) and is_forced(req):
        return "tools"
    return "response_format" if req.response_format is not None else None


def _response_schema(fmt: dict) -> dict | bool:
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise RequestError(
            "response_format.json_schema must be an object with a schema", param="response_format"
        )
    schema = spec.get("schema", spec.get("schema_"))
    if not isinstance(schema, (dict, bool)):
        raise RequestError(
            "response_format.json_schema.schema is required (a JSON Schema object)", param="response_format"
        )
    return schema


def completion_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise RequestError("prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def completion_requests(tm: TokenizerManager, req: CompletionRequest):
    check_unsupported(req)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise RequestError(f"logprobs must be in [0, {MAX_LOGPROBS}]", param="logprobs")
    # max_tokens 0 scores an echoed prompt (its logprobs, no new token), as OpenAI and vLLM take it
    params = sampling_params_of(req, req.max_tokens, "max_tokens", least=0 if req.echo else 1)
    check_constraint(tm, req, params)
    prompts = completion_prompts(req.prompt)
    kind = "text" if isinstance(prompts[0], str) else "input_ids"
    batch = GenerateReqInput(
        **{kind: prompts[0] if len(prompts) == 1 else prompts},
        sampling_params={**params, "n": req.n},
        rid=req.rid,
        stream=req.stream,
        priority=req.priority,
        lora_path=lora_adapter_of(tm, req),
        grammar_field=grammar_field(req, params),
        **completion_logprob_args(req),
    )
    return batch.normalize_batch_and_arguments()[0], prompts


def completion_logprob_args(req: CompletionRequest) -> dict:
    """`logprobs: N` asks for the sampled tokens' logprobs and the N most likely tokens'; with
    `echo`, the prompt's too (from its first token, whose logprob is null; SGLang asks for them
    only when N > 0, here for N = 0 as well, so that the tokens cover the echoed prompt)."""
    if req.logprobs is None:
        return {}
    return {
        "return_logprob": True,
        "top_logprobs_num": req.logprobs,
        "logprob_start_len": 0 if req.echo else -1,
        "return_text_in_logprobs": True,
    }


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    if not req.messages:
        raise RequestError("messages must not be empty", param="messages")
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text":
                    raise RequestError(
                        f"content parts of type {part.type!r} are not supported: this server takes text "
                        'only ({"type": "text", "text": ...})',
                        param=f"messages[{i}].content[{j}].type",
                    )
            content = " ".join(part.text or "" for part in content)  # SGLang's join of text parts
        message = {"role": m.role, "content": content or ""}
        tool_calls = template_tool_calls(i, m)
        if tool_calls is not None:
            message["tool_calls"] = tool_calls
        for name in ("name", "tool_call_id", "reasoning_content"):
            if getattr(m, name) is not None:
                message[name] = getattr(m, name)
        messages.append(message)
    return messages


def apply_sampling_defaults(req: ChatCompletionRequest, defaults: dict) -> None:
    """The model's generation_config.json values for the sampling fields the request left unset
    (SGLang's `--sampling-defaults model`, chat only as in SGLang)."""
    for name, value in defaults.items():
        if name not in req.model_fields_set:
            setattr(req, name, value)


def chat_requests(tm: TokenizerManager, req: ChatCompletionRequest) -> list[GenerateReqInput]:
    check_unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise RequestError("logprobs must be true when top_logprobs is set", param="top_logprobs")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise RequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}]", param="top_logprobs")
    if req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, param = req.max_tokens, "max_tokens"
    check_tools(req)
    params = sampling_params_of(req, max_tokens, param)
    check_constraint(tm, req, params)
    add_tool_params(tm, req, params)
    batch = GenerateReqInput(
        messages=chat_messages(req),
        sampling_params={**params, "n": req.n},
        rid=req.rid,
        tools=template_tools(req),
        stream=req.stream,
        return_logprob=req.logprobs,
        top_logprobs_num=(req.top_logprobs or 0) if req.logprobs else 0,
        return_text_in_logprobs=True,
        priority=req.priority,
        chat_template_kwargs=req.chat_template_kwargs,
        continue_final_message=req.continue_final_message,
        lora_path=lora_adapter_of(tm, req),
        grammar_field=grammar_field(req, params),
    )
    return batch.normalize_batch_and_arguments()[0]


# Responses ------------------------------------------------------------------------------------


def finish_reason_of(out: dict) -> tuple[str | None, object]:
    reason = out["meta_info"]["finish_reason"]
    if not reason:
        return None, None
    return ("length" if reason["type"] == "length" else "stop"), reason.get("matched")


def usage_of(outs: list[dict], n: int) -> dict:
    firsts = outs[::n]  # one choice per prompt: the prompt counts once
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in firsts)
    cached = sum(o["meta_info"]["cached_tokens"] for o in firsts)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details={"cached_tokens": cached},
    ).model_dump()


def completion_logprobs(token_logprobs: list, top_logprobs: list, top: int, offset: int) -> dict:
    """OpenAI's completions logprobs from SGLang's meta_info triples `(logprob, id, text)`:
    `top_logprobs` maps each of the `top` most likely tokens' text to its logprob (null where
    there is no distribution: the first prompt token under `echo`)."""
    tokens = [text for _, _, text in token_logprobs]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    tops = None
    if top > 0:
        tops = [None if alts is None else {text: lp for lp, _, text in alts} for alts in top_logprobs]
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _, _ in token_logprobs],
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(token_logprobs: list, top_logprobs: list, top: int) -> dict:
    """OpenAI's chat logprobs from SGLang's meta_info triples: per token its text, logprob and
    UTF-8 bytes, and the `top` most likely tokens likewise."""

    def entry(lp: float, text: str) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for k, (lp, _, text) in enumerate(token_logprobs):
        alts = top_logprobs[k] if top and k < len(top_logprobs) else None
        content.append({**entry(lp, text), "top_logprobs": [entry(v, t) for v, _, t in alts or []]})
    return {"content": content}


def logprobs_of(out: dict, prefix: str) -> tuple[list, list]:
    meta = out["meta_info"]
    return meta.get(f"{prefix}_token_logprobs") or [], meta.get(f"{prefix}_top_logprobs") or []


def echo_text(tm: TokenizerManager, prompt: str | list[int]) -> str:
    """The prompt as `echo` puts it before the completion (ids decoded without special tokens)."""
    return prompt if isinstance(prompt, str) else tm.tokenizer.decode(prompt, skip_special_tokens=True)


def completion_response(
    tm: TokenizerManager, req: CompletionRequest, outs: list[dict], prompts: list
) -> dict:
    choices = []
    for i, out in enumerate(outs):
        text = out["text"]
        if req.echo:
            text = echo_text(tm, prompts[i // req.n]) + text
        reason, matched = finish_reason_of(out)
        lp = None
        if req.logprobs is not None:
            tokens, tops = logprobs_of(out, "output")
            if req.echo:
                in_tokens, in_tops = logprobs_of(out, "input")
                tokens, tops = in_tokens + tokens, in_tops + tops
            lp = completion_logprobs(tokens, tops, req.logprobs, 0)
        choices.append(
            {"index": i, "text": text, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}
        )
    return {
        "id": make_id("cmpl"),
        "object": "text_completion",
        "created": now(),
        "model": req.model,
        "choices": choices,
        "usage": usage_of(outs, req.n),
    }


def output_parser(tm: TokenizerManager, req: ChatCompletionRequest) -> ChatOutputParser:
    return ChatOutputParser(req, tm.server_args)


def chat_message(parsing: ChatOutputParser, text: str) -> dict:
    """The assistant message of a whole answer: its content, and with the parsers its
    reasoning_content and tool_calls."""
    if not parsing.active:
        return {"role": "assistant", "content": text}
    parsed = parsing.parse(text)
    message = {"role": "assistant", "content": parsed.content}
    if parsing.reports_reasoning:
        message["reasoning_content"] = parsed.reasoning_content
    if parsed.tool_calls:
        message["tool_calls"] = parsed.tool_calls
    return message


def chat_response(tm: TokenizerManager, req: ChatCompletionRequest, outs: list[dict]) -> dict:
    choices = []
    parsing = output_parser(tm, req)
    for i, out in enumerate(outs):
        reason, matched = finish_reason_of(out)
        lp = None
        if req.logprobs:
            lp = chat_logprobs(*logprobs_of(out, "output"), req.top_logprobs or 0)
        message = chat_message(parsing, out["text"])
        if message.get("tool_calls") and reason == "stop":
            reason, matched = "tool_calls", None
        choices.append(
            {"index": i, "message": message, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}
        )
    return {
        "id": make_id("chatcmpl"),
        "object": "chat.completion",
        "created": now(),
        "model": req.model,
        "choices": choices,
        "usage": usage_of(outs, req.n),
    }
