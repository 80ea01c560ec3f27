"""Checks of a quantized folder against the model's own tensors, decoded by third-party code (torch's float8,
compressed-tensors' unpacker and packer), shared by the tests of every input format.

>>> quantized = assert_decodes_within_bound(folder, trained, "w4a16", torch.bfloat16)  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open


def folder_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder, read by safetensors itself."""
    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def assert_decodes_within_bound(folder: Path, trained: dict[str, torch.Tensor], scheme: str, dtype: torch.dtype) -> int:
    """Each quantized weight of `folder` decodes within `scheme`'s bound of the trained (fp32) tensor; every other
    tensor is the trained one cast to `dtype`; no trained tensor is missing and none is added. Returns how many
    weights were quantized."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    ours, seen, quantized = folder_tensors(folder), set(), 0
    for name, weight in trained.items():
        module, weight = name.removesuffix(".weight"), weight.float()
        if scheme == "fp8-block" and f"{module}.weight_scale_inv" in ours:
            scale = ours[f"{module}.weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
            decoded = ours[name].float() * scale
            bound = weight.abs() * 2.0 ** -4 + scale * 2.0 ** -10
            seen.update({name, f"{module}.weight_scale_inv"})
        elif f"{module}.weight_packed" in ours:
            bits = int(scheme[1])
            assert ours[f"{module}.weight_shape"].tolist() == list(weight.shape), name
            q = unpack_from_int32(ours[f"{module}.weight_packed"], bits, weight.shape)
            scale = ours[f"{module}.weight_scale"].float().repeat_interleave(128, 1)
            decoded = q.float() * scale
            bound = scale * (0.5 + 2 ** bits * 2.0 ** -9)
            seen.update(f"{module}.{part}" for part in ("weight_packed", "weight_scale", "weight_shape"))
        else:
            if name == "lm_head.weight" and name not in ours:  # tied: stored once, as the embedding
                name = "model.embed_tokens.weight"
            assert ours[name].dtype == dtype and torch.equal(ours[name], weight.to(dtype)), name
            seen.add(name)
            continue
        quantized += 1
        # float32 slack: the fused LoRA weight may differ from peft's by an ulp
        assert ((decoded - weight).abs() <= bound + weight.abs() * 2.0 ** -22).all(), name
    assert set(ours) == seen, sorted(set(ours) - seen)
    return quantized


def assert_packed_as_compressed_tensors(folder: Path, trained: dict[str, torch.Tensor], scheme: str) -> int:
    """compressed-tensors computes the scales (`calculate_qparams`, fp32, rounded to the folder's scale dtype) and
    quantizes and packs the trained weights (`PackedQuantizationCompressor`): bit for bit the folder's tensors.
    Returns how many weights were compared."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=int(scheme[1]), type="int", symmetric=True, strategy="group", group_size=128)
    ct_scheme = QuantizationScheme(targets=["Linear"], weights=args)
    ours, compared = folder_tensors(folder), 0
    for name in [n for n in ours if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        weight = trained[f"{module}.weight"].float()
        groups = weight.reshape(weight.shape[0], -1, 128)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        stored = scale.to(ours[f"{module}.weight_scale"].dtype)
        assert torch.equal(ours[f"{module}.weight_scale"], stored), module
        packed = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": stored.float()}, ct_scheme)
        assert torch.equal(ours[name], packed["weight_packed"]), module
        assert ours[f"{module}.weight_shape"].tolist() == packed["weight_shape"].tolist()
        compared += 1
    return compared


def load_dequantized(folder: Path):
    """The quantized `folder` as transformers' own loader builds it (FineGrainedFP8Config / CompressedTensorsConfig,
    dequantize=True: what any machine without the kernels serves); returns (model, transformers' loading info)."""
    import json

    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    method = json.loads((Path(folder) / "config.json").read_text())["quantization_config"]["quant_method"]
    loader = FineGrainedFP8Config(dequantize=True) if method == "fp8" else CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(folder, quantization_config=loader, output_loading_info=True)


def nonfinite_values(model) -> int:
    """NaN and Inf values in a loaded model's parameters: what serving it computes with."""
    return sum(int((~torch.isfinite(p.float())).sum()) for p in model.state_dict().values() if p.is_floating_point())
