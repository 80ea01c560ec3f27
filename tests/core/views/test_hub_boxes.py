"""Outputs that transformers' save conversion joins from several in-memory tensors, streamed in row blocks.

Sarvam-MoE (transformers 5 runs it as `Glm4MoeForCausalLM` under `SarvamMoEConfig`) keeps `self_attn.q_proj`,
`k_proj`, `v_proj` apart in memory; `save_pretrained` joins them (`torch.cat`, dim 0) into one
`attention.query_key_value` weight and bias, beside per-expert boxes of its packed experts. The fixture is a tiny
model trained one step under real FSDP2 on 2 gloo ranks and saved as verl saves it; `reference/` is its own
`save_pretrained` and its own forward at one torch thread: the independent truth.
"""

from __future__ import annotations

from helpers import torch_threads
import json
import shutil
import tracemalloc

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckptflow.testing.demo_checkpoint import LOGITS_FILE
from mergecore import VerificationError, compare_logits, merge_checkpoint, open_checkpoint, verify_round_trip
from mergecore.engine.merge import merge_view
from weights import load_folder

QKV = "model.layers.1.attention.query_key_value.weight"  # rows: q 64 | k 32 | v 32, each split over 2 ranks
QKV_BIAS = "model.layers.1.attention.query_key_value.bias"
BUDGET = 20 * 64 * 4 * 2  # 20 fp32 rows of QKV per block, and their one temporary


@pytest.fixture(scope="session")
def sarvam(demo):
    return demo("sarvam_moe")


@pytest.fixture(scope="session")
def merged(sarvam, tmp_path_factory):
    """One merge of the fixture in blocks of 20 rows of QKV (blocks cross the q|k|v seams)."""
    out = tmp_path_factory.mktemp("sarvam") / "out"
    manifest = merge_checkpoint(str(sarvam.role_dir), out, dtype="keep", chunk_bytes=BUDGET)
    return out, manifest


def test_joined_outputs_merge_to_save_pretrained_files_and_own_logits(sarvam, merged):
    """Was refused ("ckptflow writes only outputs that are a slice of one saved tensor")."""
    out, manifest = merged
    assert [c["check"] for c in manifest["verification"]] == ["round-trip"]
    weights, reference = load_folder(out), load_folder(sarvam.reference_dir)
    assert sorted(weights) == sorted(reference)
    assert tuple(reference[QKV].shape) == (128, 64) and tuple(reference[QKV_BIAS].shape) == (128,)
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in weights  # single-source boxes in the same model
    for name, tensor in reference.items():
        assert weights[name].dtype == tensor.dtype and torch.equal(weights[name], tensor), name

    own = torch.load(sarvam.reference_dir / LOGITS_FILE, weights_only=True)
    import transformers

    with torch_threads(1), torch.no_grad():  # the reference's thread count
        model = transformers.Glm4MoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        logits = model(input_ids=own["input_ids"]).logits
        assert compare_logits(out, sarvam.reference_dir)["max_abs_diff"] == 0.0
    torch.testing.assert_close(logits, own["logits"], atol=1e-5, rtol=1e-5)


def test_joined_output_is_read_in_row_blocks_within_the_budget(sarvam):
    """Each block holds only its rows of each part: blocks stay within CKPTFLOW_CHUNK_BYTES, far below the
    whole output, and together are the reference tensor."""
    budget = BUDGET
    source = merge_view(open_checkpoint(str(sarvam.role_dir)))
    expected = load_file(sarvam.reference_dir / "model.safetensors")[QKV]
    list(source.row_blocks(QKV, None, budget))  # warm: imports and caches are not the blocks' memory

    blocks, footprints = _blocks_measured(source, budget)
    assert [start for start, _ in blocks] == [0, 20, 40, 60, 80, 100, 120]  # 60..80: q|k, 80..100: k|v
    assert all(block.nbytes * 2 <= budget for _, block in blocks)
    assert max(footprints) <= budget < expected.numel() * 4  # never the whole output at once
    assert torch.equal(torch.cat([torch.from_numpy(block) for _, block in blocks]), expected)


def _blocks_measured(source, budget) -> tuple[list, list[int]]:
    """The row blocks of QKV and the bytes (traced by tracemalloc: numpy's) allocated at the peak while each was
    made, beyond what the blocks before it hold."""
    blocks, footprints = [], []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for start, block in source.row_blocks(QKV, None, budget):
            footprints.append(tracemalloc.get_traced_memory()[1] - before)
            blocks.append((start, block))
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return blocks, footprints


def test_round_trip_checks_every_part_of_a_joined_output(sarvam, merged, tmp_path):
    """A wrong value in the k rows of query_key_value (its second saved tensor) fails the verification."""
    out, _ = merged
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)
    file = damaged / json.loads((out / "model.safetensors.index.json").read_text())["weight_map"][QKV]
    tensors = load_file(file)
    tensors[QKV][70, 3] += 1.0  # row 70: k_proj row 6, on rank 0's shard of k
    save_file(tensors, file, metadata={"format": "pt"})
    source = merge_view(open_checkpoint(str(sarvam.role_dir)))
    assert verify_round_trip(source, out, {})["ok"]
    with pytest.raises(VerificationError, match="model.layers.1.self_attn.k_proj.weight|query_key_value"):
        verify_round_trip(source, damaged, {})


def test_stacked_and_column_joined_parts_are_placed_as_torch_places_them(demo):
    """Stacking (a new dim per input) and joining along columns, traced as a save conversion builds them, read
    back in row blocks equal `torch.stack` / `torch.cat` of save_pretrained's tensors; the round trip finds every
    piece of every part and notices a wrong value."""
    from mergecore.views.hub_layout import HubLayoutSource, _ViewsOnly, _as_box

    ckpt = demo("fsdp2-w2")
    k, v = "model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"  # (32, 64), 2 ranks
    inner = open_checkpoint(str(ckpt.role_dir))
    metas = {n: torch.empty(inner.tensors()[n].shape, device="meta") for n in (k, v)}
    built: dict = {}
    with _ViewsOnly(built):
        stacked = torch.stack([metas[k], metas[v]], dim=1)
        beside = torch.cat([metas[v][:, 32:], metas[k]], dim=-1)
    by_id = {id(t): n for n, t in metas.items()}
    view = HubLayoutSource(inner, {"stacked": _as_box("stacked", stacked, by_id, built),
                                   "beside": _as_box("beside", beside, by_id, built)})
    ref = load_folder(ckpt.reference_dir)
    expected = {"stacked": torch.stack([ref[k], ref[v]], dim=1), "beside": torch.cat([ref[v][:, 32:], ref[k]], dim=-1)}
    for name, want in expected.items():
        assert view.tensors()[name].shape == tuple(want.shape)
        blocks = list(view.row_blocks(name, None, 6 * want[0].numel() * 4 * 2))  # 6 rows a block
        assert [start for start, _ in blocks] == [0, 6, 12, 18, 24, 30]
        assert torch.equal(torch.cat([torch.from_numpy(block) for _, block in blocks]), want), name
        assert view.check_round_trip(name, want.numpy()) == 4  # 2 parts x 2 ranks
    wrong = expected["stacked"].clone()
    wrong[20, 1, 5] += 1.0  # v's row 20: rank 1's shard
    with pytest.raises(VerificationError, match=r"rank_1.pt: tensor stacked at offsets \(16, 1, 0\)"):
        view.check_round_trip("stacked", wrong.numpy())
