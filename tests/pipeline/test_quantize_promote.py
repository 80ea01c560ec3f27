"""promote with `quantize` on a real Prefect server: the published folder is the quantized model, proven before
publishing and loaded by transformers' own quantized loader against the trained model; the event and schedule
flows hand `quantize` down to it. Expected values: the trained model's own tensors (reference/, save_pretrained)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from quantized_checks import assert_decodes_within_bound
from weights import load_folder

pytest.importorskip("compressed_tensors", reason="the quantize extra (compressed-tensors) is not installed")


def test_promote_publishes_the_quantized_model_verified(prefect_server, demo, tmp_path):
    """w4a16 with layer 0 kept unquantized: layer 1's seven Linears are packed, each within the bound of the trained
    weight; the rest is the trained model in bf16; the config's ignore list names layer 0; the round trip and
    transformers' loader (logits within the scheme's KL threshold) ran before the folder was published."""
    from ckptflow.flows.promote import promote_checkpoint
    from ckptflow.flows.requests import PromotionRequest

    ckpt = demo("quant-dense-tied")
    target = tmp_path / "model"
    result = promote_checkpoint(PromotionRequest.of(str(ckpt.run_root), str(target), quantize="w4a16",
                                                    quantize_ignore=["*.layers.0.*"], reference=str(ckpt.reference_dir)))
    checks = {c["check"]: c for c in result["checks"]}
    assert checks["round-trip"]["ok"] and checks["round-trip"]["scheme"] == "w4a16"
    assert checks["round-trip"]["quantized"] == 7
    logits = checks["logits (quantized)"]
    assert logits["ok"] and logits["mean_kl"] <= logits["kl_max"]
    assert assert_decodes_within_bound(target, load_folder(ckpt.reference_dir), "w4a16", torch.bfloat16) == 7
    config = json.loads((target / "config.json").read_text())["quantization_config"]
    assert config["format"] == "pack-quantized" and config["config_groups"]["group_0"]["weights"]["num_bits"] == 4
    assert "model.layers.0.self_attn.q_proj" in config["ignore"]
    assert "model.layers.1.mlp.up_proj" not in config["ignore"]


def test_event_and_schedule_flows_pass_quantize_on(prefect_server, demo, tmp_path):
    """promote-on-upload (promote_uploaded) and promote-latest-nightly (promote_latest) take `quantize` and
    `quantize_ignore` in their deployment's `settings`, and the folder they publish is quantized by that scheme."""
    from ckptflow.flows.latest import promote_latest
    from ckptflow.flows.requests import PromotionSettings
    from ckptflow.flows.service import promote_uploaded

    run_root = tmp_path / "ckpts" / "run1"
    shutil.copytree(demo("quant-dense-tied").run_root, run_root, ignore=shutil.ignore_patterns("reference"))
    trained = load_folder(demo("quant-dense-tied").reference_dir)

    uploaded = promote_uploaded(checkpoint=str(run_root / "global_step_1" / "actor"), target_root=str(tmp_path / "up"),
                                checkpoint_root=str(tmp_path / "ckpts"),
                                settings=PromotionSettings(how={"quantize": "fp8-block", "quantize_ignore": ["*.mlp.*"]}),
                                return_state=True)
    assert uploaded.is_completed(), uploaded.message
    folder = tmp_path / "up" / "run1" / "step-1"
    assert assert_decodes_within_bound(folder, trained, "fp8-block", torch.bfloat16) == 2 * 4  # attention only
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"

    latest = promote_latest(run_roots=[str(run_root)], target_root=str(tmp_path / "nightly"),
                            settings=PromotionSettings(how={"quantize": "w8a16"}))
    folder = tmp_path / "nightly" / "run1" / "step-1"
    assert latest["run1"]["promoted"]
    assert assert_decodes_within_bound(folder, trained, "w8a16", torch.bfloat16) == 2 * 7
