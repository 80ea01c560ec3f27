"""Merging under a tiny memory budget (row blocks of ~4 KB) gives the same bytes as merging whole tensors.

Layouts: FSDP2 Shard(0) (uneven), Shard(1) (verl's placement function), HSDP, Megatron TP=2 (fused QKV,
gated MLP, row-parallel, padded vocabulary), to fp32 and to bf16. The values also equal the model that
was saved (`save_pretrained`'s files in reference/), cast by torch.
"""

from __future__ import annotations

import doctest
from pathlib import Path

import numpy as np
import pytest
import torch

from ckptflow.testing.megatron_fixtures import write_megatron_checkpoint
from mergecore import CheckpointError, merge_checkpoint, open_checkpoint
from weights import assert_cast_of, load_folder

TINY = 4096  # bytes per worker: every matrix of the fixtures spans several blocks
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="session")
def megatron_tp2(tmp_path_factory):
    return write_megatron_checkpoint(tmp_path_factory.mktemp("mcore-tp2"), "qwen2", tp=2)


def weight_bytes(folder: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(folder.glob("*.safetensors"))}


def merge_budgeted_and_whole(role: Path, dtype: str, tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    monkeypatch.setenv("CKPTFLOW_CHUNK_BYTES", "0")  # whole tensors: the path without a budget
    merge_checkpoint(str(role), tmp_path / "whole", dtype=dtype)
    monkeypatch.setenv("CKPTFLOW_CHUNK_BYTES", str(TINY))  # the round-trip check reads in blocks too
    manifest = merge_checkpoint(str(role), tmp_path / "budgeted", dtype=dtype)
    assert manifest["verification"][0]["ok"]
    return tmp_path / "whole", tmp_path / "budgeted"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", ["fsdp2-w2", "fsdp2-w4-placement", "hsdp-2x2"])
def test_fsdp_budgeted_merge_is_byte_identical(variant, dtype, demo, tmp_path, monkeypatch):
    ckpt = demo(variant)
    whole, budgeted = merge_budgeted_and_whole(ckpt.role_dir, dtype, tmp_path, monkeypatch)
    assert weight_bytes(budgeted) == weight_bytes(whole)
    assert_cast_of(budgeted, ckpt.reference_dir, DTYPES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_megatron_tp_budgeted_merge_is_byte_identical(dtype, megatron_tp2, tmp_path, monkeypatch):
    whole, budgeted = merge_budgeted_and_whole(megatron_tp2.role_dir, dtype, tmp_path, monkeypatch)
    assert weight_bytes(budgeted) == weight_bytes(whole)
    assert_cast_of(budgeted, megatron_tp2.reference_dir, DTYPES[dtype])


def blocks_of(source, name: str, dtype: str) -> list[tuple[int, np.ndarray]]:
    return [(start, np.array(block)) for start, block in source.row_blocks(name, dtype, TINY)]


@pytest.mark.parametrize("variant,name", [
    ("fsdp2-w2", "model.embed_tokens.weight"),              # Shard(0), uneven
    ("fsdp2-w4-placement", "model.embed_tokens.weight"),    # vocab 1001 is not divisible by 4: Shard(1)
    ("hsdp-2x2", "lm_head.weight"),
])
def test_blocks_stay_within_the_budget_and_tile_the_tensor(variant, name, demo):
    source = open_checkpoint(str(demo(variant).role_dir))
    blocks = blocks_of(source, name, "bfloat16")
    assert len(blocks) > 1 and all(block.nbytes <= TINY for _, block in blocks)
    assert [start for start, _ in blocks] == list(np.cumsum([0] + [len(b) for _, b in blocks[:-1]]))
    whole = np.concatenate([block for _, block in blocks])
    assert np.array_equal(whole.view(np.uint16), np.asarray(source.read(name, "bfloat16")).view(np.uint16))
    if variant == "fsdp2-w4-placement":
        assert "DTensor(S(1))" in source.tensors()[name].layout


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight",
                                  "model.layers.0.self_attn.o_proj.weight", "model.embed_tokens.weight"])
def test_megatron_blocks_equal_the_transformed_tensor(name, megatron_tp2):
    source = open_checkpoint(str(megatron_tp2.role_dir))
    blocks = blocks_of(source, name, "float32")
    assert len(blocks) > 1 and all(block.nbytes <= TINY for _, block in blocks)
    reference = load_folder(megatron_tp2.reference_dir)[name].numpy()  # save_pretrained of the model itself
    assert np.concatenate([b for _, b in blocks]).tobytes() == reference.tobytes()


def test_a_bad_budget_is_one_line(monkeypatch):
    from mergecore.numbers.budget import chunk_bytes

    monkeypatch.setenv("CKPTFLOW_CHUNK_BYTES", "lots")
    with pytest.raises(CheckpointError, match="CKPTFLOW_CHUNK_BYTES='lots': not a size"):
        chunk_bytes()
    assert chunk_bytes("64MiB") == 64 << 20 and chunk_bytes(0) == 0


def test_budget_docstrings():
    import mergecore.numbers.budget

    assert doctest.testmod(mergecore.numbers.budget).failed == 0
