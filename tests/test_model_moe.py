"""Qwen3-MoE, Qwen2-MoE and Mixtral: our forward over the paged KV pool vs transformers on tiny
random models (fp32), and the routed-experts paths against a per-expert loop."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from model_utils import TINY, TINY_ARCH, ModelDriver, assert_close_rel, hf_last_logits, make_runner, randomize

from radixengine.layers import moe_experts
from radixengine.layers.moe import select_experts

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=3)
ARCHS = {
    # layers 0 and 2 sparse, 1 dense (mlp_only_layers); top-k weights renormalized
    "qwen3_moe": dict(MOE, head_dim=16, mlp_only_layers=[1], norm_topk_prob=True),
    # layer 1 sparse, 0 and 2 dense (decoder_sparse_step); softmax weights as they are
    "qwen2_moe": dict(MOE, decoder_sparse_step=2, shared_expert_intermediate_size=48, norm_topk_prob=False),
    # every layer sparse, top-k weights renormalized; Mistral's sliding window, shorter than the
    # prompts
    "mixtral": dict(TINY_ARCH["mixtral"], num_hidden_layers=3),
}
LENGTHS = [37, 5, 18, 1]


def save_tiny_moe(arch: str, folder, seed: int):
    import transformers

    torch.manual_seed(seed)
    cls = {
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "mixtral": transformers.MixtralConfig,
    }[arch]
    config = cls(**dict(TINY, **ARCHS[arch]))
    config.architectures = [cls.__name__.replace("Config", "ForCausalLM")]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize(model)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, save_tiny_moe(request.param, folder, seed=list(ARCHS).index(request.param))


def _prompts(seed: int, lengths=LENGTHS) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(256) for _ in range(n)] for i, n in enumerate(lengths)}


def test_sparse_and_dense_layers_follow_the_config(tiny):
    from radixengine.layers.moe import FusedMoE

    folder, hf = tiny
    runner = make_runner(folder)
    ours = [isinstance(layer.mlp, FusedMoE) for layer in runner.model.model.layers]
    theirs = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert ours == theirs and any(ours)
    assert all(ours) == (hf.config.model_type == "mixtral")


@pytest.mark.parametrize("page_size", [1, 16])
def test_full_prefill_ragged_batch(tiny, page_size):
    folder, hf = tiny
    driver = ModelDriver(make_runner(folder, page_size))
    prompts = _prompts(1)
    logits = driver.extend(prompts)
    for i, tokens in enumerate(prompts.values()):
        assert_close_rel(logits[i], hf_last_logits(hf, tokens))


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_split_into_cached_prefix_and_extend(tiny, page_size):
    folder, hf = tiny
    driver = ModelDriver(make_runner(folder, page_size))
    prompts = _prompts(2, [40, 23, 9, 17])
    rng = random.Random(3)
    cuts = {rid: rng.randrange(1, len(t)) for rid, t in prompts.items()}
    driver.extend({rid: t[: cuts[rid]] for rid, t in prompts.items()})
    logits = driver.extend({rid: t[cuts[rid] :] for rid, t in prompts.items()})
    for i, tokens in enumerate(prompts.values()):
        assert_close_rel(logits[i], hf_last_logits(hf, tokens))


@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_steps_ragged_batch(tiny, page_size):
    folder, hf = tiny
    driver = ModelDriver(make_runner(folder, page_size))
    driver.extend(_prompts(4))
    rng = random.Random(5)
    for step in range(5):
        if step == 2:
            driver.extend({"late": [rng.randrange(256) for _ in range(11)]})
        if step == 3:
            driver.free("r1")
        next_tokens = {rid: rng.randrange(256) for rid in driver.reqs}
        logits = driver.decode(next_tokens)
        for i, rid in enumerate(next_tokens):
            assert_close_rel(logits[i], hf_last_logits(hf, driver.reqs[rid].tokens))


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_32_tokens_match_transformers(tiny, page_size):
    folder, hf = tiny
    driver = ModelDriver(make_runner(folder, page_size))
    prompts = _prompts(6, [12, 3, 25])
    ours = {rid: [] for rid in prompts}
    next_ids = driver.extend(prompts).argmax(-1).tolist()
    for _ in range(32):
        for rid, tok in zip(prompts, next_ids):
            ours[rid].append(tok)
        next_ids = driver.decode(dict(zip(prompts, next_ids))).argmax(-1).tolist()
    hf.generation_config.eos_token_id = None  # never stop early: 32 tokens, like ours
    for rid, tokens in prompts.items():
        ids = torch.tensor([tokens])
        ref = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False, pad_token_id=0
        )[0, len(tokens) :].tolist()
        assert ours[rid] == ref, rid


@pytest.mark.parametrize(
    "arch,name",
    [
        ("qwen3_moe", "model.layers.2.mlp.experts.5.up_proj.weight"),
        ("mixtral", "model.layers.1.block_sparse_moe.experts.5.w3.weight"),
    ],
)
def test_checkpoint_missing_an_expert_is_refused(tmp_path, arch, name):
    from safetensors.torch import load_file, save_file

    save_tiny_moe(arch, tmp_path, seed=7)
    weights = load_file(tmp_path / "model.safetensors")
    del weights[name]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"lacks 1 weight\(s\): {name}"):
        make_runner(tmp_path)


# --- the routed experts ---------------------------------------------------------------------

PATHS = {
    "grouped": moe_experts.fused_experts_grouped,
    "grouped_static": functools.partial(moe_experts.fused_experts_grouped, static_shapes=True),
    "dispatch": moe_experts.fused_experts,
}
if moe_experts.moe_native_available():
    PATHS["native"] = moe_experts.fused_experts_native


def _experts_case(seed: int, tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype, skew=0.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, hidden, 2 * inter, generator=g) * hidden**-0.5).to(dtype)
    w2 = (torch.randn(experts, inter, hidden, generator=g) * inter**-0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, : experts // 2] -= skew  # a skew leaves the first half of the experts idle
    weights, ids = select_experts(logits.to(dtype), top_k, renormalize=seed % 2 == 0)
    return x, w13, w2, weights, ids


CASES = [
    # seed, tokens, experts, top_k, hidden, inter, skew
    (0, 1, 8, 2, 64, 32, 0.0),  # decode of one token: 6 experts idle
    (1, 5, 16, 4, 64, 48, 0.0),
    (2, 300, 8, 2, 128, 64, 0.0),  # prefill: groups over the native kernel's MKL threshold
    (3, 40, 32, 8, 96, 32, 100.0),  # the first 16 experts get no token
    (4, 7, 64, 6, 32, 16, 0.0),  # few of many experts hit: the grouped path copies their weights
]


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[1]}_E{c[2]}_k{c[3]}" for c in CASES])
def test_routed_experts_match_per_expert_loop(path, case):
    seed, tokens, experts, top_k, hidden, inter, skew = case
    x, w13, w2, weights, ids = _experts_case(seed, tokens, experts, top_k, hidden, inter, torch.float32, skew)
    if skew:
        assert ids.min() >= experts // 2
    ref = moe_experts.fused_experts_naive(x, w13, w2, weights, ids)
    torch.testing.assert_close(PATHS[path](x, w13, w2, weights, ids), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", list(PATHS))
def test_routed_experts_bfloat16(path):
    x, w13, w2, weights, ids = _experts_case(5, 9, 8, 2, 64, 32, torch.bfloat16)
    ref = moe_experts.fused_experts_naive(x.float(), w13.float(), w2.float(), weights.float(), ids)
    out = PATHS[path](x, w13, w2, weights, ids)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


def test_routed_experts_no_tokens():
    x, w13, w2, weights, ids = _experts_case(6, 0, 8, 2, 64, 32, torch.float32)
    assert moe_experts.fused_experts(x, w13, w2, weights, ids).shape == (0, 64)


def test_sort_by_expert_groups_pairs():
    ids = torch.tensor([[3, 0], [0, 2], [3, 1]])
    groups = moe_experts.sort_by_expert(ids, 5)
    assert groups.expert.tolist() == [0, 0, 1, 2, 3, 3]
    assert groups.token.tolist() == [0, 1, 2, 1, 0, 2]
    assert groups.counts.tolist() == [2, 1, 1, 2, 0]
    assert groups.offsets.tolist() == [0, 2, 3, 4, 6, 6]


def test_select_experts_matches_softmax_topk():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    weights, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(weights, probs[:, [1, 2]])
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(1))
