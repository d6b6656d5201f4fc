"""Structured outputs against a running server (`make serve`): a JSON-schema answer validated with
jsonschema, a regex-constrained answer, and a JSON object from /v1/completions.

    python examples/structured_output.py [--base-url http://127.0.0.1:30000]
"""

from __future__ import annotations

import argparse
import json
import re

import jsonschema
import openai

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 40},
        "population": {"type": "integer", "minimum": 0},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3},
    },
    "required": ["city", "country", "population", "landmarks"],
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default="none")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url + "/v1", api_key=args.api_key)

    out = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
        temperature=0,
        max_tokens=200,
    )
    answer = json.loads(out.choices[0].message.content)
    jsonschema.validate(answer, SCHEMA)
    print("json_schema:", answer)

    regex = r"(yes|no), because [a-z ]{5,40}\."
    out = client.chat.completions.create(
        model="default",
        messages=[{"role": "user", "content": "Is the sun a star?"}],
        extra_body={"regex": regex},
        temperature=0,
        max_tokens=64,
    )
    text = out.choices[0].message.content
    assert re.fullmatch(regex, text), text
    print("regex:", text)

    comp = client.completions.create(
        model="default",
        prompt="A JSON object describing a dog:",
        extra_body={"response_format": {"type": "json_object"}},
        temperature=0,
        max_tokens=120,
    )
    print("json_object:", json.loads(comp.choices[0].text))


if __name__ == "__main__":
    main()
