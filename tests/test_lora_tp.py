"""LoRA under tensor parallelism (gloo on the CPU): each rank holds its slice of every adapter (A
whole and B's output rows of its heads for q/k/v and gate/up; A's input columns and B whole for
o and down, whose delta joins the partial output before the ranks' sum), so a batch mixing
adapters and the base model gives transformers + peft's greedy tokens on 2 ranks and on 4 (the
key/value heads replicated), in both loops, and with n-gram speculation; a bf16 model gives one
rank's tokens; adapters load and unload at run time on every rank; the adapter's digest is every
rank's."""

from __future__ import annotations

import random

import pytest
import torch
from lora_utils import greedy_reference, peft_model, save_random_adapter
from test_engine_utils import build_tiny_model, wait_for_idle_accounting

from radixengine import Engine
from radixengine.managers.request_errors import RequestError

ENGINE = dict(
    device="cpu",
    num_threads=1,
    log_level="warning",
    max_total_tokens=4096,
    test_mode=True,  # the ranks compare their schedulers every step
    watchdog_timeout=120,
)
ADAPTERS = {"a": dict(seed=21, r=8), "b": dict(seed=22, r=4, use_rslora=True)}
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
LOOPS = {"overlap": dict(cpu_forward_stream="thread"), "normal": dict(disable_overlap_schedule=True)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    base = build_tiny_model(str(tmp_path_factory.mktemp("base")))
    out = {"base": base}
    for name, kw in ADAPTERS.items():
        out[name] = str(save_random_adapter(base, tmp_path_factory.mktemp(name), **kw))
    return out


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 390) for _ in range(n)] for n in (7, 19, 12, 25, 9, 16)]


def which(prompts: list[list[int]]) -> list[str | None]:
    return [[None, "a", "b"][i % 3] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def expected(folders, prompts) -> list[list[int]]:
    models = {n: peft_model(folders["base"], folders[n]) for n in ADAPTERS}
    import transformers

    models[None] = transformers.AutoModelForCausalLM.from_pretrained(
        folders["base"], dtype=torch.float32
    ).eval()
    return [
        greedy_reference(models[n], p, GREEDY["max_new_tokens"])[0] for p, n in zip(prompts, which(prompts))
    ]


def _engine(folders, tp_size: int, **kw) -> Engine:
    paths = [f"{n}={folders[n]}" for n in ADAPTERS]
    return Engine(model_path=folders["base"], tp_size=tp_size, lora_paths=paths, **ENGINE, **kw)


def _generate(engine: Engine, prompts, names) -> list[list[int]]:
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=names)
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize(
    "tp_size,loop,spec",
    [(2, "overlap", None), (2, "normal", None), (4, "normal", None), (2, "overlap", "NGRAM")],
    ids=["tp2-overlap", "tp2-normal", "tp4", "tp2-ngram"],
)
def test_mixed_adapters_on_tp_ranks_match_peft(folders, prompts, expected, tp_size, loop, spec):
    engine = _engine(folders, tp_size, dtype="float32", speculative_algorithm=spec, **LOOPS[loop])
    try:
        assert _generate(engine, prompts, which(prompts)) == expected
        info = wait_for_idle_accounting(engine.get_server_info, 20.0)
        assert (info["num_spec_verify_reqs"] > 0) == (spec is not None)
    finally:
        engine.shutdown()


def test_bf16_on_two_ranks_gives_one_ranks_tokens(folders, prompts):
    """A 16-bit model sums the ranks' partial outputs (each with its delta) in float32."""
    names = which(prompts)
    outs = {}
    for tp_size in (1, 2):
        engine = _engine(folders, tp_size, dtype="bfloat16", disable_overlap_schedule=True)
        try:
            outs[tp_size] = _generate(engine, prompts, names)
        finally:
            engine.shutdown()
    assert outs[2] == outs[1]
    plain = _engine(folders, 1, dtype="bfloat16", disable_overlap_schedule=True)
    try:  # the adapters changed the tokens (else this test could not tell a lost delta)
        assert _generate(plain, prompts, [None] * len(prompts)) != outs[1]
    finally:
        plain.shutdown()


def test_load_use_unload_on_every_rank(folders, prompts, expected):
    engine = Engine(model_path=folders["base"], tp_size=2, enable_lora=True, dtype="float32", **ENGINE)
    try:
        assert engine.load_lora_adapter("a", folders["a"]) == {"a": folders["a"]}
        names = ["a" if n == "a" else None for n in which(prompts)]
        tokens = _generate(engine, prompts, names)
        assert [t for t, n in zip(tokens, names) if n] == [
            e for e, n in zip(expected, which(prompts)) if n == "a"
        ]
        assert engine.unload_lora_adapter("a") == {}
        with pytest.raises(RequestError, match="'a' was unloaded"):
            engine.generate(input_ids=prompts[0], sampling_params=GREEDY, lora_path="a")
    finally:
        engine.shutdown()


def test_the_digest_is_every_ranks(folders):
    """The hierarchical cache keys an adapter's storage pages by its digest: the whole weights'."""
    from radixengine.lora.lora_adapter import LoRAAdapter, ModuleShape, read_adapter_tensors
    from radixengine.lora.lora_config import LoRAConfig

    config = LoRAConfig.from_folder(folders["a"])
    tensors = read_adapter_tensors(folders["a"])
    whole = {(layer, "o_proj"): ModuleShape(64, (64,)) for layer in range(2)}
    whole.update({(layer, "qkv_proj"): ModuleShape(64, (64, 32, 32)) for layer in range(2)})
    whole.update({(layer, "gate_up_proj"): ModuleShape(64, (128, 128)) for layer in range(2)})
    whole.update({(layer, "down_proj"): ModuleShape(128, (64,)) for layer in range(2)})
    one = LoRAAdapter.from_tensors(config, tensors, whole, torch.float32)
    for rank in range(2):
        sliced = {
            key: ModuleShape(
                s.in_features,
                s.out_sizes,
                in_range=(rank * s.in_features // 2, s.in_features // 2)
                if key[1] in ("o_proj", "down_proj")
                else None,
                out_ranges=None
                if key[1] in ("o_proj", "down_proj")
                else tuple((rank * n // 2, n // 2) for n in s.out_sizes),
            )
            for key, s in whole.items()
        }
        part = LoRAAdapter.from_tensors(config, tensors, sliced, torch.float32)
        assert part.digest == one.digest
        a, b = part.weights[(0, "qkv_proj")]
        whole_a, whole_b = one.weights[(0, "qkv_proj")]
        assert torch.equal(a, whole_a)
        k_rows = slice(64 + rank * 16, 64 + rank * 16 + 16)
        assert torch.equal(b[..., 32:48], whole_b[..., k_rows])  # this rank's k heads
        a, b = part.weights[(1, "down_proj")]
        assert torch.equal(a, one.weights[(1, "down_proj")][0][..., rank * 64 : rank * 64 + 64])
