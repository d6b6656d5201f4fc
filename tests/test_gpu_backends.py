"""The CUDA fast path: Triton decode attention and fused ops, CUDA-graph decode. Greedy outputs
and logits equal to torch_native and to transformers; CUDA graphs on and off equal.

Skips without a GPU. RADIXENGINE_GPU_TEST_DEVICE=cpu with TRITON_INTERPRET=1 runs the non-graph
tests through Triton's interpreter on the CPU (slow; for development without a GPU).
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F
from model_utils import ModelDriver, assert_close_rel, hf_last_logits, make_runner, save_tiny_model

DEVICE = os.environ.get("RADIXENGINE_GPU_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]
needs_cuda = pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need CUDA")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    return folder, save_tiny_model("llama", folder)


@pytest.fixture(autouse=True)
def _exact_fp32_matmul():
    if DEVICE != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def runner_for(folder, backend: str, page_size: int = 1, graphs: bool = False, **kwargs):
    return make_runner(
        folder,
        page_size,
        device=DEVICE,
        num_threads=None,
        attention_backend=backend,
        disable_cuda_graph=not graphs,
        cuda_graph_max_bs=8,
        **kwargs,
    )


def prompts_for(seed: int, lens: list[int]) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(256) for _ in range(n)] for i, n in enumerate(lens)}


def greedy(runner, prompts: dict[str, list[int]], steps: int, split_prefill: bool = True):
    """Prefill (in two chunks: the second over a cached prefix), then greedy decode; returns the
    generated tokens per request and the logits of every step (copied to the CPU)."""
    driver = ModelDriver(runner)
    if split_prefill:
        driver.extend({rid: t[: len(t) // 2] for rid, t in prompts.items()})
        logits = driver.extend({rid: t[len(t) // 2 :] for rid, t in prompts.items()})
    else:
        logits = driver.extend(prompts)
    out = {rid: [] for rid in prompts}
    all_logits = [logits.float().cpu()]
    for _ in range(steps):
        step = {rid: int(logits[i].argmax()) for i, rid in enumerate(prompts)}
        for rid, tok in step.items():
            out[rid].append(tok)
        logits = driver.decode(step)
        all_logits.append(logits.float().cpu())
    return out, all_logits, driver


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_matches_torch_native_and_transformers(tiny, page_size):
    folder, hf = tiny
    prompts = prompts_for(0, [33, 4, 20, 70])
    ref_tokens, ref_logits, _ = greedy(runner_for(folder, "torch_native", page_size), prompts, 6)
    tokens, logits, driver = greedy(runner_for(folder, "triton", page_size), prompts, 6)
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        assert_close_rel(ours, ref, rtol=1e-4)
    for i, rid in enumerate(prompts):
        req = driver.reqs[rid]
        assert_close_rel(logits[-1][i], hf_last_logits(hf, req.tokens), rtol=1e-4)


@needs_cuda
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_on_off_equal(tiny, page_size, dtype):
    folder, _ = tiny
    on = runner_for(folder, "triton", page_size, graphs=True, dtype=dtype)
    off = runner_for(folder, "triton", page_size, graphs=False, dtype=dtype)
    assert on.cuda_graph_runner is not None and off.cuda_graph_runner is None
    assert on.cuda_graph_runner.capture_bs == [1, 2, 4, 8]
    # 3 is padded to 4, 8 fits exactly, 11 is above the largest graph (eager).
    for n, seed in [(3, 1), (8, 2), (11, 3)]:
        prompts = prompts_for(seed, [5 + 7 * i for i in range(n)])
        tokens_on, logits_on, _ = greedy(on, prompts, 8)
        tokens_off, logits_off, _ = greedy(off, prompts, 8)
        assert tokens_on == tokens_off
        rtol = 1e-5 if dtype == "float32" else 2e-2
        for a, b in zip(logits_on, logits_off):
            assert_close_rel(a, b, rtol=rtol)


@needs_cuda
def test_cuda_graph_replays_and_keeps_other_requests_cache(tiny):
    folder, _ = tiny
    runner = runner_for(folder, "triton", graphs=True)
    graph_runner = runner.cuda_graph_runner
    replays = []
    original = graph_runner.replay
    graph_runner.replay = lambda fb: replays.append(fb.batch_size) or original(fb)
    # A long-lived request beside short batches that are padded: padding writes only slot 0.
    prompts = prompts_for(4, [40, 9, 17])
    tokens, _, driver = greedy(runner, prompts, 5)
    assert replays == [3] * 5
    ref_tokens, _, _ = greedy(runner_for(folder, "torch_native"), prompts, 5)
    assert tokens == ref_tokens
    assert driver.reqs["r0"].slots and 0 not in driver.reqs["r0"].slots


def test_auto_backend_on_cuda_is_triton(tiny):
    from radixengine.layers.attention.attention_registry import resolve_attention_backend

    assert resolve_attention_backend("auto", "cuda") == "triton"
    assert resolve_attention_backend("auto", "cpu") == "torch_native"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rms_norm_and_silu_and_mul(dtype):
    from radixengine.layers.triton_ops.fused import rms_norm, silu_and_mul

    torch.manual_seed(0)
    x = torch.randn(37, 576, device=DEVICE).to(dtype)
    r = torch.randn(37, 576, device=DEVICE).to(dtype)
    w = (1 + 0.3 * torch.randn(576, device=DEVICE)).to(dtype)

    def ref(t):
        if t.dtype == torch.float32:
            return F.rms_norm(t, (576,), w, 1e-5)
        return w * F.rms_norm(t.float(), (576,), None, 1e-5).to(t.dtype)

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(rms_norm(x, w, 1e-5), ref(x), atol=tol, rtol=tol)
    out, res = rms_norm(x, w, 1e-5, r)
    exact = 0 if DEVICE == "cuda" else tol  # the interpreter rounds to bf16 differently
    torch.testing.assert_close(res, x + r, atol=exact, rtol=exact)
    torch.testing.assert_close(out, ref(x + r), atol=tol, rtol=tol)
    y = torch.randn(5, 3, 2 * 1536, device=DEVICE).to(dtype)
    expected = F.silu(y[..., :1536]) * y[..., 1536:]
    torch.testing.assert_close(silu_and_mul(y), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(8, 2, 64), (9, 3, 64), (4, 4, 128), (4, 1, 80)])
def test_decode_attention_kernel_matches_sdpa(num_heads, num_kv, head_dim):
    from radixengine.layers.triton_ops.decode_attention import decode_attention

    torch.manual_seed(0)
    lens = [1, 2, 31, 300, 1029] if DEVICE == "cuda" else [1, 2, 31, 70]
    pool = sum(lens) + 1
    k_buf = torch.randn(pool, num_kv, head_dim, device=DEVICE)
    v_buf = torch.randn(pool, num_kv, head_dim, device=DEVICE)
    req_to_token = torch.zeros(8, max(lens) + 4, dtype=torch.int32, device=DEVICE)
    rows = [6, 0, 3, 1, 7][: len(lens)]
    slots = (torch.randperm(pool - 1) + 1).to(DEVICE)
    start = 0
    for row, n in zip(rows, lens):
        req_to_token[row, :n] = slots[start : start + n].int()
        start += n
    q = torch.randn(len(lens), num_heads, head_dim, device=DEVICE)
    scale = head_dim**-0.5
    out = decode_attention(
        q,
        k_buf,
        v_buf,
        req_to_token,
        torch.tensor(rows, device=DEVICE),
        torch.tensor(lens, device=DEVICE),
        scale,
    )
    group = num_heads // num_kv
    for i, (row, n) in enumerate(zip(rows, lens)):
        s = req_to_token[row, :n].long()
        k = k_buf[s].repeat_interleave(group, 1).transpose(0, 1)
        v = v_buf[s].repeat_interleave(group, 1).transpose(0, 1)
        ref = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=scale)[:, 0]
        torch.testing.assert_close(out[i], ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window_left,logit_cap", [(0, 0.0), (5, 0.0), (40, 0.0), (-1, 3.0), (7, 3.0)])
def test_decode_attention_kernel_sliding_window_and_soft_cap(window_left, logit_cap):
    """Keys before each request's window are skipped and scores soft-capped, as the CPU
    reference does (lengths below, at and beyond the window)."""
    from radixengine.layers.attention.native_cpu_ops import decode_attention_reference
    from radixengine.layers.triton_ops.decode_attention import decode_attention

    torch.manual_seed(1)
    lens = [1, 6, 8, 31, 300] if DEVICE == "cuda" else [1, 6, 8, 31]
    pool = sum(lens) + 1
    k_buf = torch.randn(pool, 2, 64, device=DEVICE)
    v_buf = torch.randn(pool, 2, 64, device=DEVICE)
    req_to_token = torch.zeros(6, max(lens) + 4, dtype=torch.int32, device=DEVICE)
    slots = (torch.randperm(pool - 1) + 1).to(DEVICE)
    start = 0
    for row, n in enumerate(lens):
        req_to_token[row, :n] = slots[start : start + n].int()
        start += n
    q = torch.randn(len(lens), 8, 64, device=DEVICE)
    rows, seq_lens = torch.arange(len(lens), device=DEVICE), torch.tensor(lens, device=DEVICE)
    args = (q, k_buf, v_buf, req_to_token, rows, seq_lens, 0.3)
    out = decode_attention(*args, window_left=window_left, logit_cap=logit_cap)
    ref = decode_attention_reference(*args, window_left=window_left, logit_cap=logit_cap)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    if 0 <= window_left < lens[-1] - 1:  # the window matters for the longest request
        whole = decode_attention_reference(*args, logit_cap=logit_cap)
        assert not torch.allclose(out[-1], whole[-1], atol=1e-3)


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gemma3", "phi3"])
def test_windowed_models_triton_matches_torch_native_and_transformers(arch, tmp_path):
    """Sliding windows (8 and 12 tokens) shorter than the prompts, Gemma 2's soft-capping:
    Triton decode (with CUDA graphs where CUDA runs) equal to torch_native and transformers."""
    hf = save_tiny_model(arch, tmp_path, seed=5)
    prompts = prompts_for(2, [33, 4, 20])
    ref_tokens, ref_logits, _ = greedy(runner_for(tmp_path, "torch_native"), prompts, 4)
    tokens, logits, driver = greedy(runner_for(tmp_path, "triton", graphs=DEVICE == "cuda"), prompts, 4)
    assert tokens == ref_tokens
    for ours, ref in zip(logits, ref_logits):
        assert_close_rel(ours, ref, rtol=1e-4)
    longrope = (hf.config.rope_parameters or {}).get("rope_type") == "longrope"
    for i, rid in enumerate(prompts):
        req = driver.reqs[rid]
        assert_close_rel(
            logits[-1][i], hf_last_logits(hf, req.tokens, req.chunks if longrope else None), rtol=1e-4
        )


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_on_off_equal_with_lora_adapters(tiny, tmp_path, dtype):
    """Decode graphs capture the LoRA delta's kernels over static tables (lora/lora_graph.py):
    requests of two adapters and of the base model, padded batches and an eager one, give the
    tokens and logits of the eager forward."""
    from lora_utils import save_random_adapter

    folder, _ = tiny
    paths = [
        f"{n}={save_random_adapter(folder, tmp_path / n, seed=i, r=4 * (i + 1))}" for i, n in enumerate("ab")
    ]
    on = runner_for(folder, "triton", graphs=True, dtype=dtype, lora_paths=paths)
    off = runner_for(folder, "triton", graphs=False, dtype=dtype, lora_paths=paths)
    assert on.cuda_graph_runner is not None and on.cuda_graph_runner.lora_graph is not None
    ids = {ref.split("-", 2)[2]: ref for ref in on.lora_manager.adapters}
    for n, seed in [(3, 5), (8, 6), (11, 7)]:
        prompts = prompts_for(seed, [5 + 7 * i for i in range(n)])
        lora_ids = {rid: ids["ab"[i % 3]] for i, rid in enumerate(prompts) if i % 3 < 2}
        outs = []
        for runner in (on, off):
            driver = ModelDriver(runner, lora_ids)
            logits = driver.extend(prompts)
            steps = []
            for _ in range(6):
                step = {rid: int(logits[i].argmax()) for i, rid in enumerate(prompts)}
                steps.append(step)
                logits = driver.decode(step)
            outs.append((steps, logits.float().cpu()))
            for rid in prompts:
                driver.free(rid)
        assert outs[0][0] == outs[1][0]
        assert_close_rel(outs[0][1], outs[1][1], rtol=1e-5 if dtype == "float32" else 2e-2)
