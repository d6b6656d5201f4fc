"""The engine (scheduler, radix cache, default CPU attention backend) on tiny random Mistral,
Mixtral (MoE), Gemma 2, Gemma 3 and Phi-3 models, whose sliding windows (8 and 12 tokens) are
shorter than the prompts: 32 greedy tokens equal to transformers', and equal again on a second pass that reads
the prompts from the radix cache (an extend over a cached prefix longer than the window)."""

from __future__ import annotations

import random

import pytest
import torch
from model_utils import save_tiny_model
from test_engine_utils import build_tokenizer, hf_greedy

from radixengine import Engine

ARCHS = ["mistral", "mixtral", "gemma2", "gemma3", "phi3"]
MAX_NEW = 32
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module", params=ARCHS)
def served(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"engine-{request.param}"))
    tokenizer = build_tokenizer(path)
    ids = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    hf = save_tiny_model(request.param, path, seed=11, vocab_size=len(tokenizer), **ids)
    engine = Engine(
        model_path=path, dtype="float32", max_total_tokens=4096, num_threads=1, log_level="warning"
    )
    yield engine, hf
    engine.shutdown()


def test_greedy_tokens_match_transformers_with_and_without_the_radix_cache(served):
    engine, hf = served
    rng = random.Random(3)
    # Phi-3's longrope switches to its long factors past 20 tokens: prompts on either side; none
    # crosses during decode (where transformers' `generate` would recompute its cache, see
    # test_model_equivalence._hf_greedy).
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (45, 27, 33)]
    torch.set_num_threads(1)
    expected = hf_greedy(hf, prompts, MAX_NEW)
    for attempt in range(2):
        outs = engine.generate(input_ids=prompts, sampling_params=[GREEDY] * len(prompts))
        assert [o["output_ids"] for o in outs] == expected, attempt
        if attempt == 1:
            assert [o["meta_info"]["cached_tokens"] for o in outs] == [len(p) - 1 for p in prompts]
