"""The native CPU attention backend inside the model: equal to transformers (fp32) and to the
torch_native reference backend, for prefill over a cached prefix and decode, page sizes 1 and 16."""

from __future__ import annotations

import random

import pytest
import torch
from model_utils import ModelDriver, assert_close_rel, hf_last_logits, make_runner, save_tiny_model

from radixengine.layers.attention import native_cpu_ops
from radixengine.layers.attention.native_cpu_backend import NativeCpuAttnBackend

pytestmark = pytest.mark.skipif(
    not native_cpu_ops.native_available(),
    reason=f"native CPU ops not built: {native_cpu_ops.native_unavailable_reason()}",
)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"native-{request.param}")
    return folder, save_tiny_model(request.param, folder, seed=7)


def _run(driver: ModelDriver, rng: random.Random) -> list[torch.Tensor]:
    prompts = {f"r{i}": [rng.randrange(256) for _ in range(n)] for i, n in enumerate([41, 6, 19, 1])}
    cuts = {rid: max(1, len(t) // 2) for rid, t in prompts.items()}
    outs = [driver.extend({rid: t[: cuts[rid]] for rid, t in prompts.items()})]
    outs.append(driver.extend({rid: t[cuts[rid] :] for rid, t in prompts.items() if len(t) > cuts[rid]}))
    for _ in range(4):
        outs.append(driver.decode({rid: rng.randrange(256) for rid in driver.reqs}))
    return outs


@pytest.mark.parametrize("page_size", [1, 16])
def test_native_backend_matches_transformers_and_reference(tiny, page_size):
    folder, hf = tiny
    native = ModelDriver(make_runner(folder, page_size, attention_backend="native_cpu"))
    reference = ModelDriver(make_runner(folder, page_size, attention_backend="torch_native"))
    assert isinstance(native.runner.attn_backend, NativeCpuAttnBackend)
    for ours, ref in zip(_run(native, random.Random(1)), _run(reference, random.Random(1))):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for i, req in enumerate(native.reqs.values()):
        assert_close_rel(ours[i], hf_last_logits(hf, req.tokens))


def test_auto_picks_native_on_cpu(tiny):
    folder, _ = tiny
    runner = make_runner(folder, attention_backend="auto")
    assert isinstance(runner.attn_backend, NativeCpuAttnBackend)
