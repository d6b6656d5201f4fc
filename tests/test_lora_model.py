"""LoRA at the model level: a batch mixing adapters and the base model gives each request the
logits of transformers + peft with its adapter (the delta after each fused linear)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from lora_utils import peft_model, save_random_adapter
from model_utils import ModelDriver, assert_close_rel, hf_last_logits, make_runner, save_tiny_model

from radixengine.lora.lora_config import LoRALoadError


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    hf = save_tiny_model("llama", base, seed=3)
    adapters = {
        "all8": save_random_adapter(base, root / "all8", seed=1, r=8),
        "qv4rs": save_random_adapter(
            base, root / "qv4rs", seed=2, r=4, alpha=8, target_modules=("q_proj", "v_proj"), use_rslora=True
        ),
        "mlp16": save_random_adapter(
            base,
            root / "mlp16",
            seed=3,
            r=16,
            target_modules=("gate_proj", "down_proj", "o_proj"),
            safe_serialization=False,
        ),
    }
    return root, base, hf, adapters


def _runner(base, adapters, page_size=1, **kwargs):
    paths = [f"{name}={path}" for name, path in adapters.items()]
    return make_runner(base, page_size, lora_paths=paths, max_loras_per_batch=3, **kwargs)


def _ids(runner) -> dict[str, str]:
    return {ref_id.split("-", 2)[2]: ref_id for ref_id in runner.lora_manager.adapters}


@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batch_matches_peft(setup, page_size):
    _, base, hf, adapters = setup
    runner = _runner(base, adapters, page_size)
    ids = _ids(runner)
    rng = random.Random(5)
    prompts = {
        rid: [rng.randrange(256) for _ in range(n)] for rid, n in zip(["b", "a", "q", "m"], [9, 21, 4, 13])
    }
    which = {"a": "all8", "q": "qv4rs", "m": "mlp16"}
    driver = ModelDriver(runner, {rid: ids[name] for rid, name in which.items()})
    refs = {name: peft_model(base, path) for name, path in adapters.items()}
    logits = driver.extend(prompts)
    for i, rid in enumerate(prompts):
        model = refs[which[rid]] if rid in which else hf
        assert_close_rel(logits[i], hf_last_logits(model, driver.reqs[rid].tokens))
    # The adapters change the output (else this test could not fail).
    assert not torch.allclose(logits[1], hf_last_logits(hf, driver.reqs["a"].tokens), atol=1e-3)
    for _ in range(3):
        nxt = {rid: int(torch.argmax(logits[i])) for i, rid in enumerate(prompts)}
        logits = driver.decode(nxt)
        for i, rid in enumerate(prompts):
            model = refs[which[rid]] if rid in which else hf
            assert_close_rel(logits[i], hf_last_logits(model, driver.reqs[rid].tokens))


def test_slots_are_reused_by_lru(setup):
    _, base, hf, adapters = setup
    runner = make_runner(base, lora_paths=[f"{n}={p}" for n, p in adapters.items()], max_loras_per_batch=1)
    ids = _ids(runner)
    pool = runner.lora_manager.pool
    prompt = list(range(5, 17))
    for name in ["all8", "mlp16", "all8"]:
        driver = ModelDriver(runner, {"x": ids[name]})
        logits = driver.extend({"x": prompt})
        assert pool.slot_of == {ids[name]: 1}
        assert_close_rel(logits[0], hf_last_logits(peft_model(base, adapters[name]), prompt))
        driver.free("x")


def _write_adapter(folder, config: dict, tensors: dict | None = None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    if tensors is not None:
        from safetensors.torch import save_file

        save_file(tensors, folder / "adapter_model.safetensors")
    return folder


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"r": 4, "target_modules": ["q_proj"], "use_dora": True}, "use_dora"),
        ({"r": 4, "target_modules": ["q_proj"], "bias": "all"}, "bias='all'"),
        ({"r": 4, "target_modules": ["embed_tokens", "q_proj"]}, "['embed_tokens']"),
        ({"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"r": 128, "target_modules": ["q_proj"]}, "exceeds --max-lora-rank 16"),
    ],
)
def test_unsupported_adapters_are_refused_naming_why(setup, tmp_path, config, needle):
    _, base, _, _ = setup
    runner = make_runner(base, enable_lora=True, max_lora_rank=16)
    folder = _write_adapter(tmp_path / "bad", {"peft_type": "LORA", **config}, {})
    with pytest.raises(LoRALoadError, match=r".*" + __import__("re").escape(needle)):
        runner.lora_manager.load_adapter("x", str(folder))


def test_adapter_of_another_base_is_refused_naming_shapes(setup, tmp_path):
    _, base, _, _ = setup
    runner = make_runner(base, enable_lora=True, max_lora_rank=16)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{prefix}.lora_A.weight": torch.zeros(4, 96), f"{prefix}.lora_B.weight": torch.zeros(64, 4)}
    folder = _write_adapter(tmp_path / "other", {"r": 4, "target_modules": ["q_proj"]}, tensors)
    with pytest.raises(
        LoRALoadError, match=r"q_proj.lora_A has shape \(4, 96\), the base model needs \(4, 64\)"
    ):
        runner.lora_manager.load_adapter("x", str(folder))


def _decode_logits(runner, lora_ids: dict[str, str], prompts: dict[str, list[int]], steps: int = 4):
    driver = ModelDriver(runner, lora_ids)
    logits = driver.extend(prompts)
    out = [logits]
    for _ in range(steps):
        logits = driver.decode(dict(zip(prompts, logits.argmax(-1).tolist())))
        out.append(logits)
    return out


def test_delta_is_added_after_gguf_block_linears(setup, tmp_path):
    """A GGUF model whose decode runs its linears from the blocks (native kernels) gets the same
    adapter delta as its float path; the adapter changes the output."""
    from gguf_utils import write_llama_gguf

    from radixengine.layers import gguf_quant_ops

    if not gguf_quant_ops.quant_native_available():
        pytest.skip("the native CPU kernels are not built")
    _, base, hf, adapters = setup
    path = write_llama_gguf(tmp_path / "tiny.gguf", hf, qtype=gguf_quant_ops.GGML_Q8_0)
    prompts = {"x": [1, 5, 9, 33, 2, 7, 100], "y": [3, 4, 5]}
    results = {}
    for mode in ("gguf", "none"):
        runner = _runner(path, adapters, quantization=mode)
        blocks = [m for m in runner.model.modules() if getattr(m, "block_weight", None) is not None]
        assert bool(blocks) == (mode == "gguf")
        ids = _ids(runner)
        results[mode] = _decode_logits(runner, {"x": ids["all8"], "y": ids["mlp16"]}, prompts)
    plain = _decode_logits(make_runner(path, quantization="gguf"), {}, prompts)
    for got, ref, base_logits in zip(results["gguf"], results["none"], plain):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(got, base_logits, atol=1e-2)


def test_bf16_model_with_adapters_stays_near_peft(setup):
    """The delta in the model's dtype (bf16 linears: oneDNN or AMX) stays within bf16's error of
    transformers + peft in float32."""
    _, base, hf, adapters = setup
    runner = _runner(base, adapters, dtype="bfloat16")
    ids = _ids(runner)
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1]
    driver = ModelDriver(runner, {"a": ids["all8"], "b": None})
    logits = driver.extend({"a": prompt, "b": prompt})
    ref = hf_last_logits(peft_model(base, adapters["all8"]), prompt)
    assert_close_rel(logits[0].float(), ref, rtol=0.05)
    assert_close_rel(logits[1].float(), hf_last_logits(hf, prompt), rtol=0.05)
    assert not torch.allclose(logits[0].float(), logits[1].float(), atol=0.1)


@pytest.mark.parametrize("native", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "tokens_per_req, gathered",
    [([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], False), ([1] * 20, True), ([2, 3] * 10, True), ([13] * 24, True)],
    ids=["runs", "masked-decode", "masked-extend", "gathered-extend"],
)
def test_delta_equals_per_row_reference(tokens_per_req, gathered, dtype, native):
    """The native kernel (a CPU's small batches) and the torch forms (runs for an extend's
    requests; for a slot of more runs than MAX_RUNS, masked up to MASKED_MAX_ROWS rows, gathered
    above) give each row `x A_s^T B_s` of its own slot, with the slot's rank (the pool's columns
    beyond it are not read); base rows are untouched."""
    from radixengine.layers.attention.native_cpu_ops import native_available
    from radixengine.layers.native_small_ops import native_small_ops
    from radixengine.lora.lora_backend import apply_lora_delta
    from radixengine.lora.lora_batch_info import MAX_RUNS, LoRABatchInfo

    if native and not native_available():
        pytest.skip("the native CPU kernels are not built")
    gen = torch.Generator().manual_seed(0)
    slots_n, rank_max, fin, pieces = 3, 6, 40, (14, 21)
    stack, fout = len(pieces), sum(pieces)
    a = torch.randn(slots_n + 1, rank_max, stack, fin, generator=gen)
    b = torch.zeros(slots_n + 1, rank_max, stack, fout)
    for k, start in enumerate((0, pieces[0])):  # each stacked module's B in its own columns
        b[:, :, k, start : start + pieces[k]] = torch.randn(slots_n + 1, rank_max, pieces[k], generator=gen)
    a, b = a.to(dtype), b.to(dtype)
    ranks = {1: 2, 2: 6, 3: 4}
    slots = [(i * 7) % 4 for i in range(len(tokens_per_req))]
    n = sum(tokens_per_req)
    x, y = torch.randn(n, fin, generator=gen).to(dtype), torch.randn(n, fout, generator=gen).to(dtype)
    info = LoRABatchInfo.build(slots, tokens_per_req, ranks, torch.device("cpu"))
    assert info.scattered == gathered
    assert any(len(seg.runs) > MAX_RUNS for seg in info.segments) == gathered
    expected = y.double()
    row = 0
    for slot, count in zip(slots, tokens_per_req):
        for _ in range(count):
            if slot:
                r = ranks[slot]
                a_s, b_s = a[slot, :r].reshape(-1, fin).double(), b[slot, :r].reshape(-1, fout).double()
                expected[row] += (x[row].double() @ a_s.t()) @ b_s
            row += 1
    with native_small_ops(native):
        got = apply_lora_delta(x, y.clone(), a, b, info, pieces)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.1}
    torch.testing.assert_close(got.double(), expected, check_dtype=False, **tol)
    assert torch.equal(got[[i for i, s in enumerate(_row_slots(slots, tokens_per_req)) if s == 0]],
                       y[[i for i, s in enumerate(_row_slots(slots, tokens_per_req)) if s == 0]])  # fmt: skip


def _row_slots(slots: list[int], tokens_per_req: list[int]) -> list[int]:
    return [s for s, n in zip(slots, tokens_per_req) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pieces", [(37,), (14, 21), (40, 8, 8)], ids=["stack1", "stack2", "stack3"])
def test_native_delta_covers_every_row_tile(pieces, dtype):
    """The native kernel's register tiles (1-8 rows of one slot, a block of 8 and its remainder,
    A rows in fours and the rest, output columns in two vectors, one and a scalar tail) give
    each row `x A_s^T B_s` of its own slot, interleaved slots and all."""
    from radixengine.layers.attention.native_cpu_ops import native_available, require_native
    from radixengine.lora.lora_batch_info import LoRABatchInfo

    if not native_available():
        pytest.skip("the native CPU kernels are not built")
    gen = torch.Generator().manual_seed(1)
    stack, fin, fout, rank_max = len(pieces), 70, sum(pieces), 7
    ranks = {1: 7, 2: 1, 3: 5}
    a = torch.randn(4, rank_max, stack, fin, generator=gen).to(dtype)
    b = torch.randn(4, rank_max, stack, fout, generator=gen).to(dtype)
    slots = [s for count in range(1, 10) for s in (1, 2, 3, 0) for _ in range(count)] + [1] * 17
    x = torch.randn(len(slots), fin, generator=gen).to(dtype)
    y = torch.randn(len(slots), fout, generator=gen).to(dtype)
    info = LoRABatchInfo.build(slots, [1] * len(slots), ranks, torch.device("cpu"))
    expected = y.double()
    for row, slot in enumerate(slots):
        if slot:
            for k, start in enumerate(torch.tensor((0, *pieces)).cumsum(0)[:-1].tolist()):
                a_k, b_k = a[slot, : ranks[slot], k].double(), b[slot, : ranks[slot], k].double()
                expected[row, start : start + pieces[k]] += (x[row].double() @ a_k.t()) @ b_k[
                    :, start : start + pieces[k]
                ]
    got = y.clone()
    require_native().lora_delta(got, x, a, b, info.row_slot, info.rank_of_slot, list(pieces))
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 0.02, "atol": 0.1}
    torch.testing.assert_close(got.double(), expected, check_dtype=False, **tol)
