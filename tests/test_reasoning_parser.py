"""`--reasoning-parser`: a reasoning model's `<think>` block into `reasoning_content`.

The parsers (SGLang's qwen3 and deepseek-r1) on their models' output, whole and streamed in
chunks cut at every position; fixed model outputs through the chat answer and stream builders
(reasoning, text and tool calls together, `separate_reasoning`, `stream_reasoning`); and a tiny
random Llama served with a template that opens `<think>` (Qwen3's `enable_thinking` switch),
its output held by a regex to close the block, through the openai client."""

from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import openai
import pytest
from test_engine_utils import build_tiny_model, launch_test_server, stop_test_server

from radixengine.entrypoints import openai_serving as oai
from radixengine.entrypoints import openai_streams
from radixengine.entrypoints.openai_protocol import ChatCompletionRequest
from radixengine.parser.reasoning_parser import ReasoningParser
from radixengine.server_args import ServerArgs

# (parser, force_reasoning, model text, reasoning, answer)
OUTPUTS = [
    ("qwen3", True, "<think>\nThe user greets me. 2 + 2 = 4.\n</think>\n\nHello! 2 + 2 = 4.",
     "\nThe user greets me. 2 + 2 = 4.\n", "\n\nHello! 2 + 2 = 4."),
    ("qwen3", False, "Hello! 2 + 2 = 4.", "", "Hello! 2 + 2 = 4."),  # enable_thinking false
    ("qwen3", False, "<think>short</think>Answer with a </think> inside", "short",
     "Answer with a </think> inside"),
    ("qwen3", True, "<think>\nI should call the tool.\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
     "\nI should call the tool.\n", "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>"),
    ("qwen3", True, "<think>\nCut short by max_tokens, never clo", "\nCut short by max_tokens, never clo", ""),
    ("deepseek-r1", False, "Okay, the user asks for 6 x 7.\n</think>\n\n6 x 7 = 42.",
     "Okay, the user asks for 6 x 7.\n", "\n\n6 x 7 = 42."),
    ("deepseek-r1", False, "<think>\nHmm.\n</think>42", "\nHmm.\n", "42"),
    ("deepseek-r1", False, "still thinking </thi", "still thinking </thi", ""),
    ("qwen3", False, "An answer that ends in <thi", "", "An answer that ends in <thi"),
]  # fmt: skip


def streamed(parser: str, force: bool, chunks: list[str], stream_reasoning: bool) -> tuple[str, str, int]:
    p = ReasoningParser(parser, stream_reasoning=stream_reasoning, force_reasoning=force)
    reasoning, answer, pieces = "", "", 0
    for chunk in chunks:
        r, a = p.parse_stream_chunk(chunk)
        reasoning, answer, pieces = reasoning + r, answer + a, pieces + bool(r)
    r, a = p.parse_stream_end()
    return reasoning + r, answer + a, pieces + bool(r)


@pytest.mark.parametrize("parser, force, text, reasoning, answer", OUTPUTS)
def test_parse_whole_and_streamed_at_every_cut(parser, force, text, reasoning, answer):
    assert ReasoningParser(parser, force_reasoning=force).parse_non_stream(text) == (reasoning, answer)
    for stream_reasoning in (True, False):
        for cut in range(len(text) + 1):
            got = streamed(parser, force, [text[:cut], text[cut:]], stream_reasoning)
            assert got[:2] == (reasoning, answer), (stream_reasoning, cut)
        got = streamed(parser, force, list(text), stream_reasoning)
        assert got[:2] == (reasoning, answer)
        if reasoning and "</think>" in text:
            # streamed as it comes, or in one piece when the block ends
            assert got[2] > 1 if stream_reasoning else got[2] == 1


# Fixed outputs through the chat answer and stream builders -------------------------------------


def front_end(**server_args):
    """What the builders read of the tokenizer manager: its server args."""
    return SimpleNamespace(server_args=ServerArgs(model_path="unused", device="cpu", **server_args))


def outputs(text: str, step: int) -> list[dict]:
    """The tokenizer manager's streamed outputs of `text`, `step` characters a step."""
    outs = []
    for end in range(step, len(text) + step, step):
        done = end >= len(text)
        meta = {"finish_reason": {"type": "stop", "matched": 2} if done else None}
        outs.append({"text": text[:end], "output_ids": list(range(min(end, len(text)))), "meta_info": meta})
    return outs


def stream_deltas(tm, body: dict, text: str, step: int) -> list[dict]:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    req.model = "m"

    async def outs():
        for out in outputs(text, step):
            yield 0, out

    async def run():
        return [c async for c in openai_streams.chat_stream(tm, req, outs())]

    chunks = asyncio.run(run())
    return [c["choices"][0] for c in chunks]


def answer(tm, body: dict, text: str) -> dict:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    req.model = "m"
    out = outputs(text, len(text))[-1]
    out["meta_info"].update(prompt_tokens=1, cached_tokens=0, completion_tokens=1)
    return oai.chat_response(tm, req, [out])["choices"][0]


def joined(choices: list[dict], key: str) -> str:
    return "".join(c["delta"].get(key) or "" for c in choices)


QWEN3_CALL = (
    "<think>\nThe user wants the weather: call get_weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_reasoning_and_tool_calls_in_answers_and_streams(step):
    tm = front_end(reasoning_parser="qwen3", tool_call_parser="qwen25")
    body = {"tools": [WEATHER]}
    whole = answer(tm, body, QWEN3_CALL)
    message = whole["message"]
    assert message["reasoning_content"] == "\nThe user wants the weather: call get_weather.\n"
    assert message["content"] == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert whole["finish_reason"] == "tool_calls"

    choices = stream_deltas(tm, body, QWEN3_CALL, step)
    assert joined(choices, "reasoning_content") == message["reasoning_content"]
    assert joined(choices, "content") == ""
    pieces = [tc for c in choices for tc in c["delta"].get("tool_calls") or []]
    assert pieces[0]["function"] == {"name": "get_weather", "arguments": ""} and pieces[0]["id"].startswith(
        "call_"
    )
    assert "".join(p["function"]["arguments"] for p in pieces) == '{"city": "Paris"}'
    assert [c["finish_reason"] for c in choices][-1] == "tool_calls"
    assert all(c["finish_reason"] is None for c in choices[:-1])


def test_separate_and_stream_reasoning_switches():
    tm = front_end(reasoning_parser="deepseek-r1")
    text = "Okay, 6 x 7.\n</think>\n\n6 x 7 = 42."
    assert answer(tm, {}, text)["message"] == {
        "role": "assistant", "content": "\n\n6 x 7 = 42.", "reasoning_content": "Okay, 6 x 7.\n"
    }  # fmt: skip
    assert answer(tm, {"separate_reasoning": False}, text)["message"] == {
        "role": "assistant",
        "content": text,
    }
    assert joined(stream_deltas(tm, {"separate_reasoning": False}, text, 2), "content") == text
    pieces = [
        c["delta"]["reasoning_content"]
        for c in stream_deltas(tm, {}, text, 2)
        if "reasoning_content" in c["delta"]
    ]
    assert len(pieces) > 1 and "".join(pieces) == "Okay, 6 x 7.\n"
    choices = stream_deltas(tm, {"stream_reasoning": False}, text, 2)
    assert [c["delta"]["reasoning_content"] for c in choices if "reasoning_content" in c["delta"]] == [
        "Okay, 6 x 7.\n"
    ]
    assert joined(choices, "content") == "\n\n6 x 7 = 42."
    # no parser: the text as it is, no reasoning_content field
    assert answer(front_end(), {}, text)["message"] == {"role": "assistant", "content": text}


def test_qwen3_enable_thinking_false_reads_no_reasoning():
    tm = front_end(reasoning_parser="qwen3")
    text = "Hello! </think> is just text here."
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert answer(tm, off, text)["message"]["content"] == text
    assert answer(tm, off, text)["message"]["reasoning_content"] is None
    assert answer(tm, {}, text)["message"]["reasoning_content"] == "Hello! "


# A tiny random Llama whose template opens the reasoning block ---------------------------------

THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
# The output must close the block: what a reasoning model does, here held by a regex.
THOUGHT = r"[a-z]{1,8}( [a-z]{1,8}){0,3}</think>[a-z]{1,8}( [a-z]{1,8}){0,3}"
MESSAGES = [{"role": "user", "content": "hello world this is a test"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("reasoning")
    model = build_tiny_model(str(root / "model"))
    template = root / "template.jinja"
    template.write_text(THINKING_TEMPLATE)
    args = ["--dtype", "float32", "--num-threads", "1", "--max-total-tokens", "8192",
            "--chat-template", str(template), "--reasoning-parser", "qwen3"]  # fmt: skip
    proc = launch_test_server(model, root / "server.log", args)
    yield openai.OpenAI(base_url=proc.base_url + "/v1", api_key="none", max_retries=0)
    stop_test_server(proc)


def chat(client, stream: bool = False, **extra):
    return client.chat.completions.create(
        model="m", messages=MESSAGES, temperature=0, max_tokens=120, stream=stream,
        extra_body={"regex": THOUGHT, **extra},
    )  # fmt: skip


def test_tiny_model_reasoning_content(client):
    raw = chat(client, separate_reasoning=False).choices[0].message
    assert re.fullmatch(THOUGHT, raw.content) and getattr(raw, "reasoning_content", None) is None
    thought, said = raw.content.split("</think>")

    message = chat(client).choices[0].message
    assert (message.reasoning_content, message.content) == (thought, said)

    chunks = [c.choices[0].delta for c in chat(client, stream=True) if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in chunks) == thought
    assert "".join(d.content or "" for d in chunks) == said
    chunks = [c.choices[0].delta for c in chat(client, stream=True, stream_reasoning=False) if c.choices]
    assert [d.reasoning_content for d in chunks if getattr(d, "reasoning_content", None)] == [thought]

    # enable_thinking false: the template closes the block in the prompt; nothing is reasoning
    off = chat(client, chat_template_kwargs={"enable_thinking": False}).choices[0].message
    assert off.reasoning_content is None and re.fullmatch(THOUGHT, off.content)
