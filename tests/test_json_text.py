"""Model output as response JSON: a string holding a lone UTF-16 surrogate (what JSON's
`\\ud83d` escape decodes to) is written as that escape, so the answer and every SSE event are
UTF-8 and decode to the same value."""

from __future__ import annotations

import json

from radixengine.entrypoints.request_runner import ModelOutputResponse, _sse
from radixengine.utils.unicode_check import dumps_json_text

VALUE = {"text": "a \ud83d b \udc00 😀 é", "\udbff": ["\ud800"]}


def test_dumps_json_text_escapes_only_lone_surrogates():
    text = dumps_json_text(VALUE)
    assert text == '{"text": "a \\ud83d b \\udc00 😀 é", "\\udbff": ["\\ud800"]}'
    assert json.loads(text.encode("utf-8")) == VALUE
    assert dumps_json_text({"ok": "😀"}) == json.dumps({"ok": "😀"}, ensure_ascii=False)


def test_responses_and_events_are_utf8():
    body = ModelOutputResponse(VALUE).body
    assert json.loads(body.decode("utf-8")) == VALUE
    event = _sse(VALUE)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert json.loads(event[6:].decode("utf-8")) == VALUE
