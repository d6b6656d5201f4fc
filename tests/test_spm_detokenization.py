"""With a SentencePiece-style tokenizer (Llama-2, Mistral), the output is decoded after the last
prompt tokens, so its first token keeps its leading space: the Engine's text (whole and streamed)
is exactly what the output adds to the decoded prompt."""

from __future__ import annotations

import pytest
from spm_utils import build_tiny_spm_model

from radixengine import Engine

PROMPTS = ["The capital of France is", "hello world this is", "Once upon a time there was", "The capital of"]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return build_tiny_spm_model(str(tmp_path_factory.mktemp("tiny_spm_llama")))


@pytest.fixture(scope="module")
def engine(model_path):
    engine = Engine(
        model_path=model_path, dtype="float32", max_total_tokens=4096, num_threads=1, log_level="warning"
    )
    yield engine
    engine.shutdown()


def added_text(tok, prompt_ids: list[int], output_ids: list[int]) -> str:
    """What the output adds to the prompt's text, decoded as one sequence."""
    full = tok.decode(prompt_ids + output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    prompt = tok.decode(prompt_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert full.startswith(prompt)
    return full[len(prompt) :]


def test_output_text_keeps_the_leading_space(engine):
    tok = engine.tokenizer
    outs = engine.generate(PROMPTS, GREEDY)
    firsts = [tok.convert_ids_to_tokens(o["output_ids"][0]) for o in outs]
    # The model is fixed (seeded): some outputs start a new word, which is what this test is about.
    assert any(t.startswith("▁") for t in firsts), firsts
    for prompt, out in zip(PROMPTS, outs):
        expected = added_text(tok, tok.encode(prompt), out["output_ids"])
        assert out["text"] == expected
        if tok.convert_ids_to_tokens(out["output_ids"][0]).startswith("▁"):
            assert out["text"].startswith(" ")


def test_streamed_text_keeps_the_leading_space(engine):
    tok = engine.tokenizer
    for prompt in PROMPTS:
        chunks = list(engine.generate(prompt, GREEDY, stream=True))
        ids = [t for c in chunks for t in c["output_ids"]]
        assert "".join(c["text"] for c in chunks) == added_text(tok, tok.encode(prompt), ids)
