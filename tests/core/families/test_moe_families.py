"""Qwen2-MoE and Mixtral: packed experts in transformers 5 memory come out in the Hub's per-expert layout,
and config.json is checked against MoE (and vision-language) checkpoints with one-line errors.

Each fixture is a tiny model of the family trained one step under real FSDP2 on 2 gloo ranks and saved as
verl saves it (rank files hold `mlp.experts.gate_up_proj [E, 2I, H]` / `mlp.experts.down_proj`);
`reference/` is save_pretrained of the same trained model, the independent truth for names, shapes and values.

Per-expert experts *in memory*: transformers 5.24 has none for causal LMs. Every decoder MoE family's experts
module is one packed `nn.Module` (75 `*Experts` classes); only the encoder-decoder NLLB-MoE and
Switch Transformers keep an `nn.ModuleDict` of `expert_N` modules, so there is no such FSDP fixture to write.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import copy_run
from mergecore import CheckpointError, compare_logits, merge_checkpoint
from mergecore.formats.fsdp import load_rank_file
from mergecore.describe import describe_checkpoint
from mergecore.families.layout import check_against_config
from weights import assert_cast_of, load_folder
from helpers import assert_refused

# family -> (an expert tensor of the Hub layout, a tensor only that family has, the config's expert-count field)
FAMILIES = {
    "qwen2_moe": ("model.layers.1.mlp.experts.3.up_proj.weight", "model.layers.1.mlp.shared_expert_gate.weight",
                  "num_experts"),
    "mixtral": ("model.layers.1.block_sparse_moe.experts.3.w3.weight", "model.layers.1.block_sparse_moe.gate.weight",
                "num_local_experts"),
}


@pytest.fixture(scope="session", params=list(FAMILIES))
def family(request, demo):
    """(arch, DemoCheckpoint): one real FSDP2 checkpoint per family per session."""
    return request.param, demo(request.param)


def test_rank_files_hold_packed_experts(family):
    """The premise: verl's FSDP files hold transformers 5's packed experts, not the Hub's per-expert names."""
    arch, ckpt = family
    state = load_rank_file(str(ckpt.role_dir / "model_world_size_2_rank_0.pt"), "rank 0")
    assert tuple(state["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 80, 64)
    assert tuple(state["model.layers.0.mlp.experts.down_proj"].shape) == (4, 64, 40)
    assert not any(".experts.0." in name or "block_sparse_moe" in name for name in state)


def test_merge_equals_save_pretrained(family, tmp_path):
    arch, ckpt = family
    expert, special, _ = FAMILIES[arch]
    out = tmp_path / "out"
    manifest = merge_checkpoint(str(ckpt.role_dir), out, dtype="keep")
    assert [c["check"] for c in manifest["verification"]] == ["round-trip"]
    weights, reference = load_folder(out), load_folder(ckpt.reference_dir)
    assert sorted(weights) == sorted(reference)
    assert expert in weights and special in weights
    for name, tensor in reference.items():
        assert weights[name].dtype == tensor.dtype and torch.equal(weights[name], tensor), name
    assert compare_logits(out, ckpt.reference_dir)["max_abs_diff"] == 0.0


def test_bf16_cast_keeps_hub_names(family, tmp_path):
    arch, ckpt = family
    out = tmp_path / "bf16"
    merge_checkpoint(str(ckpt.role_dir), out, dtype="bf16", max_shard_size="40KB")
    assert_cast_of(out, ckpt.reference_dir, torch.bfloat16)


def test_inspect_groups_are_embed_layers_head(family):
    arch, ckpt = family
    groups = {g["group"]: g for g in describe_checkpoint(str(ckpt.role_dir))["groups"]}
    assert list(groups) == ["embed", "layers.0", "layers.1", "head"]
    reference = load_folder(ckpt.reference_dir)
    assert groups["layers.1"]["tensors"] == sum(name.startswith("model.layers.1.") for name in reference)


# ---- config checks ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, names", [
    ("experts", 5, "mlp.gate.weight|block_sparse_moe.gate.weight"),
    ("num_hidden_layers", 3, "num_hidden_layers=3"),
    ("num_attention_heads", 8, "k_proj"),
    ("moe_width", 48, "experts.0."),
])
def test_config_disagreeing_with_moe_checkpoint_is_refused(family, cli, tmp_path, field, value, names):
    arch, original = family
    ckpt = copy_run(original, tmp_path / "run")
    config_path = ckpt.role_dir / "huggingface" / "config.json"
    config = json.loads(config_path.read_text())
    key = {"experts": FAMILIES[arch][2],
           "moe_width": "intermediate_size" if arch == "mixtral" else "moe_intermediate_size"}.get(field, field)
    config[key] = value
    config.pop("layer_types", None)  # a config of another model, consistent in itself (transformers checks that)
    config_path.write_text(json.dumps(config))
    result = cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", tmp_path / "out")
    assert_refused(result, tmp_path / "out", "config.json", "--hf_model_path")
    assert any(part in result.stderr for part in names.split("|")), result.stderr


def test_missing_expert_is_refused(family):
    """Expert parallelism that lost a rank: the layer's expert set is incomplete."""
    arch, ckpt = family
    shapes = {name: tuple(t.shape) for name, t in load_folder(ckpt.reference_dir).items()}
    config = json.loads((ckpt.role_dir / "huggingface" / "config.json").read_text())
    check_against_config(shapes, config, "hf/config.json")  # the real model passes
    expert = FAMILIES[arch][0]
    for part in (".w1.", ".w2.", ".w3.") if arch == "mixtral" else (".gate_proj.", ".up_proj.", ".down_proj."):
        shapes.pop(expert.replace(".w3.", part).replace(".up_proj.", part))
    with pytest.raises(CheckpointError, match=r"decoder layer 1 has experts \[0, 1, 2\]\.\.\. \(3\) but hf/config.json says 4"):
        check_against_config(shapes, config, "hf/config.json")


# ---- vision-language models: the checker on save_pretrained's own files ---------------------------------

def _vlm(tmp_path, family: str):
    """(save_pretrained's names and shapes, config.json) of a tiny Qwen2.5-VL / Qwen3-VL built from a config."""
    import transformers
    from safetensors import safe_open

    text = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, bos_token_id=0, eos_token_id=1)
    vision = dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32)
    if family == "qwen2_5_vl":
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config={**vision, "fullatt_block_indexes": [1]})
        model_class = transformers.Qwen2_5_VLForConditionalGeneration
    else:
        config = transformers.Qwen3VLConfig(text_config={**text, "head_dim": 8}, vision_config={
            **vision, "deepstack_visual_indexes": [1], "num_position_embeddings": 16})
        model_class = transformers.Qwen3VLForConditionalGeneration
    config.architectures = [model_class.__name__]
    model_class(config).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        shapes = {name: tuple(saved.get_slice(name).get_shape()) for name in saved.keys()}
    return shapes, json.loads((tmp_path / "config.json").read_text())


@pytest.mark.parametrize("vlm", ["qwen2_5_vl", "qwen3_vl"])
def test_vlm_config_checks(tmp_path, vlm):
    """Text fields come from text_config, vision depth and sizes from vision_config; the real files pass and
    every edit that disagrees is one line naming config.json and the fix."""
    shapes, config = _vlm(tmp_path, vlm)
    assert any(".blocks.1." in name for name in shapes)
    check_against_config(shapes, config, "hf/config.json")
    edits = [("text_config", "num_hidden_layers", 3, "num_hidden_layers=3"),
             ("text_config", "num_attention_heads", 8, "self_attn."),  # k/v widths (head_dim derived) or q width
             ("vision_config", "depth", 3, "vision_config.depth=3"),
             ("vision_config", "hidden_size", 32, "(vision_"),
             ("vision_config", "num_heads", 3, "vision_config.num_heads=3")]
    for section, field, value, fragment in edits:
        edited = json.loads(json.dumps(config))
        edited[section][field] = value
        with pytest.raises(CheckpointError) as excinfo:
            check_against_config(shapes, edited, "hf/config.json")
        message = str(excinfo.value)
        assert fragment in message and "hf/config.json" in message and "--hf_model_path" in message, message
        assert "\n" not in message
    renamed = {name.replace("visual.merger.", "visual.projector."): shape for name, shape in shapes.items()}
    with pytest.raises(CheckpointError, match=rf"projector\.\S+ is not a {vlm} parameter per hf/config.json"):
        check_against_config(renamed, config, "hf/config.json")
