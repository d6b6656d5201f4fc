"""CudaGraphRunner's logic without a GPU: torch.cuda's graph and stream calls are replaced by
stand-ins (capture runs the forward eagerly, replay does nothing), the model runs on the CPU."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import pytest
import torch
from model_utils import ModelDriver, make_runner, save_tiny_model

from radixengine.layers.native_small_ops import native_small_ops
from radixengine.layers.rotary_embedding import RotaryEmbedding
from radixengine.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    DecodeShapes,
    capture_batch_sizes,
    decode_row_bytes,
    decode_shapes,
    graph_max_bs,
)


class _Stream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


class _Graph:
    def replay(self) -> None:
        pass

    def pool(self):
        return None


@pytest.fixture
def fake_cuda(monkeypatch):
    captures: list[dict] = []

    @contextmanager
    def graph(g, pool=None, stream=None):
        ropes = captures[-1]["ropes"]
        before = {id(r): r._last for r in ropes}
        yield
        captures[-1]["recomputed"] = all(r._last is not before[id(r)] for r in ropes)

    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    # The forward stands in for the CUDA one: the torch small ops, not the native CPU ones.
    with native_small_ops(False):
        yield captures


def test_capture_batch_sizes():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_batch_sizes(32) == [1, 2, 4, 8, 12, 16, 24, 32]
    assert capture_batch_sizes(160)[-3:] == [144, 152, 160]
    big = capture_batch_sizes(512)
    assert big[-1] == 512 and {256, 272, 496} <= set(big) and len(big) == 5 + 31 + 16
    assert all(b - a <= 16 for a, b in zip(big, big[1:]))  # padding wastes at most 15 rows


def test_graph_max_bs_is_bounded_by_memory_and_running_requests():
    smollm2 = DecodeShapes(576, 1536, 9, 3, 64, 49152)
    row = decode_row_bytes(smollm2, 2)
    assert 300_000 < row < 600_000  # ~0.4 MiB a row: batch 512 takes ~0.2 GiB
    assert graph_max_bs(512, 1024, 100 * 2**30, row) == 512
    assert graph_max_bs(512, 200, 100 * 2**30, row) == 200
    assert graph_max_bs(512, 1024, None, row) == 512
    assert graph_max_bs(512, 1024, 40 * row, row) == 10  # a quarter of the free memory
    assert graph_max_bs(512, 1024, 0, row) == 1


@pytest.fixture
def tiny(tmp_path):
    save_tiny_model("llama", tmp_path)
    return tmp_path


def record_captures(runner, fake_cuda: list[dict], monkeypatch) -> None:
    """Each captured forward checks that the runner's RoPE modules recomputed their cos/sin."""
    ropes = [m for m in runner.model.modules() if isinstance(m, RotaryEmbedding)]
    assert ropes
    original_forward = CudaGraphRunner._forward

    def forward(self, fb):
        fake_cuda.append({"ropes": ropes})
        return original_forward(self, fb)

    monkeypatch.setattr(CudaGraphRunner, "_forward", forward)


def test_capture_recomputes_rope_and_replay_pads(tiny, fake_cuda, monkeypatch):
    runner = make_runner(tiny, cuda_graph_max_bs=4)
    record_captures(runner, fake_cuda, monkeypatch)
    graphs = CudaGraphRunner(runner)
    assert graphs.capture_bs == [1, 2, 4]
    # Each captured pass computed RoPE's cos/sin itself (a warm-up's cached copy would be stale).
    captured = [c for c in fake_cuda if "recomputed" in c]
    assert len(captured) == 3 and all(c["recomputed"] for c in captured)

    driver = ModelDriver(runner)
    driver.extend({"a": [1, 2, 3], "b": [4, 5], "c": [6]})
    runner.cuda_graph_runner = graphs
    logits = driver.decode({"a": 7, "b": 8, "c": 9})  # 3 rows, padded to the graph of 4
    assert logits.shape == (3, runner.model_config.vocab_size)
    assert graphs.req_pool_indices[3] == 0 and graphs.seq_lens[3] == 1 and graphs.out_cache_loc[3] == 0
    assert graphs.seq_lens[:3].tolist() == [4, 3, 2]
    assert graphs.positions[:3].tolist() == [3, 2, 1]


def test_memory_lowers_the_largest_graph_and_a_larger_batch_is_logged_once(
    tiny, fake_cuda, caplog, monkeypatch
):
    runner = make_runner(tiny, cuda_graph_max_bs=8)
    record_captures(runner, fake_cuda, monkeypatch)
    row = decode_row_bytes(decode_shapes(runner), runner.dtype.itemsize)
    with caplog.at_level("INFO", logger="radixengine.model_executor.cuda_graph_runner"):
        graphs = CudaGraphRunner(runner, free_bytes=4 * 2 * row + 1)  # a quarter: 2 rows
    assert graphs.capture_bs == [1, 2]
    assert "CUDA graphs up to batch 2, not 8" in caplog.text
    driver = ModelDriver(runner)
    driver.extend({"a": [1, 2, 3], "b": [4, 5], "c": [6]})
    runner.cuda_graph_runner = graphs
    caplog.clear()
    with caplog.at_level("WARNING", logger="radixengine.model_executor.cuda_graph_runner"):
        first = driver.decode({"a": 7, "b": 8, "c": 9})  # 3 rows: above the largest graph, eager
        second = driver.decode({"a": 1, "b": 2, "c": 3})
    assert first.shape == second.shape == (3, runner.model_config.vocab_size)
    told = [r for r in caplog.records if "above the largest CUDA graph" in r.message]
    assert len(told) == 1 and "decode batch 3" in told[0].message


def test_lora_tables_are_refilled_before_each_replay(tiny, tmp_path, fake_cuda, monkeypatch):
    """With LoRA adapters the graphs read the block table and the slots' ranks from static
    tensors: each replay refills them from its batch (block i is row i: one row of its slot, none
    for a base-model or padded row), leaving nothing of the batch before."""
    from lora_utils import save_random_adapter

    adapters = {n: save_random_adapter(tiny, tmp_path / n, seed=i, r=2 + 2 * i) for i, n in enumerate("ab")}
    runner = make_runner(tiny, cuda_graph_max_bs=4, lora_paths=[f"{n}={p}" for n, p in adapters.items()])
    record_captures(runner, fake_cuda, monkeypatch)
    graphs = CudaGraphRunner(runner)
    manager = runner.lora_manager
    assert graphs.lora_graph is not None and manager.batch_info is None
    ids = {ref.split("-", 2)[2]: ref for ref in manager.adapters}
    driver = ModelDriver(runner, {"x": ids["a"], "z": ids["b"], "w": ids["a"]})
    driver.extend({"x": [1, 2, 3], "y": [4, 5], "z": [6], "w": [7]})
    runner.cuda_graph_runner = graphs
    driver.decode({"x": 7, "y": 8, "z": 9, "w": 1})  # 4 rows: the graph of 4
    slot = manager.pool.slot_of
    a, b = slot[ids["a"]], slot[ids["b"]]
    assert graphs.lora_graph.blocks[:4].tolist() == [[0, 1, a], [1, 0, 0], [2, 1, b], [3, 1, a]]
    ranks = graphs.lora_graph.rank_of_slot
    assert ranks[a] == 2 and ranks[b] == 4
    driver.free("w")
    del driver.lora_ids["x"]
    driver.decode({"x": 1, "y": 2, "z": 3})  # 3 rows, padded to 4: the padded row has no adapter
    assert graphs.lora_graph.blocks[:4].tolist() == [[0, 0, 0], [1, 0, 0], [2, 1, b], [3, 0, 0]]
