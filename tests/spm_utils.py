"""A SentencePiece-style (Llama-2 / Mistral) tokenizer built locally: BPE over words that carry
their leading space as "▁", a decoder that turns "▁" back into spaces and strips the one leading
space of the whole text (so "▁Paris" alone decodes to "Paris"), a BOS token; saved as a
transformers LlamaTokenizer. And a tiny random Llama that uses it."""

from __future__ import annotations

import os

from test_engine_utils import save_tiny_llama

SPM_CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.",
    "hello world this is a test of the tokenizer and of the engine that serves it",
    "Once upon a time there was a small model that answered every question with numbers 0 1 2 3",
]


def build_spm_tokenizer(path: str, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import LlamaTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", "merged_with_next")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(SPM_CORPUS * 20, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = LlamaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)
    return fast


def build_tiny_spm_model(path: str, seed: int = 0) -> str:
    """A random-weight 2-layer Llama with the tokenizer above, saved as an HF folder (fp32)."""
    os.makedirs(path, exist_ok=True)
    tokenizer = build_spm_tokenizer(path)
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return save_tiny_llama(path, len(tokenizer), seed, 512, **special)
