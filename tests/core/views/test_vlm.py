"""Vision-language checkpoints (Qwen2.5-VL, Qwen3-VL) merge to what save_pretrained writes and give the trained
model's own logits, on text and on text + image.

Each fixture is a tiny VLM trained one step under real FSDP2 on 2 gloo ranks (decoder layers and vision blocks
their own `fully_shard` units, as verl wraps them) on a batch that shows it an image, saved as verl saves it:
the rank files hold transformers 5's in-memory names (`model.language_model.*`, `model.visual.*`). `reference/`
is save_pretrained of the trained model plus its own forward on fixed inputs (`LOGITS_FILE`).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.tensor  # noqa: F401 - rank files hold DTensors
import transformers

from ckptflow.testing.demo_checkpoint import LOGITS_FILE
from mergecore import compare_logits, merge_checkpoint
from mergecore.formats.fsdp import load_rank_file
from weights import assert_cast_of, load_folder

FAMILIES = {"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration", "qwen3_vl": "Qwen3VLForConditionalGeneration"}
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja",
                   "tokenizer.json", "tokenizer_config.json", "generation_config.json")


@pytest.fixture(scope="session", params=list(FAMILIES))
def vlm(request, demo):
    return demo(request.param)


@pytest.fixture(scope="session")
def merged(vlm, tmp_path_factory):
    out = tmp_path_factory.mktemp("merged") / "out"
    manifest = merge_checkpoint(str(vlm.role_dir), out, dtype="keep")
    return out, manifest


def _config(vlm) -> dict:
    return json.loads((vlm.role_dir / "huggingface" / "config.json").read_text())


def _architecture(vlm) -> str:
    return _config(vlm)["architectures"][0]


def test_rank_files_hold_the_in_memory_layout_and_the_vision_tower_trained(vlm):
    """The premise: verl's rank files hold `model.language_model.*` / `model.visual.*`, and the image batch gave
    the vision blocks and the merger gradients (AdamW's first moment is nonzero for them)."""
    state = load_rank_file(str(vlm.role_dir / "model_world_size_2_rank_0.pt"), "rank 0")
    assert any(name.startswith("model.language_model.layers.") for name in state)
    assert any(name.startswith("model.visual.blocks.1.") for name in state)

    config = transformers.AutoConfig.from_pretrained(vlm.role_dir / "huggingface")
    with torch.device("meta"):
        names = [n for n, _ in getattr(transformers, _architecture(vlm))._from_config(config).named_parameters()]
    moments = {}
    for rank in (0, 1):
        optim = torch.load(vlm.role_dir / f"optim_world_size_2_rank_{rank}.pt", weights_only=False)
        for index, entry in optim["state"].items():
            moments[names[index]] = moments.get(names[index], 0.0) + entry["exp_avg"].to_local().abs().sum().item()
    trained = [n for n in names if n.startswith("model.visual.") and ("merger" in n or ".blocks.0." in n)]
    assert trained and all(moments[n] > 0 for n in trained), [n for n in trained if not moments[n]]


def test_vlm_merges_to_save_pretrained_files(vlm, merged):
    out, manifest = merged
    assert [c["check"] for c in manifest["verification"]] == ["round-trip"]
    weights, reference = load_folder(out), load_folder(vlm.reference_dir)
    assert sorted(weights) == sorted(reference)
    for name, tensor in reference.items():
        assert weights[name].dtype == tensor.dtype and torch.equal(weights[name], tensor), name
    hub_names = {"qwen2_5_vl": ("model.layers.0.self_attn.q_proj.weight", "visual.merger.mlp.0.weight"),
                 # transformers 5.24 saves Qwen3-VL in its in-memory names: no conversion is registered for it
                 "qwen3_vl": ("model.language_model.layers.0.self_attn.q_proj.weight", "model.visual.merger.linear_fc1.weight")}
    assert set(hub_names[_config(vlm)["model_type"]]) <= set(weights)


def test_vlm_cast_to_bf16_keeps_the_names(vlm, tmp_path):
    out = tmp_path / "bf16"
    merge_checkpoint(str(vlm.role_dir), out, dtype="bf16", max_shard_size="100KB")
    assert_cast_of(out, vlm.reference_dir, torch.bfloat16)


def test_merged_vlm_gives_the_trained_models_own_logits_on_text_and_image(vlm, merged):
    out, _ = merged
    own = torch.load(vlm.reference_dir / LOGITS_FILE, weights_only=True)
    model = transformers.AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    assert type(model).__name__ == _architecture(vlm)
    with torch.no_grad():
        text = model(input_ids=own["input_ids"]).logits
        image = model(**own["image_inputs"]).logits
    torch.testing.assert_close(text, own["logits"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(image, own["image_logits"], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(image[0, -1], model(input_ids=own["image_inputs"]["input_ids"]).logits[0, -1],
                              atol=1e-3), "the image must change the logits, or the vision tower went untested"
    assert compare_logits(out, vlm.reference_dir)["max_abs_diff"] == 0.0  # the text check ckptflow runs


def test_processor_files_are_copied_verbatim(vlm, merged):
    out, _ = merged
    for name in PROCESSOR_FILES:
        assert (out / name).read_bytes() == (vlm.role_dir / "huggingface" / name).read_bytes(), name
    assert "<|image_pad|>" in (out / "chat_template.jinja").read_text()


def test_plan_and_inspect_give_the_vision_tower_groups_of_its_own(vlm, merged, cli):
    out, manifest = merged
    from mergecore.describe import describe_checkpoint

    groups = {g["group"]: g["tensors"] for g in describe_checkpoint(str(vlm.role_dir))["groups"]}
    assert list(groups) == ["embed", "layers.0", "layers.1", "head", "visual", "visual.blocks.0", "visual.blocks.1"]
    reference = load_folder(vlm.reference_dir)
    vision = [n for n in reference if ".visual." in f".{n}"]
    blocks = {i: sum(f"visual.blocks.{i}." in n for n in vision) for i in (0, 1)}
    assert (groups["visual.blocks.0"], groups["visual.blocks.1"]) == (blocks[0], blocks[1])
    assert groups["visual"] == len(vision) - blocks[0] - blocks[1]           # patch embed, merger(s), ...
    assert groups["embed"] == 1 and groups["head"] == 2                       # embed_tokens; norm + lm_head
    assert manifest["groups"] == list(groups)                                  # the merge plan's groups

    result = cli("inspect", vlm.role_dir)
    assert result.exit_code == 0, result.output
    assert "visual.blocks.1" in result.output
