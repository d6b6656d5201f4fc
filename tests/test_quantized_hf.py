"""AWQ and GPTQ checkpoints: a tiny model's linears quantized and packed here by the formats'
definitions (AutoAWQ's GEMM packing, GPTQ's with g_idx / act-order and its `zero - 1`), loaded
dequantized: every weight equals the quantized value exactly and the logits match transformers
running those values as float weights. Other methods are refused at start, naming them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from model_utils import ModelDriver, assert_close_rel, hf_last_logits, make_runner, save_tiny_model
from safetensors.torch import save_file

from radixengine.model_loader import ModelConfig
from radixengine.model_loader.quantized_checkpoint import _awq_unpack

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: word position i holds column AWQ_ORDER[i]
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def quantize(w: torch.Tensor, groups: torch.Tensor, n_groups: int, bits: int, zero_min: int = 0):
    """Asymmetric min/max quantization of `w` [N, K] by input groups: q [K, N], zeros [G, N]
    (integers, at least `zero_min`) and fp16 scales [G, N]; the float value of (k, n) is
    s[g, n] * (q - z[g, n])."""
    wt = w.t().double()
    index = groups[:, None].expand_as(wt)
    lo = torch.zeros(n_groups, wt.shape[1], dtype=torch.float64).scatter_reduce(0, index, wt, "amin")
    hi = torch.zeros(n_groups, wt.shape[1], dtype=torch.float64).scatter_reduce(0, index, wt, "amax")
    maxq = 2**bits - 1
    scales = ((hi - lo) / maxq).clamp(min=1e-4).half()
    zeros = torch.round(-lo / scales.double()).clamp(zero_min, maxq)
    q = torch.clamp(torch.round(wt / scales.double()[groups]) + zeros[groups], 0, maxq)
    return q.long(), zeros.long(), scales


def float_value(q, zeros, scales, groups) -> torch.Tensor:
    """The quantized weight [N, K] as floats (exact in float32)."""
    return (scales.float()[groups] * (q - zeros[groups]).float()).t().contiguous()


def pack_along_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight: word r of column n holds rows r*32/bits + j at bits j*bits.."""
    per = 32 // bits
    v = values.numpy().astype(np.uint32).reshape(-1, per, values.shape[1])
    words = np.zeros((v.shape[0], v.shape[2]), dtype=np.uint32)
    for j in range(per):
        words |= v[:, j, :] << np.uint32(bits * j)
    return torch.from_numpy(words.view(np.int32))


def pack_along_cols(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Word c of row r holds columns c*32/bits + order[j] at bits j*bits.. (GPTQ's qzeros: the
    natural order; AWQ's qweight and qzeros: AWQ_ORDER)."""
    per = 32 // bits
    order = order or tuple(range(per))
    v = values.numpy().astype(np.uint32).reshape(values.shape[0], -1, per)
    words = np.zeros(v.shape[:2], dtype=np.uint32)
    for j in range(per):
        words |= v[:, :, order[j]] << np.uint32(bits * j)
    return torch.from_numpy(words.view(np.int32))


def write_quantized(hf, folder: Path, ref_folder: Path, method: str, bits: int, group: int, **opts) -> None:
    """`hf`'s layers' linears quantized into `folder` (two shards that split modules' parts, the
    quantization config in config.json or `opts["config_file"]`); `ref_folder` gets the same model
    with the quantized values as float weights."""
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in state if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        prefix, w = name[: -len(".weight")], state.pop(name)
        k = w.shape[1]
        n_groups = -(-k // group) if group > 0 else 1
        groups = torch.arange(k) // (group if group > 0 else k)
        if opts.get("act_order"):  # desc_act: the groups follow a permutation of the inputs
            groups = groups[torch.randperm(k, generator=gen)]
        v1 = method == "gptq" and opts.get("format", "gptq") == "gptq"
        q, zeros, scales = quantize(w, groups, n_groups, bits, zero_min=1 if v1 else 0)  # v1 cannot store 0
        hf.get_submodule(prefix).weight.data.copy_(float_value(q, zeros, scales, groups))
        state[f"{prefix}.scales"] = scales
        if method == "awq":
            state[f"{prefix}.qweight"] = pack_along_cols(q, bits, AWQ_ORDER)
            state[f"{prefix}.qzeros"] = pack_along_cols(zeros, bits, AWQ_ORDER)
            continue
        stored = zeros - 1 if v1 else zeros  # GPTQ's original format stores zero - 1
        state[f"{prefix}.qweight"] = pack_along_rows(q, bits)
        state[f"{prefix}.qzeros"] = pack_along_cols(stored, bits)
        if opts.get("g_idx", True):
            state[f"{prefix}.g_idx"] = groups.int()
        if not hasattr(hf.get_submodule(prefix), "bias") or hf.get_submodule(prefix).bias is None:
            state[f"{prefix}.bias"] = torch.zeros(w.shape[0], dtype=torch.float16)  # AutoGPTQ writes them
    hf.save_pretrained(ref_folder)
    _save_shards(state, folder)
    shutil.copyfile(ref_folder / "config.json", folder / "config.json")
    qconfig = _quant_config(method, bits, group, opts)
    if opts.get("config_file"):
        (folder / opts["config_file"]).write_text(json.dumps(qconfig))
    else:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))


def _quant_config(method: str, bits: int, group: int, opts: dict) -> dict:
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": bits,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
        }
    config = {
        "quant_method": "gptq",
        "bits": bits,
        "group_size": group,
        "desc_act": bool(opts.get("act_order")),
    }
    return {**config, "sym": False, "checkpoint_format": opts.get("format", "gptq")}


def _save_shards(state: dict[str, torch.Tensor], folder: Path) -> None:
    folder.mkdir()
    names = sorted(state)
    weight_map = {}
    for i in range(2):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        part = {n: state[n].contiguous() for n in names[i::2]}
        save_file(part, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def check_loads_exactly(hf, quant_folder: Path, ref_folder: Path) -> None:
    ours, ref = make_runner(quant_folder), make_runner(ref_folder)
    ref_params = dict(ref.model.named_parameters())
    for name, param in ours.model.named_parameters():
        assert torch.equal(param, ref_params[name]), name
    logits = ModelDriver(ours).extend({"r": PROMPT})[0]
    assert_close_rel(logits, hf_last_logits(hf, PROMPT))


def test_awq_word_order():
    """AutoAWQ packs columns 0..7 of a word at nibbles 0 2 4 6 1 3 5 7: 0x75316420 is 0..7."""
    assert _awq_unpack(torch.tensor([[0x75316420]], dtype=torch.int32)).tolist() == [list(range(8))]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases beside the packed weights
def test_awq_checkpoint_loads_its_quantized_values(tmp_path, arch):
    hf = save_tiny_model(arch, tmp_path / "orig")
    write_quantized(hf, tmp_path / "awq", tmp_path / "ref", "awq", 4, 32)
    assert ModelConfig(str(tmp_path / "awq")).quant_config.method == "awq"
    check_loads_exactly(hf, tmp_path / "awq", tmp_path / "ref")


@pytest.mark.parametrize(
    "bits,group,opts",
    [
        (4, 32, {"act_order": True}),  # desc_act: g_idx a permutation of the groups
        (4, 32, {"g_idx": False, "config_file": "quantize_config.json"}),  # AutoGPTQ's own file, k // G
        (8, -1, {"format": "gptq_v2"}),  # zeros stored as they are; one group per row
        (2, 16, {}),
    ],
)
def test_gptq_checkpoint_loads_its_quantized_values(tmp_path, bits, group, opts):
    hf = save_tiny_model("llama", tmp_path / "orig")
    write_quantized(hf, tmp_path / "gptq", tmp_path / "ref", "gptq", bits, group, **opts)
    check_loads_exactly(hf, tmp_path / "gptq", tmp_path / "ref")


@pytest.mark.parametrize(
    "qconfig,named",
    [
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "'fp8'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "'bitsandbytes'"),
        ({"quant_method": "compressed-tensors"}, "'compressed-tensors'"),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
            "'awq' (4-bit, version gemv",
        ),
        ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "'gptq' (3-bit"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'gptq' (4-bit, format marlin"),
    ],
)
def test_other_quantizations_are_refused_at_start(tmp_path, qconfig, named):
    save_tiny_model("llama", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    with pytest.raises(ValueError, match="quantization method " + named.replace("(", r"\(")) as err:
        make_runner(tmp_path)
    assert "is not supported" in str(err.value) and "awq" in str(err.value) and "gptq" in str(err.value)


def test_packed_weights_without_a_quantization_config_are_named(tmp_path):
    hf = save_tiny_model("llama", tmp_path / "orig")
    write_quantized(hf, tmp_path / "gptq", tmp_path / "ref", "gptq", 4, 32)
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"\.(qweight|qzeros|g_idx) is part of a packed quantized weight.*no quantization_config",
    ):
        make_runner(tmp_path / "gptq")
