"""Quantized export (`--quantize`) of real FSDP2 checkpoints (dense tied and Qwen3-MoE, dims multiples of 128).

Expected values come from elsewhere: the trained model's own fp32 tensors (`reference/`, save_pretrained), torch's
float8 cast, compressed-tensors' own quantize-and-pack compressor, and transformers' quantized loaders.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from mergecore.api import merge_checkpoint
from mergecore.errors import CheckpointError, VerificationError
from mergecore.engine.merge import prepare
from mergecore.proofs.verify import reference_checks, verify_round_trip
from mergecore.quantize.kernels import fp8_codes
from mergecore.targets.output import MANIFEST_FILE

ct = pytest.importorskip("compressed_tensors", reason="the quantize extra (compressed-tensors) is not installed")

SCHEMES = ("fp8-block", "w8a16", "w4a16")
MODELS = ("quant-dense-tied", "quant-moe")


@pytest.fixture(scope="session")
def quantized(demo, tmp_path_factory):
    """{(model, scheme): merged folder}, each merged once, in 128-row bands (the budget holds one band)."""
    root = tmp_path_factory.mktemp("quantized")
    made = {}
    for model in MODELS:
        for scheme in SCHEMES:
            made[model, scheme] = root / f"{model}-{scheme}"
            merge_checkpoint(str(demo(model).run_root), made[model, scheme], quantize=scheme,
                             chunk_bytes=128 * 128 * 4 * 3)
    return made


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a folder, read by safetensors itself."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def test_fp8_codes_are_torchs_float8_cast():
    rng = np.random.default_rng(0)
    x = np.clip(rng.standard_normal(1 << 18).astype(np.float32) * np.float32(10.0) ** rng.uniform(-5, 2.7, 1 << 18),
                -448, 448).astype(np.float32)
    x[:4] = [0.0, -0.0, 448.0, 2.0 ** -10]  # zeros, the largest value, a tie below the smallest subnormal
    expected = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert np.array_equal(fp8_codes(x), expected)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_each_weight_decodes_within_the_scheme_bound_of_the_trained_model(quantized, demo, model, scheme):
    """Decoded independently (torch's float8, compressed-tensors' unpack): quantized weights lie within the bound of
    the trained fp32 tensors, every other tensor is the trained one cast to bf16, and no tensor is missing."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    ours, trained = tensors(quantized[model, scheme]), tensors(demo(model).reference_dir)
    quantized_names = 0
    for name, weight in trained.items():
        module = name.removesuffix(".weight")
        if scheme == "fp8-block" and f"{module}.weight_scale_inv" in ours:
            scale = ours[f"{module}.weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
            decoded = ours[name].float() * scale
            bound = weight.abs() * 2.0 ** -4 + scale * 2.0 ** -10
        elif f"{module}.weight_packed" in ours:
            bits = int(scheme[1])
            assert ours[f"{module}.weight_shape"].tolist() == list(weight.shape)
            q = unpack_from_int32(ours[f"{module}.weight_packed"], bits, weight.shape)
            scale = ours[f"{module}.weight_scale"].float().repeat_interleave(128, 1)
            decoded = q.float() * scale
            bound = scale * (0.5 + 2 ** bits * 2.0 ** -9)
        else:
            if name == "lm_head.weight" and name not in ours:  # tied: stored once, as the embedding
                name = "model.embed_tokens.weight"
            assert torch.equal(ours[name], weight.to(torch.bfloat16)), name
            continue
        quantized_names += 1
        assert ((decoded - weight).abs() <= bound).all(), name
    per_layer = {"quant-dense-tied": 7, "quant-moe": 4 + 3 * 4}[model]  # attention 4 + mlp 3 (or 3 per expert, 4 experts)
    assert quantized_names == 2 * per_layer


@pytest.mark.parametrize("scheme", ("w8a16", "w4a16"))
@pytest.mark.parametrize("model", MODELS)
def test_int_formats_are_compressed_tensors_own(quantized, demo, model, scheme):
    """compressed-tensors quantizes and packs the trained weights with the written scales: the packed int32 words
    are bit for bit ours; its scales (fp32, from the group min/max) rounded to bf16 are ours; its config parses ours."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    folder = quantized[model, scheme]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    args = parsed.config_groups["group_0"].weights
    assert (args.num_bits, args.group_size, args.symmetric) == (int(scheme[1]), 128, True)
    assert parsed.format == "pack-quantized" and parsed.quantization_status == "compressed"
    ours, trained = tensors(folder), tensors(demo(model).reference_dir)
    scheme_ct = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**args.model_dump()))
    compared = 0
    for name in [n for n in ours if n.endswith(".weight_packed")]:
        module = name.removesuffix(".weight_packed")
        weight = trained[f"{module}.weight"]
        groups = weight.reshape(weight.shape[0], -1, 128)
        scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
        assert torch.equal(ours[f"{module}.weight_scale"], scale.to(torch.bfloat16)), module
        packed = PackedQuantizationCompressor.compress({"weight": weight, "weight_scale": scale.to(torch.bfloat16).float()},
                                                       scheme_ct)
        assert torch.equal(ours[name], packed["weight_packed"]), module
        assert ours[f"{module}.weight_shape"].tolist() == packed["weight_shape"].tolist()
        compared += 1
    assert compared


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_transformers_loads_it_and_its_logits_stay_close(quantized, demo, model, scheme):
    """transformers' own loader (FineGrainedFP8Config / CompressedTensorsConfig, dequantize=True) finds every key,
    and the logits against the trained model stay within the scheme's mean-KL threshold."""
    [result] = reference_checks(quantized[model, scheme], demo(model).reference_dir)
    assert result["ok"] and result["check"] == "logits (quantized)"
    assert result["mean_kl"] <= result["kl_max"] and result["top1_agreement"] > 0.5


def test_config_manifest_and_card_say_what_was_quantized(quantized):
    folder = quantized["quant-moe", "fp8-block"]
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert config == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                      "weight_block_size": [128, 128], "modules_to_not_convert": [
                          "model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "lm_head"]}
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["quantization"]["scheme"] == "fp8-block" and manifest["quantization"]["quantized"] == 32
    [trip] = [c for c in manifest["verification"] if c["check"] == "round-trip"]
    assert trip["scheme"] == "fp8-block" and 0 < trip["max_error_vs_bound"] <= 1
    card = (folder / "README.md").read_text()
    assert "| quantization | fp8-block: 32 decoder Linear weights |" in card and "`model.layers.0.mlp.gate`" in card


def test_the_round_trip_catches_one_changed_packed_word(quantized, demo, tmp_path):
    """A quantized output that is not the quantization of the checkpoint fails the proof."""
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(quantized["quant-dense-tied", "w4a16"], folder)
    prepared = prepare(str(demo("quant-dense-tied").run_root), quantize="w4a16")
    target = "model.layers.1.mlp.down_proj.weight_packed"
    entry = next(t for t in prepared.plan.tensors if t.name == target)
    path = folder / entry.file
    data = bytearray(path.read_bytes())
    offset = int.from_bytes(data[:8], "little") + 8 + entry.begin + 4 * 37
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(VerificationError, match="down_proj.*weight_packed rows 0..128 is not the quantization"):
        verify_round_trip(prepared.source, folder, prepared.plan.aliases, plan=prepared.plan)


def test_max_shard_size_counts_quantized_bytes(demo, tmp_path):
    """Files are packed by the bytes written (int4 words, bf16 scales, int64 shapes), not by the bf16 size of the
    weights: the index's total is that count over the trained model's tensors, and no file exceeds the limit."""
    limit = 300_000
    merge_checkpoint(str(demo("quant-moe").run_root), tmp_path / "out", quantize="w4a16", max_shard_size=limit)
    expected = 0
    for name, weight in tensors(demo("quant-moe").reference_dir).items():
        out, inp = weight.shape if weight.ndim == 2 else (0, 0)
        quantized = ".layers." in name and weight.ndim == 2 and not name.endswith("mlp.gate.weight")
        expected += out * inp // 2 + out * inp // 128 * 2 + 2 * 8 if quantized else weight.numel() * 2
    sizes = []
    for file in sorted((tmp_path / "out").glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            sizes.append(sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in f.keys()))
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(sizes) == expected
    assert len(sizes) > 1 and all(size <= limit for size in sizes), sizes


@pytest.mark.parametrize("scheme, fixture, message", [
    ("int3", "quant-moe", "unknown --quantize 'int3': use fp8-block, w8a16 or w4a16"),
    ("fp8-block", "fsdp2-w2", "is not a multiple of 128x128, which fp8-block needs"),
    ("w4a16", "fsdp2-w2", "input columns are not a multiple of the group size 128"),
])
def test_a_bad_quantize_option_is_one_line_and_writes_nothing(demo, tmp_path, scheme, fixture, message):
    with pytest.raises(CheckpointError, match=message) as caught:
        merge_checkpoint(str(demo(fixture).run_root), tmp_path / "out", quantize=scheme)
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()
    assert not any(tmp_path.iterdir())


def test_a_quantized_merge_imports_no_torch_nor_compressed_tensors(demo, quantized, tmp_path):
    """The kernels are numpy: a quantized merge of a dense model (its config check's answer cached by the session's
    first merge; MoE's Hub-layout view asks transformers itself) starts without torch, transformers or compressed-tensors (whose import alone takes ~4 s here: it pulls transformers)."""
    import os
    import subprocess
    import sys

    code = ("import json, sys\n"
            "from mergecore import merge_checkpoint\n"
            f"merge_checkpoint({str(demo('quant-dense-tied').run_root)!r}, {str(tmp_path / 'out')!r}, quantize='w4a16')\n"
            "print(json.dumps(sorted(m for m in ('torch', 'ml_dtypes', 'transformers', 'compressed_tensors') "
            "if m in sys.modules)))\n")
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
