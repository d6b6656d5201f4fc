"""LoRA on every model family the engine serves: a batch of an adapter's request and a base
model's request gives transformers + peft's logits for each, in the extend and the decode steps
after it — Qwen2 (q/k/v biases), Qwen3 (q/k norms), Mistral, Gemma 2 and 3 (soft caps, sliding
windows), Mixtral (attention adapters over MoE layers) and Phi-3, whose checkpoints fuse q/k/v and
gate/up, so its PEFT adapters target `qkv_proj` and `gate_up_proj` (one A for the fused parts)."""

from __future__ import annotations

import random

import pytest
import torch
from lora_utils import peft_model, save_random_adapter
from model_utils import ModelDriver, assert_close_rel, hf_last_logits, make_runner, save_tiny_model

from radixengine.lora.lora_adapter import LoRAAdapter, ModuleShape
from radixengine.lora.lora_config import LoRAConfig, LoRALoadError

SPLIT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TARGETS = {
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    "mixtral": ("q_proj", "k_proj", "v_proj", "o_proj"),
}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "gemma2", "gemma3", "mixtral", "phi3"])
def test_an_adapter_on_each_family_matches_peft(tmp_path, arch):
    base = tmp_path / "base"
    hf = save_tiny_model(arch, base, seed=3)
    adapter = save_random_adapter(
        base, tmp_path / "adapter", seed=1, r=8, target_modules=TARGETS.get(arch, SPLIT)
    )
    reference = peft_model(base, adapter)
    runner = make_runner(base, lora_paths=[f"x={adapter}"])
    (lora_id,) = runner.lora_manager.adapters
    rng = random.Random(5)
    prompts = {rid: [rng.randrange(3, 200) for _ in range(n)] for rid, n in (("a", 11), ("b", 7))}
    driver = ModelDriver(runner, {"a": lora_id})
    models = {"a": reference, "b": hf}
    logits = driver.extend(prompts)
    # the adapter changes the logits (else this test could not tell a lost delta)
    assert not torch.allclose(logits[0], hf_last_logits(hf, driver.reqs["a"].tokens), atol=1e-2)
    for _ in range(3):  # Phi-3's longrope switches factors past 20 tokens: stay under
        for i, rid in enumerate(prompts):
            assert_close_rel(logits[i], hf_last_logits(models[rid], driver.reqs[rid].tokens))
        logits = driver.decode({rid: int(torch.argmax(logits[i])) for i, rid in enumerate(prompts)})


def test_a_fused_module_beside_its_split_modules_is_refused():
    config = LoRAConfig("/x", 2, 2.0, ("q_proj", "qkv_proj"))
    prefix = "base_model.model.model.layers.0.self_attn"
    tensors = {
        f"{prefix}.qkv_proj.lora_A.weight": torch.zeros(2, 8),
        f"{prefix}.qkv_proj.lora_B.weight": torch.zeros(16, 2),
        f"{prefix}.q_proj.lora_A.weight": torch.zeros(2, 8),
        f"{prefix}.q_proj.lora_B.weight": torch.zeros(8, 2),
    }
    shapes = {(0, "qkv_proj"): ModuleShape(8, (8, 4, 4))}
    with pytest.raises(LoRALoadError, match="layer 0 has both"):
        LoRAAdapter.from_tensors(config, tensors, shapes, torch.float32)


def test_a_fused_adapter_fills_each_part_with_its_rows_of_b():
    config = LoRAConfig("/x", 2, 2.0, ("gate_up_proj",))
    a, b = torch.randn(2, 8), torch.randn(12, 2)
    prefix = "base_model.model.model.layers.0.mlp.gate_up_proj"
    tensors = {f"{prefix}.lora_A.weight": a, f"{prefix}.lora_B.weight": b}
    adapter = LoRAAdapter.from_tensors(
        config, tensors, {(0, "gate_up_proj"): ModuleShape(8, (6, 6))}, torch.float32
    )
    fused_a, fused_b = adapter.weights[(0, "gate_up_proj")]
    assert torch.equal(fused_a[:, 0], a) and torch.equal(fused_a[:, 1], a)
    assert torch.equal(fused_b[:, 0, :6], b[:6].t()) and torch.equal(fused_b[:, 1, 6:], b[6:].t())
    assert not fused_b[:, 0, 6:].any() and not fused_b[:, 1, :6].any()
    # its delta is PEFT's: x A^T B^T, scaled (alpha / r = 1)
    x = torch.randn(3, 8)
    delta = sum(x @ fused_a[:, p].t() @ fused_b[:, p] for p in range(2))
    torch.testing.assert_close(delta, x @ a.t() @ b.t())
