"""Multi-LoRA serving (docs/lora.md): PEFT adapters, the slot pool, the batched delta."""
