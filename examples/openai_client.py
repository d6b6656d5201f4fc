"""Talk to a running server with the official OpenAI client.

make serve                          # or: python -m radixengine.launch_server
python examples/openai_client.py    # --base-url http://127.0.0.1:30000/v1 [--api-key KEY]
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1")
    parser.add_argument("--api-key", default="EMPTY")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}\n")

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
    )
    print("chat:", chat.choices[0].message.content)
    print("usage:", chat.usage, "\n")

    print("stream: ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Count from one to five."}],
        max_tokens=48,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"priority": 1},  # SGLang's extra fields go in extra_body
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        if chunk.usage:
            print(f"\nusage: {chunk.usage}\n")

    completion = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=24, temperature=0, stop=["."], logprobs=3
    )
    choice = completion.choices[0]
    print("completion:", repr(choice.text), "finish:", choice.finish_reason)
    print("token logprobs:", [round(x, 3) for x in choice.logprobs.token_logprobs[:8]])
    print("first token's top 3:", {t: round(lp, 3) for t, lp in choice.logprobs.top_logprobs[0].items()})


if __name__ == "__main__":
    main()
