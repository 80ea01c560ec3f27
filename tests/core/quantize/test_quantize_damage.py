"""Quantized output never hides damage: NaN/Inf weights, `--quantize-ignore` patterns that keep nothing or
everything, and the dtype of what stays unquantized.

The checkpoints are real FSDP2 rank files (dims multiples of 128): one with a parameter diverged after the
training step (`DemoSpec.nonfinite_param`: a NaN, a +Inf and a -Inf), one whose config.json says float32.
Expected values come from the trained model saved beside them (`reference/`, save_pretrained), transformers'
own quantized loaders and compressed-tensors.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch

from helpers import assert_refused
from quantized_checks import (assert_decodes_within_bound, assert_packed_as_compressed_tensors, folder_tensors,
                              load_dequantized, nonfinite_values)
from weights import load_folder

pytest.importorskip("compressed_tensors", reason="the quantize extra (compressed-tensors) is not installed")

DIVERGED = "model.layers.1.mlp.up_proj.weight"
QUANTIZABLE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2)


@pytest.fixture(scope="session")
def damaged(tmp_path_factory):
    """{"diverged": ..., "fp32": ...}: both written by one start of the rank processes."""
    from ckptflow.testing.demo_checkpoint import DemoSpec, write_demo_checkpoints

    specs = {"diverged": DemoSpec(nonfinite_param=DIVERGED, **QUANTIZABLE),
             "fp32": DemoSpec(config_dtype="float32", **QUANTIZABLE)}
    folders = {name: tmp_path_factory.mktemp(f"quant-{name}") for name in specs}
    written = write_demo_checkpoints({folders[name]: spec for name, spec in specs.items()})
    return {name: written[folders[name]] for name in specs}


def trained_counts(ckpt) -> dict[str, int]:
    """NaN/+Inf/-Inf of the diverged parameter in the model that was trained and saved (not in our output)."""
    values = load_folder(ckpt.reference_dir)[DIVERGED].numpy()
    return {"nan": int(np.isnan(values).sum()), "+inf": int(np.isposinf(values).sum()),
            "-inf": int(np.isneginf(values).sum())}


def ignore_list(folder) -> list[str]:
    config = json.loads((folder / "config.json").read_text())["quantization_config"]
    return config.get("ignore") or config.get("modules_to_not_convert")


@pytest.mark.parametrize("scheme", ["w8a16", "fp8-block"])
def test_nonfinite_weights_are_refused_by_default_under_quantize(cli, damaged, tmp_path, scheme):
    """With --quantize, NaN/Inf are refused unless --on-nonfinite says otherwise: one line naming the tensor and the
    fix, exit 2, nothing written (was: published quantized, a NaN scale or clamped blocks)."""
    assert trained_counts(damaged["diverged"]) == {"nan": 1, "+inf": 1, "-inf": 1}
    target = tmp_path / "model"
    result = cli("merge", "--local-dir", damaged["diverged"].role_dir, "--target-dir", target, "--quantize", scheme)
    assert_refused(result, target, DIVERGED, "1 NaN, 1 +Inf, 1 -Inf", "--on-nonfinite warn")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("scheme", ["w8a16", "fp8-block"])
def test_with_warn_they_are_published_unquantized_listed_and_counted(cli, damaged, tmp_path, scheme):
    """`--on-nonfinite warn`: the diverged weight is published as trained (bf16, its NaN/Inf in place), in the
    config's ignore list, with no scale of its own; the warning's counts are what transformers' loader finds in the
    published model (was: 128 NaNs decoded from one NaN group scale under w8a16; under fp8-block the Inf clamped to
    448 and its block's finite values zeroed); `verify` passes; no numpy RuntimeWarning on the way."""
    ckpt, target = damaged["diverged"], tmp_path / "model"
    expected = trained_counts(ckpt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merged = cli("merge", "--local-dir", ckpt.role_dir, "--target-dir", target, "--quantize", scheme,
                     "--on-nonfinite", "warn")
        verified = cli("verify", target)
    assert merged.exit_code == 0, merged.output
    assert verified.exit_code == 0, verified.output
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []
    assert f"warning: {DIVERGED}: 1 NaN, 1 +Inf, 1 -Inf" in merged.stderr

    module = DIVERGED.removesuffix(".weight")
    published, trained = folder_tensors(target), load_folder(ckpt.reference_dir)[DIVERGED]
    assert published[DIVERGED].dtype == torch.bfloat16
    torch.testing.assert_close(published[DIVERGED], trained.to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)
    assert not [name for name in published if name.startswith(f"{module}.") and name != DIVERGED]
    assert module in ignore_list(target)
    assert "model.layers.1.mlp.down_proj" not in ignore_list(target)  # its neighbours are still quantized

    model, info = load_dequantized(target)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert nonfinite_values(model) == sum(expected.values()) == 3


def test_a_quantize_ignore_pattern_matching_no_module_is_refused(cli, demo, tmp_path):
    """A typo (`layer` for `layers`) keeps nothing unquantized: refused naming the pattern, before any work (was: a
    fully quantized model, the pattern silently unused)."""
    target = tmp_path / "model"
    result = cli("merge", "--local-dir", demo("quant-dense-tied").run_root, "--target-dir", target,
                 "--quantize", "w4a16", "--quantize-ignore", "*.layers.1.*", "--quantize-ignore", "*.layer.0.*")
    assert_refused(result, target, "--quantize-ignore '*.layer.0.*' matches no module", "model.layers.0.")
    assert list(tmp_path.iterdir()) == []


def test_a_quantize_ignore_leaving_nothing_to_quantize_is_refused(cli, demo, tmp_path):
    """`--quantize-ignore '*'` leaves only plain weights: refused naming the pattern (was: a quantized config over
    plain weights)."""
    target = tmp_path / "model"
    result = cli("merge", "--local-dir", demo("quant-dense-tied").run_root, "--target-dir", target,
                 "--quantize", "fp8-block", "--quantize-ignore", "*")
    assert_refused(result, target, "--quantize-ignore '*' leaves no weight", "--quantize fp8-block")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("scheme", ["w4a16", "fp8-block"])
def test_auto_dtype_under_quantize_writes_what_stays_unquantized_in_bf16(cli, damaged, tmp_path, scheme):
    """A float32 checkpoint with --quantize and --dtype auto: embeddings, lm_head, norms (and the int schemes' scales,
    which compressed-tensors ships in the model dtype) are the trained tensors in bf16 and config.json says
    bfloat16 (was: float32, twice the bytes); transformers' loader builds it with no key missing. `--dtype fp32`
    still decides: the same tensors in float32."""
    ckpt = damaged["fp32"]
    trained = load_folder(ckpt.reference_dir)
    assert {tensor.dtype for tensor in trained.values()} == {torch.float32}
    assert json.loads((ckpt.role_dir / "huggingface" / "config.json").read_text())["dtype"] == "float32"
    for dtype, flags in ((torch.bfloat16, ()), (torch.float32, ("--dtype", "fp32"))):
        target = tmp_path / str(dtype)
        result = cli("merge", "--local-dir", ckpt.role_dir, "--target-dir", target, "--quantize", scheme, *flags)
        assert result.exit_code == 0, result.output
        assert assert_decodes_within_bound(target, trained, scheme, dtype) == 2 * 7  # the rest: trained, in `dtype`
        published = folder_tensors(target)
        for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
            assert published[name].dtype == dtype, name
        if scheme == "w4a16":
            assert {t.dtype for n, t in published.items() if n.endswith(".weight_scale")} == {dtype}
            assert assert_packed_as_compressed_tensors(target, trained, scheme) == 2 * 7
        assert json.loads((target / "config.json").read_text())["dtype"] == str(dtype).removeprefix("torch.")
        model, info = load_dequantized(target)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        assert model.model.embed_tokens.weight.dtype == dtype
