"""The model executor on CUDA (torch_native attention): same logits as transformers on the CPU."""

from __future__ import annotations

import random

import pytest
import torch
from model_utils import ModelDriver, assert_close_rel, hf_last_logits, make_runner, save_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save_tiny_model(request.param, folder)


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_extend_and_decode_match_transformers(tiny, page_size):
    folder, hf = tiny
    runner = make_runner(folder, page_size, device="cuda", num_threads=None)
    assert runner.model.model.embed_tokens.weight.is_cuda
    driver = ModelDriver(runner)
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(256) for _ in range(n)] for i, n in enumerate([33, 4, 20])}
    cut = {rid: len(t) // 2 for rid, t in prompts.items()}
    driver.extend({rid: t[: cut[rid]] for rid, t in prompts.items()})
    logits = driver.extend({rid: t[cut[rid] :] for rid, t in prompts.items()})
    for i, tokens in enumerate(prompts.values()):
        assert_close_rel(logits[i].cpu(), hf_last_logits(hf, tokens), rtol=1e-4)
    for _ in range(3):
        step = {rid: rng.randrange(256) for rid in prompts}
        logits = driver.decode(step)
        for i, rid in enumerate(step):
            assert_close_rel(logits[i].cpu(), hf_last_logits(hf, driver.reqs[rid].tokens), rtol=1e-4)


def test_cuda_dtype_auto_is_bfloat16(tiny):
    folder, hf = tiny
    runner = make_runner(folder, device="cuda", dtype="auto", num_threads=None)
    assert runner.dtype == torch.bfloat16
    logits = ModelDriver(runner).extend({"a": list(range(40))})
    ref = hf_last_logits(hf, list(range(40)))
    assert (logits[0].cpu() - ref).abs().max() < 0.1 * ref.abs().max()
