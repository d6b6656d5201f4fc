"""Test helpers for LoRA: random PEFT adapters over the tiny models, saved as PEFT saves them,
and transformers + peft as the reference."""

from __future__ import annotations

from pathlib import Path

import torch


def save_random_adapter(
    base_folder: Path,
    folder: Path,
    seed: int,
    r: int = 8,
    alpha: float = 16.0,
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    use_rslora: bool = False,
    std: float = 0.2,
    safe_serialization: bool = True,
) -> Path:
    """A LoRA adapter of `r` over the model in `base_folder` with random A and B (PEFT's B starts
    at zero: randomised so the delta shows), saved by `save_pretrained`."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora, lora_dropout=0.0
    )
    model = peft.get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(folder, safe_serialization=safe_serialization)
    return folder


def peft_model(base_folder: Path, adapter_folder: Path):
    """transformers + peft: the base model with the adapter, eval, float32."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32).eval()
    return peft.PeftModel.from_pretrained(base, adapter_folder).eval()


@torch.no_grad()
def greedy_reference(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs, one full forward per step."""
    tokens, out, logprobs = list(prompt), [], []
    for _ in range(steps):
        logits = model(torch.tensor([tokens])).logits[0, -1].float()
        lp = torch.log_softmax(logits, -1)
        tok = int(torch.argmax(logits))
        out.append(tok)
        logprobs.append(float(lp[tok]))
        tokens.append(tok)
    return out, logprobs
