"""Model paths: Hugging Face repo ids through a local HF cache (HF_HUB_CACHE, HF_HOME, --revision),
GGUF files of a cached repo, the error naming where it looked, PyTorch .bin weights (sharded or
not) and a server started by repo id."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from model_utils import ModelDriver, assert_close_rel, hf_last_logits, make_runner, save_tiny_model
from test_engine_utils import build_tiny_model, hf_greedy, launch_test_server, load_hf_model, stop_test_server

from radixengine.model_loader import (
    ModelConfig,
    get_tokenizer,
    locate_model,
    resolve_model_path,
    resolve_tokenizer_path,
    weight_utils,
)

COMMIT_A = "a" * 40
COMMIT_B = "0123456789abcdef0123456789abcdef01234567"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def cache_repo(
    cache: Path, repo_id: str, source: Path, commit: str, refs: tuple[str, ...] = ("main",), files=None
) -> Path:
    """`source`'s files (or `files` of it) stored as huggingface_hub stores a download: blobs,
    `snapshots/<commit>/` symlinks to them, `refs/<name>` holding the commit. Returns the
    snapshot. A large file's blob is a link to it rather than a copy."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for file in files or sorted(p for p in source.rglob("*") if p.is_file()):
        large = file.stat().st_size > 1 << 24
        blob = repo / "blobs" / hashlib.sha256(str(file).encode() if large else file.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        if large:
            blob.symlink_to(file)
        else:
            shutil.copyfile(file, blob)
        link = snapshot / file.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny Llamas (different weights) and a GGUF-only folder."""
    root = tmp_path_factory.mktemp("sources")
    hf_a = save_tiny_model("llama", root / "a", seed=0)
    hf_b = save_tiny_model("llama", root / "b", seed=1)
    (root / "gguf").mkdir()
    for name in ("tiny-Q8_0.gguf", "tiny-Q4_1.gguf"):
        (root / "gguf" / name).write_bytes(b"GGUF" + name.encode())  # located, never read
    return root, hf_a, hf_b


@pytest.fixture
def hub(models, tmp_path, monkeypatch):
    """An HF cache under HF_HUB_CACHE: org/tiny with main -> A and tag v2 -> B, org/tiny-GGUF."""
    root = models[0]
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    snaps = {
        "a": cache_repo(cache, "org/tiny", root / "a", COMMIT_A),
        "b": cache_repo(cache, "org/tiny", root / "b", COMMIT_B, refs=("v2",)),
        "gguf": cache_repo(cache, "org/tiny-GGUF", root / "gguf", COMMIT_A),
    }
    return cache, snaps


def test_repo_id_resolves_to_its_snapshot_and_loads(hub, models):
    _, snaps = hub
    assert locate_model("org/tiny") == str(snaps["a"])
    assert resolve_model_path("org/tiny") == str(snaps["a"])
    logits = ModelDriver(make_runner("org/tiny")).extend({"r": PROMPT})[0]
    assert_close_rel(logits, hf_last_logits(models[1], PROMPT))


def test_revision_picks_a_tag_or_a_commit(hub, models):
    _, snaps = hub
    assert locate_model("org/tiny", revision="v2") == str(snaps["b"])
    assert locate_model("org/tiny", revision=COMMIT_A) == str(snaps["a"])
    assert locate_model("org/tiny", revision=COMMIT_B) == str(snaps["b"])
    config = ModelConfig("org/tiny", dtype="float32", revision="v2")
    assert config.model_path == config.hf_path == str(snaps["b"])
    logits = ModelDriver(make_runner("org/tiny", revision="v2")).extend({"r": PROMPT})[0]
    assert_close_rel(logits, hf_last_logits(models[2], PROMPT))


def test_hf_home_locates_the_cache(models, tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    snapshot = cache_repo(tmp_path / "home" / "hub", "org/tiny", models[0] / "a", COMMIT_A)
    assert locate_model("org/tiny") == str(snapshot)


def test_missing_repo_names_where_it_looked(hub):
    cache, _ = hub
    with pytest.raises(FileNotFoundError) as err:
        locate_model("org/absent")
    message = str(err.value)
    assert "org/absent" in message and str(cache) in message
    assert f"{cache}/models--org--absent/refs/main" in message and "hf download org/absent" in message
    with pytest.raises(FileNotFoundError) as err:
        locate_model("org/tiny", revision="v9")
    assert "refs/v9" in str(err.value) and "['main', 'v2']" in str(err.value)
    with pytest.raises(FileNotFoundError, match="--tokenizer-path org/absent"):
        get_tokenizer("org/tiny", tokenizer_path="org/absent")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        locate_model("./not/here")


def test_gguf_of_a_cached_repo(hub):
    _, snaps = hub
    gguf = snaps["gguf"]
    assert locate_model("org/tiny-GGUF/tiny-Q4_1.gguf") == str(gguf / "tiny-Q4_1.gguf")
    assert locate_model("org/tiny-GGUF:Q8_0") == str(gguf / "tiny-Q8_0.gguf")
    assert locate_model("org/tiny-GGUF:q4_1") == str(gguf / "tiny-Q4_1.gguf")
    with pytest.raises(FileNotFoundError, match=r"tiny-Q5_K\.gguf is not in the cached snapshot.*tiny-Q4_1"):
        locate_model("org/tiny-GGUF/tiny-Q5_K.gguf")
    with pytest.raises(FileNotFoundError, match="no .gguf file .* ends in Q6_K"):
        locate_model("org/tiny-GGUF:Q6_K")
    with pytest.raises(FileNotFoundError, match=r"holds \['tiny-Q4_1.gguf', 'tiny-Q8_0.gguf'\]: name one"):
        resolve_model_path("org/tiny-GGUF")
    (gguf / "tiny-Q8_0.gguf").unlink()
    assert locate_model("org/tiny-GGUF") == str(gguf / "tiny-Q4_1.gguf")  # the repo's only .gguf


def test_bundled_gguf_by_repo_and_quant_type(hub, gguf_path):
    """The bundled SmolLM2 GGUF as a cached GGUF repo: `repo:Q4_1` loads it with its block
    weights and its tokenizer, as the file itself does."""
    cache, _ = hub
    file = Path(gguf_path)
    snapshot = cache_repo(cache, "HuggingFaceTB/SmolLM2-GGUF", file.parent, COMMIT_A, files=[file])
    repo = "HuggingFaceTB/SmolLM2-GGUF:Q4_1"
    assert locate_model(repo) == str(snapshot / file.name)
    tokens = get_tokenizer(repo).encode("The capital of France is")
    assert tokens == get_tokenizer(gguf_path).encode("The capital of France is")
    ours, ref = make_runner(repo), make_runner(gguf_path)
    assert ours.model.model.layers[0].mlp.down_proj.block_weight is not None
    ours_logits = ModelDriver(ours).extend({"r": tokens})[0]
    assert torch.equal(ours_logits, ModelDriver(ref).extend({"r": tokens})[0])


def test_tokenizer_repo_id_and_revision(hub, tmp_path):
    cache, _ = hub
    from test_engine_utils import build_tokenizer

    build_tokenizer(str(tmp_path / "tok"))
    cache_repo(cache, "org/tok", tmp_path / "tok", COMMIT_B, refs=("v2",))
    cache_repo(cache, "org/tok", tmp_path / "tok", COMMIT_A)
    assert get_tokenizer("org/tok", revision="v2").encode("hello world")
    with pytest.raises(FileNotFoundError, match="refs/v3"):
        get_tokenizer("org/tok", revision="v3")
    # --revision is the model's: it applies to the model's own repo, not to another tokenizer repo
    assert resolve_tokenizer_path("org/tok", "org/tok", "v2").endswith(COMMIT_B)
    assert resolve_tokenizer_path("org/tiny", "org/tok", "v2").endswith(COMMIT_A)


def assert_same_model(ours, ref) -> None:
    """Every parameter equal, and so the logits (to rounding: BLAS may sum differently for
    tensors at other addresses)."""
    ref_params = dict(ref.model.named_parameters())
    for name, param in ours.model.named_parameters():
        assert torch.equal(param, ref_params[name]), name
    logits = ModelDriver(ours).extend({"r": PROMPT})[0]
    assert_close_rel(logits, ModelDriver(ref).extend({"r": PROMPT})[0], rtol=1e-6)


def _bin_copy(source: Path, target: Path, shards: int) -> None:
    """The checkpoint of `source` as PyTorch pickles: one pytorch_model.bin, or `shards` files
    and pytorch_model.bin.index.json."""
    from safetensors.torch import load_file

    target.mkdir()
    shutil.copyfile(source / "config.json", target / "config.json")
    state = load_file(source / "model.safetensors")
    if shards == 1:
        torch.save(state, target / "pytorch_model.bin")
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[i::shards]}
        torch.save(part, target / file)
        weight_map.update(dict.fromkeys(part, file))
    (target / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    torch.save({"step": torch.tensor(1)}, target / "training_args.bin")  # not weights: skipped


@pytest.mark.parametrize("shards", [1, 3])
def test_bin_weights_give_the_safetensors_logits(models, tmp_path, shards):
    source = models[0] / "a"
    _bin_copy(source, tmp_path / "bin", shards)
    files = weight_utils.checkpoint_files(tmp_path / "bin")
    assert len(files) == shards and all(f.suffix == ".bin" for f in files)
    assert_same_model(make_runner(tmp_path / "bin"), make_runner(source))


def test_sharded_safetensors_give_the_single_file_logits(models, tmp_path):
    save_tiny_model("llama", tmp_path, seed=0, max_shard_size="50KB")
    assert len(weight_utils.checkpoint_files(tmp_path)) > 2
    assert_same_model(make_runner(tmp_path), make_runner(models[0] / "a"))


def test_folder_without_weights_names_both_formats(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors nor \*\.bin"):
        weight_utils.checkpoint_files(tmp_path)


def test_server_by_repo_id_and_revision(tmp_path, monkeypatch):
    """A real server started with a repo id and --revision: the tokenizer, the scheduler and the
    detokenizer all read the v2 snapshot; /model_info shows the id and the folder."""
    cache = tmp_path / "hub"
    build_tiny_model(str(tmp_path / "v1"), seed=0)
    build_tiny_model(str(tmp_path / "v2"), seed=1)
    cache_repo(cache, "org/chat", tmp_path / "v1", COMMIT_A)
    snapshot = cache_repo(cache, "org/chat", tmp_path / "v2", COMMIT_B, refs=("v2",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    args = ["--revision", "v2", "--dtype", "float32", "--max-total-tokens", "2048", "--num-threads", "1"]
    proc = launch_test_server("org/chat", tmp_path / "server.log", args)
    try:
        info = httpx.get(proc.base_url + "/model_info").json()
        assert info["model_path"] == "org/chat" and info["resolved_model_path"] == str(snapshot)
        assert info["architectures"] == ["LlamaForCausalLM"]
        params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
        body = httpx.post(
            proc.base_url + "/generate", json={"text": "hello world", "sampling_params": params}
        )
        tok = get_tokenizer(str(snapshot))
        expected = hf_greedy(load_hf_model(str(snapshot)), [tok.encode("hello world")], 8)[0]
        assert body.json()["output_ids"] == expected
        assert body.json()["text"] == tok.decode(expected, skip_special_tokens=True)
    finally:
        stop_test_server(proc)
