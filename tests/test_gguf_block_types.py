"""Every GGUF block type the kernels read (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), each
in a tiny Llama written with gguf-py (K-quant blocks by the format's definition, see
`gguf_utils.quantize_k`): every linear reads its blocks, and greedy decoding gives transformers'
tokens on the same file (transformers dequantizes it with gguf-py). A file mixing types, as
Q4_K_M does, reads each shard in its own type; a type without a kernel runs on float weights,
named in one log line."""

from __future__ import annotations

import logging

import pytest
import torch
from gguf_utils import write_llama_gguf
from model_utils import ModelDriver, make_runner, save_tiny_model

from radixengine.layers import gguf_quant_ops as ops

gguf = pytest.importorskip("gguf")
needs_native = pytest.mark.skipif(
    not ops.quant_native_available(), reason="the native CPU kernels are not built"
)

# Rows a multiple of 256 (the K-quants' super-block) in every matrix.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
PROMPTS = {"a": [1, 72, 101, 108, 108, 111, 44, 32], "b": [1, 84, 104, 101, 32, 115, 101, 97, 32, 105, 115]}
NEW_TOKENS = 16


def _write(tmp_path, qtype: int, qtypes: dict[str, int] | None = None, seed: int = 0):
    hf = save_tiny_model("llama", tmp_path / "hf", seed=seed, **SHAPE)
    return hf, write_llama_gguf(tmp_path / "tiny.gguf", hf, qtype=qtype, qtypes=qtypes)


def _block_modules(model) -> dict[str, object]:
    return {
        n: m.block_weight for n, m in model.named_modules() if getattr(m, "block_weight", None) is not None
    }


def _our_greedy(runner) -> dict[str, list[int]]:
    driver = ModelDriver(runner)
    outputs: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    next_ids = driver.extend(dict(PROMPTS)).argmax(-1).tolist()
    for _ in range(NEW_TOKENS):
        for rid, tok in zip(PROMPTS, next_ids):
            outputs[rid].append(tok)
        next_ids = driver.decode(dict(zip(PROMPTS, next_ids))).argmax(-1).tolist()
    return outputs


def _transformers_greedy(path) -> dict[str, list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # all NEW_TOKENS tokens, as ours
    out = {}
    for rid, tokens in PROMPTS.items():
        ids = torch.tensor([tokens])
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
        )
        out[rid] = ref[0, len(tokens) :].tolist()
    return out


@needs_native
@pytest.mark.parametrize("qtype", tuple(ops.FORMATS), ids=lambda t: ops.QTYPE_NAMES[t])
def test_block_type_greedy_matches_transformers(qtype, tmp_path, monkeypatch):
    monkeypatch.setenv("RADIXENGINE_CACHE_DIR", str(tmp_path / "cache"))
    _, path = _write(tmp_path, qtype, seed=qtype)
    runner = make_runner(path, max_total_tokens=256, quantization="gguf")
    blocks = _block_modules(runner.model)
    layers = runner.model.config.num_hidden_layers
    assert len(blocks) == 4 * layers + 1  # qkv, o, gate_up, down per layer; the LM head
    for name, block in blocks.items():
        assert [p.qtype for p in block.parts] == [qtype], name
    assert _our_greedy(runner) == _transformers_greedy(path)


Q4_K_M_LIKE = {"attn_v": ops.GGML_Q6_K, "ffn_down": ops.GGML_Q6_K, "token_embd": ops.GGML_Q8_0}


@needs_native
def test_mixed_types_each_linear_reads_its_own(tmp_path, monkeypatch, caplog):
    """Q4_K_M's mix (q, k, o, gate, up in Q4_K; v and down in Q6_K), plus an F16 output and a BF16
    up projection, which have no kernel: the fused qkv reads Q4_K then Q6_K blocks, gate_up of
    layer 0 and the LM head compute with float weights, and one log line names them."""
    monkeypatch.setenv("RADIXENGINE_CACHE_DIR", str(tmp_path / "cache"))
    F16, BF16 = int(gguf.GGMLQuantizationType.F16), int(gguf.GGMLQuantizationType.BF16)
    _, path = _write(tmp_path, ops.GGML_Q4_K, {**Q4_K_M_LIKE, "output": F16, "blk.0.ffn_up": BF16}, seed=3)
    with caplog.at_level(logging.INFO, logger="radixengine.model_loader.loader"):
        runner = make_runner(path, max_total_tokens=256, quantization="gguf")
    model = runner.model
    layer0, layer1 = model.model.layers[0], model.model.layers[1]
    qkv = layer0.self_attn.qkv_proj.block_weight
    assert [(p.start, p.qtype) for p in qkv.parts] == [(0, ops.GGML_Q4_K), (256 + 128, ops.GGML_Q6_K)]
    assert layer0.mlp.down_proj.block_weight.parts[0].qtype == ops.GGML_Q6_K
    assert layer0.mlp.gate_up_proj.block_weight is None
    assert [p.qtype for p in layer1.mlp.gate_up_proj.block_weight.parts] == [ops.GGML_Q4_K]
    assert model.lm_head.block_weight is None
    lines = [r.getMessage() for r in caplog.records if "without a block kernel" in r.getMessage()]
    assert lines == [
        "GGUF tensors in types without a block kernel use dequantized float32 weights: "
        "BF16: blk.0.ffn_up.weight; F16: output.weight"
    ]
    w = qkv.parts[1].rows
    assert torch.equal(ops.dequantize_reference(w, ops.GGML_Q6_K), layer0.self_attn.qkv_proj.weight[384:])
    assert _our_greedy(runner) == _transformers_greedy(path)
