"""dist_ckpt folders written by real megatron-core on CPU (gloo): every layout the dist_ckpt reader claims.

TP=1 saves of each model kind (Qwen2-like dense, tied, Llama, Qwen3, Qwen2-MoE-like), then that model
loaded through megatron-core's resharding load and saved again by TP*PP processes at TP=2 and
TP=2×PP=2×VPP=2 (stacked layer keys), tied embeddings at TP=2×PP=2, Qwen3 with per-layer keys and MoE at TP=2;
the old (`actor/dist_ckpt`) and verl 0.9.1 (`actor/model/dist_ckpt`) folder layouts. The merged
Hugging Face model must equal the TP=1 model's own parameters exactly (mapped by the independent table
in mcore_real.py) and give Megatron's own logits (MoE included). Expert parallelism: test_megatron_ep.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mcore_real import (PARALLEL, PARALLEL_IDS, STEP, as_verl091, assert_logits_match, hf_tensors, needs_megatron,
                        parallel_save, tp1_save)
from mergecore import merge_checkpoint, open_checkpoint
from mergecore.formats.megatron.dist import MegatronDistCheckpoint
from weights import load_folder

pytestmark = needs_megatron


def merge_and_compare(role: Path, expected: dict, out: Path, stacked: bool = True) -> dict:
    source = open_checkpoint(str(role))
    assert isinstance(source, MegatronDistCheckpoint)
    source.validate()
    assert source.describe()["stacked_layers"] == stacked and source.describe()["layers"] == 4
    assert sorted(source.tensors()) == sorted(expected)  # tied: no lm_head, as Hugging Face stores it
    manifest = merge_checkpoint(str(role), out, dtype="keep")
    assert manifest["verification"][0]["ok"] and manifest["verification"][0]["tensors"] == len(expected)
    merged = load_folder(out)
    assert sorted(merged) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name
    return manifest


@pytest.mark.parametrize("kind", ["dense", "tied", "llama", "qwen3", "moe"])
def test_tp1_save_merges_to_the_models_own_parameters(kind, tmp_path_factory, tmp_path):
    """MoE: Megatron's experts come out one tensor per expert, in the Hub's names (`mlp.experts.N.gate_proj.weight`),
    never packed."""
    role = tp1_save(tmp_path_factory, kind)
    assert open_checkpoint(str(role.parent.parent)).step == STEP
    merge_and_compare(role, hf_tensors(role), tmp_path / "merged")
    if kind == "moe":
        merged = load_folder(tmp_path / "merged")
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in merged
        assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in merged)
    assert_logits_match(tmp_path / "merged", role / "logits.pt")  # MoE too: Megatron's router, experts, shared expert


def test_verl091_folder_layout(tmp_path_factory, tmp_path):
    base = tp1_save(tmp_path_factory, "llama")
    role = as_verl091(base, tmp_path / "run" / f"global_step_{STEP}" / "actor")
    assert open_checkpoint(str(role)).dist_dir.url.endswith("actor/model/dist_ckpt")
    merge_and_compare(role, hf_tensors(base), tmp_path / "merged")


@pytest.mark.parametrize("kind,layout,keys", PARALLEL, ids=PARALLEL_IDS)
def test_parallel_saves_merge_to_the_same_model(kind, layout, keys, tmp_path_factory, tmp_path):
    """Tied embeddings under PP: the last stage's copy of the embedding is saved once, as the embedding."""
    base = tp1_save(tmp_path_factory, kind)
    role, _ = parallel_save(tmp_path_factory, kind, layout, keys)
    assert len(list((role / "dist_ckpt").glob("*.distcp"))) >= 2  # every rank wrote its pieces
    merge_and_compare(role, hf_tensors(base), tmp_path / "merged", stacked=keys == "stacked")
    assert_logits_match(tmp_path / "merged", base / "logits.pt")
    if (role / "logits.pt").exists():  # without PP: the TP-parallel forward of the saved layout itself
        assert_logits_match(tmp_path / "merged", role / "logits.pt")


def test_bf16_output_is_the_cast_model(tmp_path_factory, tmp_path):
    base = tp1_save(tmp_path_factory, "dense")
    role, _ = parallel_save(tmp_path_factory, "dense", "tp2")
    manifest = merge_checkpoint(str(as_verl091(role, tmp_path / "actor")), tmp_path / "out", dtype="bf16")
    assert manifest["dtype"] == "bfloat16"
    merged, expected = load_folder(tmp_path / "out"), hf_tensors(base)
    assert sorted(merged) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor.to(torch.bfloat16)), name
