"""Test helpers for the model executor: tiny random HF models saved as safetensors, and a small
driver that allocates pool rows / KV slots and runs a ModelRunner the way the scheduler does."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from radixengine.model_executor.forward_batch_info import ForwardBatch, ForwardMode, ModelWorkerBatch
from radixengine.model_executor.model_runner import ModelRunner
from radixengine.server_args import ServerArgs

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)


# Windows and soft caps small enough to matter on the tests' sequences (up to ~80 tokens).
TINY_ARCH = {
    "qwen3": dict(head_dim=16),
    "mistral": dict(head_dim=16, sliding_window=8),
    # Mistral's window, and on every layer a sparse MoE block: 8 experts of 32, top 2
    "mixtral": dict(
        head_dim=16, sliding_window=8, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32
    ),
    "gemma2": dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0,
    ),
    "gemma3": dict(
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=8,
        num_hidden_layers=7,
        final_logit_softcapping=6.0,
    ),
    # Phi-4-mini's shape: partial rotary (12 of 16 features) and longrope switching to its long
    # factors past 20 tokens.
    "phi3": dict(
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        sliding_window=12,
        original_max_position_embeddings=20,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.1],
            "long_factor": [1.5, 2.5, 4.0, 6.5, 9.0, 14.0],
        },
    ),
}
ARCH_NAMES = {"gemma3": "Gemma3ForCausalLM"}


def tiny_config(arch: str, **overrides):
    import transformers

    kwargs = dict(TINY, **TINY_ARCH.get(arch, {}))
    kwargs.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "mixtral": transformers.MixtralConfig,
        "gemma2": transformers.Gemma2Config,
        "gemma3": transformers.Gemma3TextConfig,
        "phi3": transformers.Phi3Config,
    }[arch]
    config = cls(**kwargs)
    config.architectures = [ARCH_NAMES.get(arch, cls.__name__.replace("Config", "ForCausalLM"))]
    return config


def save_tiny_model(arch: str, folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """A random-weight HF model (float32, eval) saved as safetensors in `folder`; returns it."""
    import transformers

    torch.manual_seed(seed)
    config = tiny_config(arch, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    return model


@torch.no_grad()
def randomize(model: torch.nn.Module, std: float = 0.15) -> None:
    """Weights large enough that attention is far from uniform (so masking errors show)."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.3 * torch.randn_like(p))
        else:
            p.normal_(0.0, std)


def make_runner(model_path: str | Path, page_size: int = 1, **kwargs) -> ModelRunner:
    args = dict(
        model_path=str(model_path),
        device="cpu",
        dtype="float32",
        max_total_tokens=4096,
        page_size=page_size,
        attention_backend="torch_native",
        num_threads=1,  # a shared machine: one thread is faster than oversubscribed two
    )
    args.update(kwargs)
    return ModelRunner(ServerArgs(**args))


@dataclass
class _Req:
    row: int
    tokens: list[int] = field(default_factory=list)  # tokens whose KV is in the pool
    slots: list[int] = field(default_factory=list)
    chunks: list[int] = field(default_factory=list)  # tokens of each forward that added to `tokens`


class ModelDriver:
    """Runs requests through a ModelRunner: rows from ReqToTokenPool, slots from the allocator
    (paged or not), req_to_token written as the scheduler writes it."""

    def __init__(self, runner: ModelRunner, lora_ids: dict[str, str] | None = None) -> None:
        self.runner = runner
        self.reqs: dict[str, _Req] = {}
        self.lora_ids = lora_ids or {}  # request id -> its LoRA adapter's id (none: the base model)

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.runner.req_to_token_pool.req_to_token

    def extend(self, new_tokens: dict[str, list[int]]) -> torch.Tensor:
        """Append `new_tokens[rid]` to each request (new requests get a row); returns the logits
        of each request's last token `[bs, vocab]`."""
        rids = list(new_tokens)
        for rid in rids:
            if rid not in self.reqs:
                (row,) = self.runner.req_to_token_pool.alloc(1)
                self.reqs[rid] = _Req(row)
        reqs = [self.reqs[r] for r in rids]
        prefix = [len(r.tokens) for r in reqs]
        extend = [len(new_tokens[r]) for r in rids]
        locs = self._alloc_extend(reqs, prefix, extend)
        self._write_slots(reqs, prefix, extend, locs)
        ids = [t for r in rids for t in new_tokens[r]]
        batch = self._batch(ForwardMode.EXTEND, reqs, ids, locs, prefix, extend)
        batch.lora_ids = [self.lora_ids.get(r) for r in rids]
        for r, rid in zip(reqs, rids):
            r.tokens += new_tokens[rid]
            r.chunks.append(len(new_tokens[rid]))
        return self.forward(batch)

    def decode(self, next_tokens: dict[str, int]) -> torch.Tensor:
        reqs = [self.reqs[r] for r in next_tokens]
        locs = self._alloc_decode(reqs)
        self._write_slots(reqs, [len(r.tokens) for r in reqs], [1] * len(reqs), locs)
        batch = self._batch(ForwardMode.DECODE, reqs, list(next_tokens.values()), locs, None, None)
        batch.lora_ids = [self.lora_ids.get(r) for r in next_tokens]
        for r, tok in zip(reqs, next_tokens.values()):
            r.tokens.append(tok)
            r.chunks.append(1)
        return self.forward(batch)

    def forward(self, batch: ModelWorkerBatch) -> torch.Tensor:
        fb = ForwardBatch.init_new(batch, self.runner)
        return self.runner.forward(fb).next_token_logits

    def free(self, rid: str) -> None:
        req = self.reqs.pop(rid)
        self.runner.token_to_kv_pool_allocator.free(torch.tensor(req.slots, dtype=torch.int64))
        self.runner.req_to_token_pool.free(req.row)

    def _alloc_extend(self, reqs: list[_Req], prefix: list[int], extend: list[int]) -> torch.Tensor:
        alloc = self.runner.token_to_kv_pool_allocator
        if alloc.page_size == 1:
            locs = alloc.alloc(sum(extend))
        else:
            last = [r.slots[-1] if r.slots else -1 for r in reqs]
            seq = [p + e for p, e in zip(prefix, extend)]
            locs = alloc.alloc_extend(prefix, seq, last, sum(extend))
        assert locs is not None, "KV pool exhausted"
        return locs

    def _alloc_decode(self, reqs: list[_Req]) -> torch.Tensor:
        alloc = self.runner.token_to_kv_pool_allocator
        if alloc.page_size == 1:
            locs = alloc.alloc(len(reqs))
        else:
            seq = [len(r.tokens) + 1 for r in reqs]
            locs = alloc.alloc_decode(seq, [r.slots[-1] for r in reqs])
        assert locs is not None, "KV pool exhausted"
        return locs

    def _write_slots(self, reqs, prefix, extend, locs: torch.Tensor) -> None:
        start = 0
        for r, p, e in zip(reqs, prefix, extend):
            new = locs[start : start + e]
            self.runner.req_to_token_pool.write((r.row, slice(p, p + e)), new.to(torch.int32))
            r.slots += new.tolist()
            start += e

    def _batch(self, mode, reqs, ids, locs, prefix, extend) -> ModelWorkerBatch:
        seq_lens = [
            len(r.tokens) + (e if e is not None else 1) for r, e in zip(reqs, extend or [None] * len(reqs))
        ]
        return ModelWorkerBatch(
            forward_mode=mode,
            input_ids=torch.tensor(ids, dtype=torch.int64),
            req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            seq_lens_cpu=seq_lens,
            out_cache_loc=locs,
            extend_prefix_lens=prefix,
            extend_seq_lens=extend,
            sampling_info=None,
        )


@torch.no_grad()
def hf_last_logits(hf_model, tokens: list[int], chunks: list[int] | None = None) -> torch.Tensor:
    """transformers' logits of the last token: one forward over `tokens`, or with `chunks` (token
    counts summing to len(tokens)) one forward per chunk over a KV cache, as `generate` runs
    (longrope picks its factors per forward: its logits depend on the split)."""
    if chunks is None:
        return hf_model(torch.tensor([tokens])).logits[0, -1].float()
    from transformers import DynamicCache

    assert sum(chunks) == len(tokens), (chunks, len(tokens))
    cache, start = DynamicCache(config=hf_model.config), 0
    for n in chunks:
        out = hf_model(torch.tensor([tokens[start : start + n]]), past_key_values=cache, use_cache=True)
        start += n
    return out.logits[0, -1].float()


def assert_close_rel(ours: torch.Tensor, ref: torch.Tensor, rtol: float = 1e-4) -> None:
    err = (ours.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= rtol * scale, f"max abs error {err:.3g} > {rtol} * {scale:.3g}"


def assert_runners_agree(runner: ModelRunner, reference: ModelRunner, decode_steps: int = 4) -> None:
    """Two runners of one model (a packed CPU linear against torch's): the logits of an extend of
    two prompts and of `decode_steps` greedy decode steps within 5% of the reference's largest,
    and the extend's greedy tokens equal."""
    prompts = {"a": list(range(3, 40)), "b": [7, 9, 11, 200, 13]}
    ours, ref = ModelDriver(runner), ModelDriver(reference)
    got, want = ours.extend(prompts), ref.extend(prompts)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    for _ in range(decode_steps):
        step = dict(zip(prompts, want.argmax(-1).tolist()))
        got, want = ours.decode(step), ref.decode(step)
        assert (got - want).abs().max() < 0.05 * want.abs().max()
