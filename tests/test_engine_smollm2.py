"""End to end with the default model (SmolLM2-135M-Instruct, the bundled GGUF): 16 chat prompts
through Engine equal transformers' greedy output on the same weights, in float32."""

from __future__ import annotations

import pytest
import torch
from test_engine_utils import hf_greedy, load_hf_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Write a haiku about the sea.",
    "Why is the sky blue?",
    "Give me a synonym for happy.",
    "What language is spoken in Brazil?",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is the boiling point of water in Celsius?",
    "Who wrote Romeo and Juliet?",
    "Suggest a name for a pet turtle.",
    "What is the largest planet in the solar system?",
    "List two healthy breakfast foods.",
    "What does CPU stand for?",
    "Describe a cat in one sentence.",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def default_model():
    from radixengine.model_loader import default_model_path, resolve_model_path

    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return resolve_model_path(None)


@pytest.mark.slow
def test_sixteen_chat_prompts_equal_transformers(default_model):
    from radixengine import Engine

    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = {"max_new_tokens": MAX_NEW, "temperature": 0}
    with Engine(dtype="float32", log_level="warning") as engine:
        outs = engine.chat(conversations, params)
        eos = set(engine.get_server_info()["eos_token_ids"])
        tok = engine.tokenizer
    ids = [
        tok.encode(
            tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )
        for c in conversations
    ]
    hf = load_hf_model(default_model, dtype=torch.float32)
    expected = [_until_eos(out, eos) for out in hf_greedy(hf, ids, MAX_NEW)]
    for q, out, exp in zip(QUESTIONS, outs, expected):
        assert out["output_ids"] == exp, q
        assert out["text"] == tok.decode(exp, skip_special_tokens=True, clean_up_tokenization_spaces=False), q
        assert out["meta_info"]["prompt_tokens"] == len(ids[QUESTIONS.index(q)])


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


SYSTEM = (
    "You are Atlas, the support assistant of an outdoor gear shop. Answer in at most two short "
    "sentences, politely and factually. Shipping is free over fifty dollars and takes three to "
    "five business days; returns are accepted within thirty days with a receipt; warranty claims "
    "need the order number and a photo of the defect. Never invent product facts, never promise "
    "discounts, and hand the customer to a human agent when they ask for one or are upset."
)


@pytest.mark.slow
def test_shared_prefix_attention_changes_no_token_on_the_real_model(default_model):
    """Eight chats behind one system prompt (shared by the whole decode batch), float32: the
    same greedy tokens with shared-prefix attention on (the pass runs) and off."""
    from radixengine import Engine

    conversations = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS[:8]
    ]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    outputs = {}
    for disable in (False, True):
        with Engine(
            dtype="float32",
            log_level="warning",
            disable_shared_prefix_attention=disable,
            shared_prefix_attention_min_len=32,
        ) as engine:
            outputs[disable] = [o["output_ids"] for o in engine.chat(conversations, params)]
            info = engine.get_server_info()
            assert info["disable_shared_prefix_attention"] is disable
            assert (info["num_shared_prefix_forwards"] == 0) is disable  # the pass ran when on
    assert outputs[False] == outputs[True]
