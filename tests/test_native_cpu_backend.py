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


# Sliding windows (8 and 12 tokens) shorter than the sequences; Gemma 2's soft-capping.
@pytest.fixture(scope="module", params=["mistral", "gemma2", "gemma3", "phi3"])
def windowed(request, tmp_path_factory):
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
    _check_native_matches(*tiny, page_size)


@pytest.mark.parametrize("page_size", [1, 16])
def test_sliding_window_models_match_transformers_and_reference(windowed, page_size):
    _check_native_matches(*windowed, page_size)


def _check_native_matches(folder, hf, page_size: int) -> None:
    native = ModelDriver(make_runner(folder, page_size, attention_backend="native_cpu"))
    reference = ModelDriver(make_runner(folder, page_size, attention_backend="torch_native"))
    assert isinstance(native.runner.attn_backend, NativeCpuAttnBackend)
    for ours, ref in zip(_run(native, random.Random(1)), _run(reference, random.Random(1))):
        assert_close_rel(ours, ref, rtol=1e-5)  # relative to the largest logit (capped ones: about 6)
    longrope = (hf.config.rope_parameters or {}).get("rope_type") == "longrope"
    for i, req in enumerate(native.reqs.values()):
        assert_close_rel(ours[i], hf_last_logits(hf, req.tokens, req.chunks if longrope else None))


def test_auto_picks_native_on_cpu(tiny):
    folder, _ = tiny
    runner = make_runner(folder, attention_backend="auto")
    assert isinstance(runner.attn_backend, NativeCpuAttnBackend)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_16bit_kv_cache(tiny, kv_cache_dtype):
    """`--kv-cache-dtype` under a float32 model: both backends and both page sizes store K/V rounded
    to 16 bits and agree; against the float32 cache the logits move by the rounding only; the pool
    holds half the bytes per token."""
    folder, hf = tiny
    exact = ModelDriver(make_runner(folder, attention_backend="native_cpu"))
    drivers = [
        ModelDriver(make_runner(folder, page_size, attention_backend=backend, kv_cache_dtype=kv_cache_dtype))
        for backend, page_size in (("native_cpu", 1), ("torch_native", 1), ("native_cpu", 16))
    ]
    dtype = getattr(torch, kv_cache_dtype)
    for driver in drivers:
        assert driver.runner.token_to_kv_pool.get_key_buffer(0).dtype == dtype
        assert driver.runner.cell_size() * 2 == exact.runner.cell_size()
    runs = [_run(driver, random.Random(2)) for driver in drivers]
    # 1e-4 rather than 1e-5: a last-bit difference in a K value computed by the two backends'
    # projections can round it to neighbouring 16-bit values.
    for native, reference, paged in zip(*runs):
        assert_close_rel(native, reference, rtol=1e-4)
        assert_close_rel(native, paged, rtol=1e-4)
    rounding = 2e-2 if kv_cache_dtype == "bfloat16" else 3e-3
    for ours, full in zip(runs[0], _run(exact, random.Random(2))):
        assert_close_rel(ours, full, rtol=rounding)
        assert not torch.equal(ours, full)  # the cache really is 16-bit
