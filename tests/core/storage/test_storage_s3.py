"""Checkpoints behind an fsspec URL: S3 through s3fs against a local moto server."""

from __future__ import annotations

import pytest

from mergecore import compare_with_reference, merge_checkpoint

s3fs = pytest.importorskip("s3fs")


def test_merge_from_s3_run_root(s3_env, demo, tmp_path):
    ckpt = demo("fsdp2-w2")
    s3_env.mkdir("ckpts")
    s3_env.put(str(ckpt.run_root / "latest_checkpointed_iteration.txt"), "ckpts/run1/latest_checkpointed_iteration.txt")
    s3_env.put(str(ckpt.run_root / "global_step_1"), "ckpts/run1/global_step_1", recursive=True)

    manifest = merge_checkpoint("s3://ckpts/run1", tmp_path / "out", dtype="keep")
    assert manifest["source"]["location"] == "s3://ckpts/run1/global_step_1/actor"
    assert manifest["source"]["step"] == 1
    assert compare_with_reference(tmp_path / "out", ckpt.reference_dir)["max_abs_diff"] == 0.0
    assert (tmp_path / "out" / "tokenizer.json").read_bytes() == (ckpt.role_dir / "huggingface" / "tokenizer.json").read_bytes()


def resaved_with_other_values(rank_file, target):
    """`rank_file` re-saved by torch with every local shard + 1: same names, shapes and layout, new values."""
    import torch
    import torch.distributed.tensor  # noqa: F401  (DTensor's unpickling needs it)

    state = torch.load(rank_file, map_location="cpu", weights_only=True)
    for value in state.values():
        value.to_local().add_(1.0)
    torch.save(state, target)
    return target


def full_tensors(rank_files) -> dict:
    """Global tensors from real FSDP2 rank files as torch.load reads them: local shards concatenated on dim 0."""
    import torch
    import torch.distributed.tensor  # noqa: F401  (DTensor's unpickling needs it)

    states = [torch.load(f, map_location="cpu", weights_only=True) for f in rank_files]
    out = {}
    for name, first in states[0].items():
        assert first.placements == (torch.distributed.tensor.Shard(0),), name  # what fsdp2-w2 is made of
        out[name] = torch.cat([state[name].to_local() for state in states])
    return out


def merged_tensors(folder) -> dict:
    from safetensors.torch import load_file

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_rank_file_rewritten_at_the_same_url_is_read_anew(s3_env, s3_endpoint, demo, tmp_path):
    from mergecore import open_checkpoint, verify_round_trip

    ckpt = demo("fsdp2-w2")
    rank0 = "model_world_size_2_rank_0.pt"
    s3_env.put(str(ckpt.role_dir), "ckpts/run2/actor", recursive=True)
    url = "s3://ckpts/run2/actor"

    merge_checkpoint(url, tmp_path / "before", dtype="keep")
    old = full_tensors([ckpt.role_dir / rank0, ckpt.role_dir / "model_world_size_2_rank_1.pt"])
    before = merged_tensors(tmp_path / "before")
    assert all(before[name].equal(value) for name, value in old.items())
    opened_before = open_checkpoint(url)
    opened_before.tensors()  # mapped the old copy

    # Another client rewrites rank 0 (a separate s3fs instance: ours keeps its listing cache).
    new_rank0 = resaved_with_other_values(ckpt.role_dir / rank0, tmp_path / rank0)
    writer = s3fs.S3FileSystem(endpoint_url=s3_endpoint, skip_instance_cache=True)
    writer.put(str(new_rank0), f"ckpts/run2/actor/{rank0}")

    manifest = merge_checkpoint(url, tmp_path / "after", dtype="keep")  # same cache folder (CKPTFLOW_CACHE)
    expected = full_tensors([new_rank0, ckpt.role_dir / "model_world_size_2_rank_1.pt"])
    after = merged_tensors(tmp_path / "after")
    assert set(after) == set(expected)
    for name, value in expected.items():
        assert after[name].equal(value), name
    assert any(not after[name].equal(before[name]) for name in expected)  # the rewrite did change values
    assert [c["ok"] for c in manifest["verification"] if c["check"] == "round-trip"] == [True]
    assert verify_round_trip(open_checkpoint(url), tmp_path / "after", manifest.get("aliases", {}))["ok"]

    # FSDP rank files are read by range into unlinked sparse files: no copy of either version stays on disk.
    assert not [p.name for p in (tmp_path / "cache").iterdir() if p.name.endswith(".pt")]


def test_truncated_cached_copy_is_fetched_again(s3_env, demo, tmp_path):
    """Whole-file copies (Megatron's files; FSDP reads by range) are trusted only when complete."""
    from mergecore.storage import Location

    ckpt = demo("fsdp2-w2")
    s3_env.put(str(ckpt.role_dir), "ckpts/run3/actor", recursive=True)
    remote = Location.of("s3://ckpts/run3/actor/model_world_size_2_rank_0.pt")
    original = (ckpt.role_dir / "model_world_size_2_rank_0.pt").read_bytes()
    copy = remote.local_file()
    with open(copy, "r+b") as f:  # as if a non-atomic writer had been killed halfway
        f.truncate(len(original) // 2)

    assert open(remote.local_file(), "rb").read() == original
    assert not any(".partial-" in p.name for p in (tmp_path / "cache").iterdir())


def test_damaged_rank_file_on_s3_is_refused_by_its_crc(s3_env, demo, cli, tmp_path):
    """Bytes fetched by range are checked like local ones: a rank file with 4 bytes of a tensor member
    overwritten (its zip directory keeps torch's CRC-32) is refused in one line naming the URL and member."""
    from helpers import damaged_fsdp

    from conftest import copy_run

    ckpt = copy_run(demo("fsdp2-w2"), tmp_path / "ckpt")
    _, member = damaged_fsdp(ckpt)
    s3_env.put(str(ckpt.role_dir), "ckpts/run4/actor", recursive=True)
    target = tmp_path / "out"
    result = cli("merge", "--local_dir", "s3://ckpts/run4/actor", "--target_dir", target)
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.stderr.rstrip().endswith(errors[0]), result.stderr
    assert "s3://ckpts/run4/actor/model_world_size_2_rank_0.pt" in errors[0], errors[0]
    assert f"member {member} fails its CRC-32 check" in errors[0], errors[0]
    assert not target.exists()
