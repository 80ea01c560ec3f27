"""Megatron MoE checkpoints saved with expert parallelism (expert_model_parallel_size=2) by real megatron-core
on CPU (gloo): dist_ckpt and verl's legacy rank folders.

Two layouts of world size 2, written by the one spawn of every world-2 reshard (mcore_real.ep_saves): TP 2
with EP 2 and ETP 1 (every rank holds whole experts of its own expert rank) and TP 1 with EP 2 (data parallel 2).
Expected values: the TP=1 save's own parameters (independent name table, mcore_real.hf_tensors), and each rank's
own experts as its megatron-core MoE layer places them (`local_expert_indices`); logits: megatron-core's own
forward of the TP=1 model and of each expert-parallel layout (experts dispatched across the two ranks).
"""

from __future__ import annotations

import json

import pytest
import torch

from mcore_real import (EP_LAYOUTS, STEP, assert_logits_match, ep_role, hf_tensors, megatron_expert_placement,
                        needs_megatron, tp1_save)
from mergecore import CheckpointError, merge_checkpoint, open_checkpoint
from mergecore.formats.megatron.dist import MegatronDistCheckpoint, load_dcp_metadata
from mergecore.formats.megatron.legacy import MegatronLegacyCheckpoint
from mergecore.storage import Location
from weights import load_folder

pytestmark = needs_megatron

EXPERTS_FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def merge_and_compare(role, expected: dict, out) -> dict[str, torch.Tensor]:
    manifest = merge_checkpoint(str(role), out, dtype="keep")
    assert manifest["verification"][0]["ok"]
    merged = load_folder(out)
    assert sorted(merged) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(merged[name], tensor), name
    return merged


@pytest.mark.parametrize("layout", list(EP_LAYOUTS))
def test_dist_ckpt_with_expert_parallelism_merges_to_the_models_own_parameters(layout, tmp_path_factory, tmp_path):
    """dist_ckpt stores each expert rank's experts as a chunk at its global expert offset: every expert comes
    out once, under its own number, equal to the TP=1 model's and to what megatron-core placed on each rank."""
    base = tp1_save(tmp_path_factory, "moe")
    role = ep_role(tmp_path_factory, layout, "dist")
    metadata = load_dcp_metadata(Location.of(str(role / "dist_ckpt" / ".metadata")))
    writers = {(index.offset[1], info.relative_path.split("_")[2]) for index, info in metadata.storage_data.items()
               if index.fqn == EXPERTS_FC1}  # (global expert, rank of the __R_K.distcp file holding it)
    assert sorted(writers) == [(0, "0"), (1, "0"), (2, "1"), (3, "1")]  # each expert rank wrote its own 2 experts
    source = open_checkpoint(str(role))
    assert isinstance(source, MegatronDistCheckpoint)
    merged = merge_and_compare(role, hf_tensors(base), tmp_path / "merged")
    placed = megatron_expert_placement(role, json.loads((base / "huggingface" / "config.json").read_text()))
    assert len(placed) == 4 * 4 * 3  # layers x experts x (gate, up, down), from both ranks
    for name, tensor in placed.items():
        assert torch.equal(merged[name], tensor), name
    assert_logits_match(tmp_path / "merged", base / "logits.pt")
    assert_logits_match(tmp_path / "merged", role / "logits.pt")  # the expert-parallel forward itself


def test_legacy_expert_parallel_folders_merge_to_the_models_own_parameters(tmp_path_factory, tmp_path):
    """verl's legacy manager at TP 2, EP 2, ETP 1 writes mp_rank_00_000 and mp_rank_01_001 (TP rank, then expert
    rank; no PP). Each file numbers its experts from 0: rank 1's local expert 0 is global expert 2. Read
    before as PP=2 (mp_rank_01_000 "missing")."""
    base = tp1_save(tmp_path_factory, "moe")
    role = ep_role(tmp_path_factory, "tp2-ep2-etp1", "legacy")
    assert sorted(p.name for p in (role / "model").iterdir()) == ["mp_rank_00_000", "mp_rank_01_001"]
    source = open_checkpoint(str(role.parent.parent), backend="megatron")
    assert isinstance(source, MegatronLegacyCheckpoint) and source.step == STEP
    assert (source.tp, source.pp) == (2, 1)
    assert source.describe()["expert_ranks"] == {"mp_rank_00_000": 0, "mp_rank_01_001": 1}
    merged = merge_and_compare(role, hf_tensors(base), tmp_path / "merged")
    placed = megatron_expert_placement(ep_role(tmp_path_factory, "tp2-ep2-etp1", "dist"),
                                       json.loads((base / "huggingface" / "config.json").read_text()))
    for name, tensor in placed.items():
        assert torch.equal(merged[name], tensor), name
    assert_logits_match(tmp_path / "merged", base / "logits.pt")


def test_legacy_save_missing_expert_ranks_is_refused(tmp_path_factory, tmp_path):
    """TP 1, EP 2 on two ranks: data parallel 2, and verl saves on data-parallel rank 0 only, so only expert
    rank 0's experts (2 of 4) reach mp_rank_00_000 (verl #2086). One line naming the cause; nothing written."""
    role = ep_role(tmp_path_factory, "ep2", "legacy")
    assert [p.name for p in (role / "model").iterdir()] == ["mp_rank_00_000"]
    with pytest.raises(CheckpointError) as excinfo:
        merge_checkpoint(str(role), tmp_path / "merged", dtype="keep")
    message = str(excinfo.value)
    assert "\n" not in message
    assert "expert-parallel rank(s) [0] only" in message and "2 of 4 experts" in message and "#2086" in message
    assert "dist_ckpt" in message
    assert not (tmp_path / "merged").exists()
