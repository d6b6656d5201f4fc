"""Linears that keep their GGUF blocks (`--quantization gguf`): the blocks land in the right rows
of the fused projections, hold exactly the float weights' values, and decode through them gives
the same tokens as the float path."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from model_utils import ModelDriver, make_runner, tiny_config

from radixengine.layers import gguf_quant_ops
from radixengine.layers.gguf_quant_ops import GGML_Q4_1, GGML_Q8_0, dequantize_reference
from radixengine.model_loader.gguf_loader import unpermute_qk
from radixengine.model_loader.loader import GGUF_BLOCK_MAX_TOKENS, load_gguf_block_weights
from radixengine.models.llama import LlamaForCausalLM

needs_native = pytest.mark.skipif(
    not gguf_quant_ops.quant_native_available(), reason="the native CPU kernels are not built"
)


def _block_modules(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if getattr(m, "block_weight", None) is not None}


@needs_native
def test_smollm2_blocks_equal_float_weights(gguf_path):
    runner = make_runner(gguf_path, max_total_tokens=256, quantization="gguf")
    model = runner.model
    blocks = _block_modules(model)
    layers = model.config.num_hidden_layers
    assert len(blocks) == 4 * layers + 1  # qkv, o, gate_up, down per layer; the tied embedding
    for name, module in blocks.items():
        (part,) = module.block_weight.parts
        assert part.qtype == (GGML_Q8_0 if "embed_tokens" in name else GGML_Q4_1), name
        assert torch.equal(dequantize_reference(part.rows, part.qtype), module.weight), name


@needs_native
def test_smollm2_decode_through_blocks_matches_float_path(gguf_path):
    prompts = {"a": [1, 504, 3458, 282, 4649, 30], "b": [1, 9690, 2114, 253, 1812, 42, 105, 7]}
    outputs = {}
    for mode in ("gguf", "none"):
        driver = ModelDriver(make_runner(gguf_path, max_total_tokens=256, quantization=mode))
        logits = driver.extend(prompts)
        tokens, steps = logits.argmax(-1).tolist(), [logits]
        generated = [tokens]
        for _ in range(12):
            logits = driver.decode(dict(zip(prompts, tokens)))
            tokens = logits.argmax(-1).tolist()
            steps.append(logits)
            generated.append(tokens)
        outputs[mode] = (generated, steps)
    assert outputs["gguf"][0] == outputs["none"][0]
    for got, ref in zip(outputs["gguf"][1], outputs["none"][1]):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)


def test_quantization_gguf_needs_a_gguf_model(tmp_path):
    from model_utils import save_tiny_model

    save_tiny_model("llama", tmp_path)
    with pytest.raises(ValueError, match="--quantization gguf cannot run here: the weights do not come from"):
        make_runner(str(tmp_path), max_total_tokens=64, quantization="gguf")


def test_block_rows_follow_shards_and_mixed_types_fall_back(tmp_path, caplog):
    """q, k in Q4_1 but v in F32: the fused qkv keeps float weights only; o, gate/up and down
    keep blocks, with llama's q/k row permutation undone like the float weights'; F32 (the float
    weights' own type) is not named in the no-kernel log line."""
    import gguf

    config = tiny_config(
        "llama", hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2
    )
    torch.set_default_dtype(torch.float32)
    model = LlamaForCausalLM(config)
    rng = np.random.default_rng(0)
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    raw: dict[str, tuple[np.ndarray, int]] = {}
    kv = config.num_key_value_heads * 16
    shapes = {
        "attn_q": (64, 64),
        "attn_k": (kv, 64),
        "attn_v": (kv, 64),
        "attn_output": (64, 64),
        "ffn_gate": (96, 64),
        "ffn_up": (96, 64),
        "ffn_down": (64, 96),
    }
    types = {"attn_v": None, "ffn_gate": GGML_Q8_0, "ffn_up": GGML_Q8_0}
    for layer in range(config.num_hidden_layers):
        for short, shape in shapes.items():
            name = f"blk.{layer}.{short}.weight"
            w = rng.standard_normal(shape).astype(np.float32)
            qtype = types.get(short, GGML_Q4_1)
            if qtype is None:
                writer.add_tensor(name, w)
                continue
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType(qtype))
            writer.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType(qtype))
            raw[name] = (q, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    with caplog.at_level("INFO", logger="radixengine.model_loader.loader"):
        kept = load_gguf_block_weights(model, SimpleNamespace(model_path=str(path), hf_config=config))
    assert "without a block kernel" not in caplog.text
    layer = model.model.layers[0]
    assert kept == 3 * config.num_hidden_layers
    assert layer.self_attn.qkv_proj.block_weight is None
    assert [p.qtype for p in layer.self_attn.o_proj.block_weight.parts] == [GGML_Q4_1]
    gate_up = layer.mlp.gate_up_proj.block_weight
    assert [p.qtype for p in gate_up.parts] == [GGML_Q8_0] and gate_up.max_tokens == GGUF_BLOCK_MAX_TOKENS
    gate, up = raw["blk.0.ffn_gate.weight"][0], raw["blk.0.ffn_up.weight"][0]
    assert torch.equal(gate_up.parts[0].rows, torch.from_numpy(np.concatenate([gate, up])))
    o_rows = layer.self_attn.o_proj.block_weight.parts[0].rows
    assert torch.equal(o_rows, torch.from_numpy(raw["blk.0.attn_output.weight"][0]))


def test_unpermute_applies_to_block_rows():
    """Permuting whole block rows commutes with dequantizing them (rows never mix)."""
    import gguf

    rng = np.random.default_rng(1)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    rows_then_dequant = gguf.quants.dequantize(unpermute_qk(q, 4), gguf.GGMLQuantizationType.Q4_1)
    dequant_then_rows = unpermute_qk(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q4_1), 4)
    assert np.array_equal(rows_then_dequant, dequant_then_rows)
