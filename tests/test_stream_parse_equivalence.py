"""A chat choice's stream says what its whole answer says (docs/api.md's promise), for every
tool-call parser and reasoning parser: the model text is cut at every position (and fed one
character at a time), streamed through the chat output parser, and its content, reasoning and
calls (names, arguments put together) compared with the one-go parse of the same text."""

from __future__ import annotations

import pytest

from radixengine.entrypoints.chat_output_parser import ChatOutputParser
from radixengine.entrypoints.openai_protocol import ChatCompletionRequest
from radixengine.server_args import ServerArgs

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}  # fmt: skip
QWEN_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'

# (id, tool_call_parser, reasoning_parser, tool_choice, model text)
CASES = [
    # a. a forced call (the JSON array) cut short by max_tokens
    ("array-cut", None, None, "required", '[{"name": "get_weather", "parameters": {"city": "Pa'),
    ("array-cut-name", None, None, "required", '[{"name": "get_wea'),
    ("array-whole", None, None, "required",
     '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'),
    # b. a call of an unknown function before a valid one
    ("qwen-unknown-first", "qwen25", None, "auto",
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>\n' + QWEN_CALL),
    ("qwen-text-and-calls", "qwen25", None, "auto", "Let me see.\n" + QWEN_CALL + "\n" + QWEN_CALL),
    ("qwen-cut", "qwen25", None, "auto", 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "C'),
    ("llama-unknown-first", "llama3", None, "auto",
     '<|python_tag|>{"name": "rm_rf", "parameters": {}};{"name": "get_time", "parameters": {"zone": "CET"}}'),
    # c. quotes inside JSON strings and plain text
    ("llama-quotes", "llama3", None, "auto",
     '{"name": "get_weather", "parameters": {"city": "O\'Hare \'x\': \'y\'", "unit": "c"}}'),
    ("llama-plain-quotes", "llama3", None, "auto", "It's 'fine': 'really', thanks"),
    ("llama-python-dict", "llama3", None, "auto", "<|python_tag|>{'name': 'get_time', 'parameters': {'zone': 'CET'}}"),
    # d. brackets inside string arguments
    ("pythonic-brackets", "pythonic", None, "auto", 'Here: [get_weather(city="a]b[c", unit="(x")] done'),
    ("pythonic-plain", "pythonic", None, "auto", "a [list] of [things"),
    # e. a literal <think> in the answer after </think>
    ("r1-think-in-answer", None, "deepseek-r1", "none", "plan</think>The tag <think> is literal."),
    ("qwen3-think-in-answer", None, "qwen3", "none", "<think>plan</think>Use <think> and </think> tags."),
    ("qwen3-no-think", None, "qwen3", "none", "Hello <think> world"),
    ("qwen3-think-then-call", "qwen25", "qwen3", "auto", "<think>hm</think>ok\n" + QWEN_CALL),
    ("qwen3-call-in-think", "qwen25", "qwen3", "auto", "<think>hm " + QWEN_CALL + "</think>after"),
    ("r1-cut-in-think", "llama3", "deepseek-r1", "auto", "<think>still thinking </thi"),
    ("qwen-stray-end-tag", "qwen25", None, "auto", "text </tool_call> more  "),
    ("qwen-two-calls-spaces", "qwen25", None, "auto", QWEN_CALL + "\n\n" + QWEN_CALL + "\n trailing"),
    ("llama-two-calls", "llama3", None, "auto",
     'Hi<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; {"name": "get_weather", '
     '"parameters": {"city": "Rome"}}'),
    ("pythonic-two-lists", "pythonic", None, "auto", '[get_time(zone="a")] and [get_time(zone="b")]'),
    ("named-array", None, None, {"type": "function", "function": {"name": "get_time"}},
     '[{"name": "get_time", "parameters": {"zone": "\\u00e9\\ud83d"}}]'),
]  # fmt: skip


def make_parser(tool_parser, reasoning_parser, tool_choice) -> ChatOutputParser:
    args = ServerArgs(model_path="unused", device="cpu", tool_call_parser=tool_parser,
                      reasoning_parser=reasoning_parser)  # fmt: skip
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
    }
    if reasoning_parser == "qwen3":
        body["chat_template_kwargs"] = {"enable_thinking": False}  # <think> only where written
    return ChatOutputParser(ChatCompletionRequest.model_validate(body), args)


def whole(parser: ChatOutputParser, text: str) -> tuple:
    choice = parser.parse(text)
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice.tool_calls]
    return choice.content, choice.reasoning_content or "", calls


def streamed(parser: ChatOutputParser, chunks: list[str]) -> tuple:
    stream = parser.new_stream()
    content, reasoning, calls = "", "", {}
    for k, chunk in enumerate(chunks):
        for delta in stream.step(chunk, finished=k == len(chunks) - 1):
            content += delta.get("content", "")
            reasoning += delta.get("reasoning_content", "")
            for call in delta.get("tool_calls", []):
                if "id" in call:
                    assert call["index"] not in calls, "a call started twice"
                    calls[call["index"]] = [call["function"]["name"], call["function"]["arguments"]]
                else:
                    calls[call["index"]][1] += call["function"]["arguments"]
    return content, reasoning, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("tool_parser, reasoning_parser, tool_choice, text", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_stream_equals_the_whole_answer_at_every_cut(tool_parser, reasoning_parser, tool_choice, text):
    parser = make_parser(tool_parser, reasoning_parser, tool_choice)
    expected = whole(parser, text)
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]]) == expected, cut
    assert streamed(parser, list(text)) == expected
