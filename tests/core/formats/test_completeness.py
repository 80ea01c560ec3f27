"""mergecore.formats.completeness on real fixture checkpoints copied in part, as an upload in progress leaves them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mergecore.formats.completeness import poll

s3fs = pytest.importorskip("s3fs")


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):
    from ckptflow.testing.megatron_fixtures import write_megatron_checkpoint

    return write_megatron_checkpoint(tmp_path_factory.mktemp("legacy") / "run", "qwen2", tp=2, pp=2, step=10)


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    from ckptflow.testing.megatron_dist_fixtures import write_dist_checkpoint

    base = tmp_path_factory.mktemp("dist")
    return (write_dist_checkpoint(base / "new" / "run", "qwen2", layout="verl091", step=10),
            write_dist_checkpoint(base / "old" / "run", "qwen2", layout="old", step=10))


def copy_except(source: Path, dest: Path, skip=lambda rel: False) -> list[Path]:
    """Copy `source` to `dest` except the files `skip(rel)` names; returns those left out (relative)."""
    left = []
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source)
        if path.is_file():
            if skip(rel.as_posix()):
                left.append(rel)
                continue
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest / rel)
    return left


def finish(source: Path, dest: Path, left: list[Path]) -> None:
    for rel in left:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / rel, dest / rel)


def two_polls(root):
    first = poll(root)
    return first, poll(root, first.sizes)


def test_fsdp_rank_files_arriving_one_by_one(demo, tmp_path):
    original = demo("fsdp2-w2").run_root
    dest = tmp_path / "run"
    left = copy_except(original, dest, lambda rel: "_rank_1.pt" in rel or rel.startswith("reference/"))
    first, second = two_polls(tmp_path)
    assert second.complete == [] and len(second.waiting) == 1
    url = next(iter(second.waiting))
    assert url == str(next(dest.glob("global_step_*")) / "actor")
    assert "missing ranks [1]" in second.waiting[url]
    left_model = [r for r in left if r.name.startswith("model_")]
    finish(original, dest, left_model)  # model rank 1 here, optimizer/extra rank 1 still missing
    reason = poll(tmp_path, second.sizes).waiting[url]
    assert "rank files for world size 2 incomplete (missing ranks [1])" in reason and not reason.startswith("model")
    finish(original, dest, left)
    now = poll(tmp_path, second.sizes)
    assert now.complete == [] and "stable" in now.waiting[url]  # new files since the last poll
    assert poll(tmp_path, now.sizes).complete == [url]


def test_a_growing_file_is_not_complete(demo, tmp_path):
    original = demo("fsdp2-w2").run_root
    copy_except(original, tmp_path / "run")
    rank0 = next((tmp_path / "run").rglob("model_world_size_2_rank_0.pt"))
    full = rank0.read_bytes()
    rank0.write_bytes(full[: len(full) // 2])
    first = poll(tmp_path)
    rank0.write_bytes(full[: 3 * len(full) // 4])
    second = poll(tmp_path, first.sizes)
    assert second.complete == []
    rank0.write_bytes(full)
    third = poll(tmp_path, second.sizes)
    assert third.complete == []
    assert poll(tmp_path, third.sizes).complete == [str(rank0.parent)]


@pytest.mark.parametrize("absent", ["fsdp_config.json", "huggingface/config.json"])
def test_fsdp_needs_its_config_and_huggingface(demo, tmp_path, absent):
    original = demo("fsdp2-w2").run_root
    copy_except(original, tmp_path / "run", lambda rel: rel.endswith("actor/" + absent))
    first, second = two_polls(tmp_path)
    assert second.complete == []
    assert absent in next(iter(second.waiting.values()))


def test_megatron_legacy_needs_every_rank_folder_and_the_tracker(legacy, tmp_path):
    dest = tmp_path / "run"
    left = copy_except(legacy.run_root, dest, lambda rel: "mp_rank_01_001" in rel or rel.startswith("reference/"))
    (dest / "latest_checkpointed_iteration.txt").write_text("5")  # the previous step's tracker
    first, second = two_polls(tmp_path)
    url = str(dest / "global_step_10" / "actor")
    assert second.complete == [] and "tp 1, pp 1" in second.waiting[url]
    finish(legacy.run_root, dest, [r for r in left if "mp_rank" in str(r)])
    third = poll(tmp_path, poll(tmp_path, second.sizes).sizes)
    assert third.complete == [] and "names step 5" in third.waiting[url]
    (dest / "latest_checkpointed_iteration.txt").write_text("10")  # verl writes it last
    assert poll(tmp_path, third.sizes).complete == [url]


def test_megatron_dist_verl091_needs_its_contents_manifest(dist, tmp_path):
    new, _ = dist
    dest = tmp_path / "run"
    left = copy_except(new.run_root, dest, lambda rel: rel.endswith("ckpt_contents.json"))
    first, second = two_polls(tmp_path)
    url = str(dest / "global_step_10" / "actor")
    assert list(second.waiting) == [url] and "ckpt_contents.json" in second.waiting[url]
    finish(new.run_root, dest, left)
    assert poll(tmp_path, poll(tmp_path, second.sizes).sizes).complete == [url]


def test_megatron_dist_needs_the_dcp_metadata(dist, tmp_path):
    _, old = dist
    dest = tmp_path / "run"
    left = copy_except(old.run_root, dest, lambda rel: rel.endswith("dist_ckpt/.metadata"))
    first, second = two_polls(tmp_path)
    url = str(dest / "global_step_10" / "actor")
    assert second.complete == [] and ".metadata" in second.waiting[url]
    finish(old.run_root, dest, left)
    assert poll(tmp_path, poll(tmp_path, second.sizes).sizes).complete == [url]


def test_an_empty_or_missing_root_has_nothing(tmp_path):
    assert poll(tmp_path / "absent").complete == [] and poll(tmp_path).sizes == {}


def test_on_s3_a_partial_upload_waits_and_the_complete_one_is_found(demo, s3_env):
    original = demo("fsdp2-w2").run_root
    s3_env.mkdir("uploads")
    role = next(original.glob("global_step_*/actor"))
    step = role.parent.name
    for path in sorted(role.rglob("*")):
        if path.is_file() and "_rank_1" not in path.name:
            s3_env.put_file(str(path), f"uploads/run1/{step}/actor/{path.relative_to(role).as_posix()}")
    url = f"s3://uploads/run1/{step}/actor"
    first, second = two_polls("s3://uploads")
    assert second.complete == [] and "missing ranks [1]" in second.waiting[url]
    for path in sorted(role.glob("*_rank_1.pt")):
        s3_env.put_file(str(path), f"uploads/run1/{step}/actor/{path.name}")
    third = poll("s3://uploads", second.sizes)
    assert third.complete == [] and "stable" in third.waiting[url]
    assert poll("s3://uploads", third.sizes).complete == [url]
