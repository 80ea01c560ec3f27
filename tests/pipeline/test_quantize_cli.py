"""`ckptflow merge --quantize` / `--quantize-ignore`, then `ckptflow verify` on the published folder."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

pytest.importorskip("compressed_tensors", reason="the quantize extra (compressed-tensors) is not installed")


def test_merge_quantize_ignore_then_verify(cli, demo, tmp_path):
    """The ignored module stays bf16 and is listed as unquantized; `verify` re-proves the quantized folder from the
    rank files and `--reference` loads it with transformers' FP8 loader."""
    ckpt = demo("quant-dense-tied")
    out = tmp_path / "out"
    result = cli("merge", "--local-dir", ckpt.run_root, "--target-dir", out, "--quantize", "fp8-block",
                 "--quantize-ignore", "*.layers.0.mlp.*")
    assert result.exit_code == 0, result.output
    with safe_open(next(out.glob("*.safetensors")), "pt") as f:
        names = set(f.keys())
        assert str(f.get_tensor("model.layers.0.mlp.up_proj.weight").dtype) == "torch.bfloat16"
        assert str(f.get_tensor("model.layers.1.mlp.up_proj.weight").dtype) == "torch.float8_e4m3fn"
    assert "model.layers.0.mlp.up_proj.weight_scale_inv" not in names
    skip = json.loads((out / "config.json").read_text())["quantization_config"]["modules_to_not_convert"]
    assert "model.layers.0.mlp.up_proj" in skip and "model.layers.1.mlp.up_proj" not in skip
    result = cli("verify", out, "--reference", ckpt.reference_dir)
    assert result.exit_code == 0, result.output
    assert "scheme=fp8-block" in result.stdout and "logits (quantized)" in result.stdout


@pytest.mark.parametrize("fixture, scheme, message", [
    ("quant-dense-tied", "int4", "unknown --quantize 'int4'"),
    ("fsdp2-w2", "fp8-block", "not a multiple of 128x128"),
])
def test_a_bad_quantize_option_exits_2_with_one_line(cli, demo, tmp_path, fixture, scheme, message):
    result = cli("merge", "--local-dir", demo(fixture).run_root, "--target-dir", tmp_path / "out", "--quantize", scheme)
    assert result.exit_code == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error: ")
    assert not (tmp_path / "out").exists()
