"""Merging real FSDP checkpoints of every kind verl writes, checked against the trained model."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import VARIANTS
from mergecore.numbers.dtypes import config_dtype
from mergecore import compare_logits, compare_with_reference, merge_checkpoint, open_checkpoint, verify_manifest
from weights import load_folder


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_merge_equals_trained_model(variant, demo, tmp_path):
    ckpt = demo(variant)
    exact, cast = tmp_path / "fp32", tmp_path / "bf16"

    merge_checkpoint(str(ckpt.role_dir), exact, dtype="keep")
    report = compare_with_reference(exact, ckpt.reference_dir)  # atol = rtol = 0: bit-exact
    assert report["max_abs_diff"] == 0.0 and report["tensors"] > 0

    manifest = merge_checkpoint(str(ckpt.role_dir), cast)  # default: config.json's dtype (bfloat16)
    assert manifest["dtype"] == "bfloat16"
    assert [c["check"] for c in manifest["verification"]] == ["round-trip"]
    weights, reference = load_folder(cast), load_folder(ckpt.reference_dir)
    assert sorted(weights) == sorted(reference)
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor.to(torch.bfloat16)), name

    logits = compare_logits(cast, ckpt.reference_dir)
    assert logits["max_abs_diff"] == 0.0
    assert config_dtype(json.loads((cast / "config.json").read_text())) == "bfloat16"
    assert config_dtype(json.loads((exact / "config.json").read_text())) == "float32"  # says what it holds


def test_layouts_are_the_ones_verl_writes(demo):
    layouts = {v: {i.layout for i in open_checkpoint(str(demo(v).role_dir)).tensors().values()}
               for v in ("fsdp2-w4-placement", "hsdp-2x2", "fsdp1-sharded-tensor-tied", "single-llama")}
    assert "DTensor(S(1)) mesh (4,)" in layouts["fsdp2-w4-placement"]
    assert layouts["hsdp-2x2"] == {"DTensor(R, S(0)) mesh (2, 2)"}
    assert layouts["fsdp1-sharded-tensor-tied"] == {"ShardedTensor(dim 0)"}
    assert layouts["single-llama"] == {"plain"}


def test_uneven_shards_include_the_short_last_rank(demo):
    source = open_checkpoint(str(demo("fsdp2-w4-llama-tied").role_dir))
    rows = [p.sizes[0] for p in source.pieces("model.embed_tokens.weight")]
    assert rows == [251, 251, 251, 248]


def test_tied_embeddings_are_stored_once(demo, tmp_path):
    ckpt = demo("fsdp2-w4-llama-tied")
    manifest = merge_checkpoint(str(ckpt.role_dir), tmp_path / "out")
    assert manifest["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]


def test_max_shard_size_splits_files_and_every_file_reads_back(demo, tmp_path):
    ckpt = demo("fsdp2-w2")
    manifest = merge_checkpoint(str(ckpt.role_dir), tmp_path / "out", max_shard_size="200KB")
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    for file in files:
        with safe_open(str(tmp_path / "out" / file), framework="pt") as handle:
            names = list(handle.keys())
            assert names and all(index["weight_map"][n] == file for n in names)
            assert (tmp_path / "out" / file).stat().st_size <= 200_000 + 8 + 4096
    assert set(manifest["files"]) >= set(files) | {"tokenizer.json", "config.json", "generation_config.json"}
    assert verify_manifest(tmp_path / "out")["ok"]  # files hashed while later groups merged were complete


def test_hf_files_are_copied_verbatim(demo, tmp_path):
    ckpt = demo("fsdp2-w2")
    merge_checkpoint(str(ckpt.role_dir), tmp_path / "out")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (tmp_path / "out" / name).read_bytes() == (ckpt.role_dir / "huggingface" / name).read_bytes()


def test_run_root_and_step_folder_resolve_to_the_actor(demo):
    ckpt = demo("fsdp2-w2")
    for path in (ckpt.run_root, ckpt.role_dir.parent, ckpt.role_dir):
        assert open_checkpoint(str(path)).location.url == str(ckpt.role_dir)


def test_hsdp_replica_check(demo_copy, tmp_path):
    ckpt = demo_copy("hsdp-2x2")
    merge_checkpoint(str(ckpt.role_dir), tmp_path / "ok", check_replicas=True)
    # Rank 2 is the second ddp replica of rank 0's shard: make the replicas diverge.
    path = ckpt.role_dir / "model_world_size_4_rank_2.pt"
    state = torch.load(path, map_location="cpu", weights_only=True)
    state["model.norm.weight"]._local_tensor.add_(1.0)
    torch.save(state, path)
    from mergecore import CheckpointError

    with pytest.raises(CheckpointError, match="rank_2.pt: tensor model.norm.weight differs .* replica"):
        merge_checkpoint(str(ckpt.role_dir), tmp_path / "bad", check_replicas=True)
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("order", ["in order", "reversed"])
def test_file_hashes_follow_the_groups_as_they_are_written(demo, tmp_path, order):
    """Each file is hashed front to back as far as its groups are written; the digests are the files' sha256."""
    from mergecore import merge_group, prepare
    from mergecore.engine.hashes import BackgroundHashes
    from mergecore.model.manifest import sha256_file
    from mergecore.engine.writer import prepare_files

    prepared = prepare(str(demo("fsdp2-w2").role_dir), max_shard_size="100KB")
    plan = prepared.plan
    assert len(plan.files) > 2
    prepare_files(plan, tmp_path)
    hashes = BackgroundHashes(tmp_path)
    written: set[str] = set()
    for group in plan.groups if order == "in order" else reversed(plan.groups):
        merge_group(prepared.source, plan, group, tmp_path)
        written.add(group)
        hashes.start_written(plan, written)
    assert hashes.digests() == {file: sha256_file(tmp_path / file) for file in plan.files}


def test_an_abandoned_hasher_stops_its_thread(tmp_path):
    """A failed merge (or a rerun with nothing to write) must not leave a hashing thread waiting for ever."""
    from mergecore.engine.hashes import BackgroundHashes

    (tmp_path / "a.safetensors").write_bytes(b"x" * 1000)
    with pytest.raises(RuntimeError, match="merge failed"):
        with BackgroundHashes(tmp_path) as hashes:
            hashes.start(["a.safetensors"])
            raise RuntimeError("merge failed")
    hashes._thread.join(timeout=10)
    assert not hashes._thread.is_alive()
    with BackgroundHashes(tmp_path) as idle:
        pass
    idle._thread.join(timeout=10)
    assert not idle._thread.is_alive()
