"""The GGUF conversion cache: keyed on the whole file, free of a killed conversion's leftovers,
and converting tensor by tensor (never every weight in memory at once)."""

from __future__ import annotations

import fcntl
import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_utils import write_llama_gguf
from model_utils import tiny_config
from safetensors import safe_open

from radixengine.model_loader import gguf_cache, gguf_loader, resolve_model_path

GGML_F16 = 1


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("RADIXENGINE_CACHE_DIR", str(path))
    return path


def _hf_model(seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    config = tiny_config("llama", **overrides)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _converted(gguf: Path, name: str) -> torch.Tensor:
    folder = Path(resolve_model_path(str(gguf)))
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return f.get_tensor(name)


def test_files_differing_past_the_first_megabytes_convert_apart(tmp_path):
    """Same size, same header, same shapes; only the last tensor differs, more than 16 MiB into
    the file. A re-released file replacing the old one at the same path is converted anew."""
    hf = _hf_model(intermediate_size=8192, num_hidden_layers=4)
    last = "model.norm.weight"
    path = write_llama_gguf(tmp_path / "model.gguf", hf)
    assert path.stat().st_size > 20 << 20
    old = _converted(path, last)

    changed = hf.state_dict()[last].numpy() + 1.0
    new_path = write_llama_gguf(tmp_path / "new.gguf", hf, tensors={last: changed})
    assert new_path.stat().st_size == path.stat().st_size
    os.replace(new_path, path)
    new = _converted(path, last)
    assert torch.equal(new, torch.from_numpy(changed)) and not torch.equal(new, old)


def test_content_digest_is_read_once_per_file_version(tmp_path, monkeypatch):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF" + bytes(1000))
    digest = gguf_cache.content_digest(path)
    monkeypatch.setattr(gguf_cache, "_sha256_of_file", lambda p: pytest.fail("hashed again"))
    assert gguf_cache.content_digest(path) == digest
    monkeypatch.undo()
    replacement = tmp_path / "y.gguf"
    replacement.write_bytes(b"GGUF" + bytes(999) + b"\x01")
    os.replace(replacement, path)
    assert gguf_cache.content_digest(path) != digest


def test_a_killed_conversions_temp_dirs_are_removed(tmp_path, cache_dir):
    """A conversion killed mid-way leaves `<key>.<random>` behind (no `finally` runs); the next
    load removes it, and any other key's leftovers, but not the folder of a live conversion."""
    path = write_llama_gguf(tmp_path / "model.gguf", _hf_model())
    key = gguf_loader.gguf_cache_key(path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    stale = [cache_dir / f"{key}.k1ll3d_x", cache_dir / f"{'0' * 32}.tmp-abcd1234"]
    live = cache_dir / f"{'1' * 32}.tmp-live0000"
    for folder in [*stale, live]:
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(bytes(100))
    with open(cache_dir / f"{'1' * 32}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process converting that file right now
        folder = Path(resolve_model_path(str(path)))
    assert not any(p.exists() for p in stale)
    assert live.exists()
    assert (folder / "model.safetensors").exists() and (folder / "config.json").exists()
    assert sorted(p.name for p in cache_dir.iterdir() if p.is_dir()) == sorted([key, live.name, "digests"])


def _traced_peak(gguf: Path) -> tuple[Path, int]:
    tracemalloc.start()
    try:
        folder = Path(resolve_model_path(str(gguf)))
        return folder, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_conversion_holds_one_tensor_at_a_time(tmp_path):
    """Peak memory traced while converting (numpy reports its buffers to tracemalloc) exceeds that
    of converting a tiny model (same vocabulary and metadata) by about the largest tensor: far
    below the sum of the float32 weights, and below two large tensors at once."""
    hf = _hf_model(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=4)
    path = write_llama_gguf(tmp_path / "model.gguf", hf, qtype=GGML_F16)
    tiny = [write_llama_gguf(tmp_path / f"tiny{i}.gguf", _hf_model(seed=i), qtype=GGML_F16) for i in (1, 2)]
    resolve_model_path(str(tiny[0]))  # imports and first-use caches outside the measurement
    _, baseline = _traced_peak(tiny[1])
    folder, peak = _traced_peak(path)
    sizes = [p.numel() * 4 for p in hf.state_dict().values()]
    assert sum(sizes) > 28 << 20 and max(sizes) == 1 << 20
    extra = peak - baseline
    assert extra < 1.5 * max(sizes), (
        f"{extra / 2**20:.2f} MiB more for {sum(sizes) / 2**20:.1f} MiB of weights"
    )
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        got = f.get_tensor("model.layers.7.mlp.down_proj.weight")
    ref = hf.state_dict()["model.layers.7.mlp.down_proj.weight"]
    np.testing.assert_allclose(got.numpy(), ref.half().float().numpy())


def test_write_safetensors_streams_what_the_header_lists(tmp_path):
    from radixengine.model_loader.weight_utils import write_safetensors

    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(5, dtype=np.float32)
    out = tmp_path / "x.safetensors"
    write_safetensors(out, [("a", (2, 3)), ("b", (5,))], iter([a, b]))
    with safe_open(str(out), framework="np") as f:
        assert np.array_equal(f.get_tensor("a"), a) and np.array_equal(f.get_tensor("b"), b)
    with pytest.raises(ValueError, match="no array for b"):
        write_safetensors(out, [("a", (2, 3)), ("b", (5,))], iter([a]))
    with pytest.raises(ValueError, match="more arrays"):
        write_safetensors(out, [("a", (2, 3))], iter([a, b]))
    with pytest.raises(ValueError, match="the header says float32"):
        write_safetensors(out, [("a", (3, 2))], iter([a]))
