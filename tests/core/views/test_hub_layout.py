"""Checkpoints holding transformers 5's in-memory layout come out in the Hub's layout (what save_pretrained writes).

The fixture is a tiny Qwen3-MoE trained one step under real FSDP2 on 2 gloo ranks and saved as verl saves it:
its rank files hold the packed experts `mlp.experts.gate_up_proj [E, 2I, H]`; `reference/` is save_pretrained
of the same trained model (per-expert `mlp.experts.N.{gate,up,down}_proj.weight`).
"""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from mergecore import compare_logits, merge_checkpoint, open_checkpoint
from mergecore.formats.fsdp import load_rank_file
from weights import assert_cast_of, load_folder


@pytest.fixture(scope="session")
def moe(demo):
    return demo("qwen3_moe")


def test_rank_files_hold_packed_experts(moe):
    """The premise: verl's FSDP files hold the in-memory (packed) layout, not the Hub's."""
    state = load_rank_file(str(moe.role_dir / "model_world_size_2_rank_0.pt"), "rank 0")
    assert tuple(state["model.layers.0.mlp.experts.gate_up_proj"].shape) == (4, 80, 64)
    assert not any(".experts.0." in name for name in state)


def test_moe_merges_to_save_pretrained_layout(moe, tmp_path):
    out = tmp_path / "out"
    manifest = merge_checkpoint(str(moe.role_dir), out, dtype="keep")
    assert [c["check"] for c in manifest["verification"]] == ["round-trip"]
    weights, reference = load_folder(out), load_folder(moe.reference_dir)
    assert sorted(weights) == sorted(reference)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in weights
    for name, tensor in reference.items():
        assert weights[name].shape == tensor.shape and torch.equal(weights[name], tensor), name
    assert compare_logits(out, moe.reference_dir)["max_abs_diff"] == 0.0


def test_moe_cast_keeps_hub_names_and_bf16_values(moe, tmp_path):
    out = tmp_path / "bf16"
    merge_checkpoint(str(moe.role_dir), out, dtype="bf16", max_shard_size="40KB")
    assert_cast_of(out, moe.reference_dir, torch.bfloat16)


def test_each_expert_is_one_slice_of_the_packed_tensor(moe):
    """Bounded memory: an output tensor is read from the part of each rank's shard it needs."""
    from mergecore.engine.merge import merge_view

    source = merge_view(open_checkpoint(str(moe.role_dir)))  # the saved names are transformers' in-memory ones
    pieces = list(source.pieces("model.layers.0.mlp.experts.3.up_proj.weight"))
    assert [p.sizes for p in pieces] == [(40, 64)]          # expert 3 lives on rank 1 only (Shard(0) of 4 experts)
    assert pieces[0].source.endswith("rank_1.pt")
    with safe_open(str(moe.reference_dir / "model.safetensors"), "pt") as ref:
        want = ref.get_tensor("model.layers.0.mlp.experts.3.up_proj.weight")
    assert torch.equal(torch.from_numpy(source.read("model.layers.0.mlp.experts.3.up_proj.weight")), want)


def test_vlm_names_and_groups_are_the_hub_layout(tmp_path):
    """Qwen2.5-VL: in-memory `model.language_model.*` / `model.visual.*` -> what save_pretrained writes; the
    vision tower gets groups of its own (never the embed or head group)."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mergecore.views.hub_layout import hub_slices
    from mergecore.families.layout import group_of

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=1),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           fullatt_block_indexes=[1]))
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(tmp_path)
    in_memory = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert any(name.startswith("model.language_model.") for name in in_memory)

    slices = hub_slices(config.to_dict(), in_memory)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as saved:
        written = {name: tuple(saved.get_slice(name).get_shape()) for name in saved.keys()}
    assert {name: s.shape for name, s in slices.items()} == written
    assert all(s.is_whole(in_memory[s.source]) for s in slices.values())  # renames only

    groups = {name: group_of(name)[1] for name in written}
    assert groups["visual.blocks.1.attn.qkv.weight"] == "visual.blocks.1"
    assert groups["visual.patch_embed.proj.weight"] == "visual"
    assert groups["model.layers.0.self_attn.q_proj.weight"] == "layers.0"
    assert not any(g in ("embed", "head") for name, g in groups.items() if name.startswith("visual."))


def test_inspect_reports_the_hub_layout(moe):
    from mergecore.describe import describe_checkpoint

    groups = {g["group"]: g for g in describe_checkpoint(str(moe.role_dir))["groups"]}
    assert list(groups) == ["embed", "layers.0", "layers.1", "head"]
    reference = load_folder(moe.reference_dir)
    assert groups["layers.0"]["tensors"] == sum(name.startswith("model.layers.0.") for name in reference)


def test_a_save_that_makes_up_elements_is_refused():
    """Inkling2 pads its head to the padded vocabulary with zero rows on save: elements no saved tensor holds,
    not a rearrangement of them; refused in one line naming the tensor (its interleaved experts are streamed:
    tests/core/families)."""
    from transformers import Inkling2TextConfig

    from mergecore.errors import CheckpointError
    from mergecore.families.meta_model import meta_model
    from mergecore.views.hub_layout import hub_slices

    config = Inkling2TextConfig(
        vocab_size=128, unpadded_vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=16,
        sliding_window_size=8, rel_extent=8, moe_intermediate_size=24, n_routed_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, architectures=["Inkling2ForCausalLM"]).to_dict()
    in_memory = {name: tuple(t.shape) for name, t in meta_model(config).state_dict().items()}
    assert in_memory["lm_head.weight"] == (120, 32)
    with pytest.raises(CheckpointError, match=r"model\.llm\.unembed\.weight in a way ckptflow does not stream"):
        hub_slices(config, in_memory)
