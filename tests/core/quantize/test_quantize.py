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
from mergecore.model.manifest import MANIFEST_FILE

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


def torch_fp8_codes(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def test_fp8_codes_are_torchs_float8_cast():
    """Every float32 whose low 16 bits are one of five patterns (all 2^16 high halves: every exponent, so every
    subnormal range and normal, every tie at every rounding position, zeros, -0.0, values up to 448), and random
    values over 8 decades: the codes are torch's float8 cast, bit for bit. NaN: 0x7F, whatever its sign (torch
    keeps a negative NaN's sign, 0xFF; both are NaN), the other values unchanged by the NaN beside them."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    x = np.concatenate([(high | low).view(np.float32) for low in (0, 1, 0x7FFF, 0x8000, 0xFFFF)])
    x = x[np.abs(x) <= 448]  # callers clamp to the format's range; NaN drops out here too
    rng = np.random.default_rng(0)
    spread = rng.standard_normal(1 << 18).astype(np.float32) * np.float32(10.0) ** rng.uniform(-5, 2.7, 1 << 18)
    x = np.concatenate([x, np.clip(spread, -448, 448).astype(np.float32)])
    assert {0.0, 448.0, -448.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -6 - 2.0 ** -10} <= set(x.tolist())
    assert np.array_equal(fp8_codes(x), torch_fp8_codes(x))
    with_nan = np.concatenate([x[:1000], np.array([np.nan, -np.nan], np.float32)])
    codes = fp8_codes(with_nan)
    assert np.array_equal(codes[:1000], torch_fp8_codes(x[:1000])) and codes[1000:].tolist() == [0x7F, 0x7F]


def test_fp8_blocks_are_torchs_blockwise_cast():
    """`fp8_block_quantize` equals torch doing the format's arithmetic itself (scale = block amax / 448, values =
    float8(clamp(x / scale))) over several sub-bands, with an all-zero block, a block so small its scale is
    subnormal and a block holding NaN and Inf (both take the plain path); `fp8_block_errors` equals the bound
    check done in torch (NaN/Inf left out)."""
    from mergecore.quantize.kernels import fp8_block_errors, fp8_block_quantize

    rng = np.random.default_rng(1)
    rows = (rng.standard_normal((2304, 256)) * 10.0 ** rng.uniform(-4, 1, (2304, 1))).astype(np.float32)
    rows[:128, :128] = 0.0
    rows[128:256, 128:] *= np.float32(1e-37)
    rows[2200, 7], rows[2201, 8] = np.nan, np.inf
    x = torch.from_numpy(rows).reshape(18, 128, 2, 128)
    amax = x.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones(()))
    expected = (x / scale[:, None, :, None]).clamp(-448, 448).reshape(2304, 256)
    codes, scales = fp8_block_quantize(rows)
    assert np.array_equal(scales.view(np.uint32), scale.numpy().view(np.uint32))
    assert np.array_equal(codes, expected.to(torch.float8_e4m3fn).view(torch.uint8).numpy())
    decoded = (torch.from_numpy(codes).view(torch.float8_e4m3fn).float().reshape(18, 128, 2, 128)
               * scale[:, None, :, None]).reshape(2304, 256)
    x = torch.from_numpy(rows)
    error = (decoded - x).abs()
    bound = (x.abs().reshape(18, 128, 2, 128) * np.float32(2.0 ** -4 + 2.0 ** -20)
             + (scale * np.float32(2.0 ** -10))[:, None, :, None]).reshape(2304, 256)
    share = error / bound
    worst, ratio = fp8_block_errors(rows, codes, scales)  # NaN left out; the Inf's error is Inf
    assert worst == error[~error.isnan()].max().item() == float("inf")
    assert ratio == share[~share.isnan()].max().item()
    assert share[256:2176].max().item() < 1  # outside the subnormal-scale and the NaN/Inf blocks


def test_int_groups_over_several_sub_bands_are_compressed_tensors_own():
    """Rows enough for several of the kernel's sub-bands: packed words and bf16 scales are compressed-tensors' own
    quantize-and-pack of the same values, and `int_group_errors` equals the group bound check done in torch."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from mergecore.quantize.kernels import int_group_errors, int_group_quantize

    rows = np.random.default_rng(2).standard_normal((4100, 128)).astype(np.float32) * np.float32(0.02)
    weight = torch.from_numpy(rows)
    for bits in (4, 8):
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group", group_size=128)
        scale, _ = calculate_qparams(weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True), args)
        scale = scale.to(torch.bfloat16)
        packed, scales = int_group_quantize(rows, bits, "bfloat16")
        assert np.array_equal(scales.view(np.uint16), scale.view(torch.uint16).numpy())
        theirs = PackedQuantizationCompressor.compress(
            {"weight": weight, "weight_scale": scale.float()},
            QuantizationScheme(targets=["Linear"], weights=args))["weight_packed"]
        assert np.array_equal(packed, theirs.numpy())
        low = -(1 << (bits - 1))
        q = torch.from_numpy(np.round(np.clip(rows / scale.float().numpy(), low, -low - 1)))
        group_error = (q * scale.float() - weight).abs().amax(-1, keepdim=True)
        amax = weight.abs().amax(-1, keepdim=True)
        bound = scale.float() * np.float32(0.5 + (1 << bits) * 2.0 ** -9) + amax * np.float32(2.0 ** -20)
        worst, ratio = int_group_errors(rows, packed, scales, bits)
        assert worst == group_error.max().item() and ratio == (group_error / bound).max().item() < 1


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
    from helpers import REPO

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
