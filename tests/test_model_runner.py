"""ModelRunner pool sizing, the attention backend registry and the TpModelWorker API."""

from __future__ import annotations

import psutil
import pytest
import torch
from model_utils import ModelDriver, make_runner, save_tiny_model

from radixengine.layers.attention.attention_registry import (
    create_attention_backend,
    resolve_attention_backend,
)
from radixengine.mem_cache.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from radixengine.model_executor import model_runner as model_runner_module
from radixengine.model_executor.forward_batch_info import ForwardMode, ModelWorkerBatch
from radixengine.model_executor.tp_worker import GenerationBatchResult, TpModelWorker
from radixengine.sampling.sampling_batch_info import SamplingBatchInfo
from radixengine.sampling.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model("llama", path)
    return path


def test_pool_sizes_follow_sglang(folder):
    runner = make_runner(folder, max_total_tokens=3000)
    assert runner.max_total_num_tokens == 3000
    assert runner.req_to_token_pool.size == 3000  # max(int(3000 / 512 * 512), 2048)
    assert runner.max_running_requests == 1500  # max_total_tokens // 2
    assert runner.req_to_token_pool.req_to_token.shape == (3000, 512 + 4)
    assert isinstance(runner.token_to_kv_pool_allocator, TokenToKVPoolAllocator)
    assert runner.token_to_kv_pool.get_key_buffer(0).shape == (3001, 2, 16)


def test_paged_pool_and_explicit_running_requests(folder):
    runner = make_runner(folder, max_total_tokens=1000, page_size=16, max_running_requests=7)
    assert runner.max_total_num_tokens == 992  # rounded down to whole pages
    assert isinstance(runner.token_to_kv_pool_allocator, PagedTokenToKVPoolAllocator)
    assert runner.req_to_token_pool.size == 7 and runner.max_running_requests == 7


def test_cpu_default_pool_is_bounded(folder, monkeypatch):
    monkeypatch.setattr(model_runner_module, "CPU_DEFAULT_MAX_TOTAL_TOKENS", 5000)
    runner = make_runner(folder, max_total_tokens=None)
    assert 0 < runner.max_total_num_tokens <= 5000
    assert runner.cell_size() == 2 * 16 * 2 * 2 * 4  # kv heads * head dim * layers * (K, V) * fp32


def _pretend_available(monkeypatch, nbytes: int) -> None:
    memory = psutil.virtual_memory()._replace(available=nbytes)
    monkeypatch.setattr(model_runner_module.psutil, "virtual_memory", lambda: memory)


def _pool_bytes(runner) -> int:
    kv = sum(k.numel() * k.element_size() * 2 for k in runner.token_to_kv_pool.k_buffer)
    rows = runner.req_to_token_pool.req_to_token
    return kv + rows.numel() * rows.element_size()


def test_absurd_max_total_tokens_is_refused_at_start(folder):
    with pytest.raises(RuntimeError, match=r"--max-total-tokens 1000000000000 .* available"):
        make_runner(folder, max_total_tokens=10**12)


def test_pool_beyond_available_memory_is_refused(folder, monkeypatch):
    """The pool is mapped lazily, so nothing fails at start by itself: the check must."""
    _pretend_available(monkeypatch, 64 << 20)
    with pytest.raises(RuntimeError, match=r"--max-total-tokens 1000000 \(512\.0 MB"):
        make_runner(folder, max_total_tokens=1_000_000)  # 512 B a token


def test_req_to_token_counts_against_memory(folder, monkeypatch):
    """4096 rows of 516 int32 (8.5 MB) on top of a 2 MB KV cache do not fit in 8 MB."""
    _pretend_available(monkeypatch, 8 << 20)
    with pytest.raises(RuntimeError, match=r"4096 requests \(--max-running-requests; 8\.5 MB"):
        make_runner(folder, max_total_tokens=4096, max_running_requests=4096)
    runner = make_runner(folder, max_total_tokens=4096, max_running_requests=64)
    assert _pool_bytes(runner) < 8 << 20


def test_default_pool_counts_req_to_token_in_its_share(folder, monkeypatch):
    available = 100 << 20
    _pretend_available(monkeypatch, available)
    runner = make_runner(folder, max_total_tokens=None)
    assert runner.req_to_token_pool.size == 4096
    assert _pool_bytes(runner) <= model_runner_module.CPU_DEFAULT_RAM_FRACTION * available
    assert runner.max_total_num_tokens > 10_000


def test_attention_backend_registry(folder):
    assert resolve_attention_backend("auto", "cpu") == "torch_native"
    assert resolve_attention_backend("native_cpu", "cpu") == "native_cpu"
    runner = make_runner(folder)
    with pytest.raises(ValueError, match="unknown attention backend"):
        create_attention_backend("nope", runner)


def _greedy_batch(mode, ids, rows, seq_lens, locs, prefix, extend, return_logprob=False):
    params = [SamplingParams(temperature=0.0) for _ in rows]
    return ModelWorkerBatch(
        forward_mode=mode,
        input_ids=torch.tensor(ids),
        req_pool_indices=torch.tensor(rows),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=seq_lens,
        out_cache_loc=locs,
        extend_prefix_lens=prefix,
        extend_seq_lens=extend,
        sampling_info=SamplingBatchInfo.from_sampling_params(params, [0] * len(rows), "cpu", 256),
        return_logprob=return_logprob,
    )


def test_tp_worker_generation(folder):
    worker = TpModelWorker(make_runner(folder).server_args)
    info = worker.get_worker_info()
    assert (info.max_total_num_tokens, info.context_len, info.vocab_size, info.page_size) == (
        4096,
        512,
        256,
        1,
    )
    assert info.max_req_input_len == info.max_req_len - 5 == 511 - 5 and info.eos_token_ids == [2]
    req_to_token_pool, allocator = worker.get_memory_pool()
    rows = req_to_token_pool.alloc(2)
    locs = allocator.alloc(7)
    req_to_token_pool.write((rows[0], slice(0, 4)), locs[:4].int())
    req_to_token_pool.write((rows[1], slice(0, 3)), locs[4:].int())
    batch = _greedy_batch(
        ForwardMode.EXTEND, [5, 6, 7, 8, 9, 10, 11], rows, [4, 3], locs, [0, 0], [4, 3], True
    )
    result = worker.forward_batch_generation(batch)
    assert isinstance(result, GenerationBatchResult)

    driver = ModelDriver(worker.model_runner)
    ref = driver.extend({"a": [5, 6, 7, 8], "b": [9, 10, 11]})
    assert result.next_token_ids.tolist() == ref.argmax(-1).tolist()
    expected = torch.log_softmax(ref, -1).gather(1, ref.argmax(-1, keepdim=True)).view(-1)
    torch.testing.assert_close(result.logprobs.next_token_logprobs, expected, atol=1e-5, rtol=1e-5)


def test_idle_batch(folder):
    worker = TpModelWorker(make_runner(folder).server_args)
    empty = torch.empty(0, dtype=torch.int64)
    batch = _greedy_batch(ForwardMode.IDLE, [], [], [], empty, None, None)
    batch.input_ids = empty
    assert worker.forward_batch_generation(batch).next_token_ids.numel() == 0


def test_bfloat16_runs_close_to_float32(folder):
    fp32 = ModelDriver(make_runner(folder)).extend({"a": list(range(30))})
    bf16 = ModelDriver(make_runner(folder, dtype="bfloat16")).extend({"a": list(range(30))})
    assert bf16.dtype == torch.float32  # logits are always returned in fp32
    assert (bf16 - fp32).abs().max() < 0.1 * fp32.abs().max()
