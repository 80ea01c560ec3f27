"""What a published folder holds, how it replaces an old one, and what a crash can leave."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading

import pytest

from mergecore import CheckpointError, merge_checkpoint, open_target, verify_manifest, verify_round_trip
from mergecore.model.folder import STAGING_MARKER
from mergecore.formats import open_checkpoint
from mergecore.model.manifest import MANIFEST_FILE
from mergecore.targets.publish import publish, retired_folders


def listing(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def expected_listing(manifest: dict) -> list[str]:
    return sorted([*manifest["files"], MANIFEST_FILE])


def test_strays_in_staging_and_an_old_shard_layout_are_never_published(cli, demo, tmp_path):
    ckpt, target = demo("fsdp2-w2"), tmp_path / "model"
    staging = open_target(target).staging
    staging.mkdir(parents=True)
    (staging / STAGING_MARKER).write_text("{}")  # a killed run's staging folder: ckptflow marked it
    (staging / "stray.txt").write_text("not part of the model")
    # what a killed run with another --max-shard-size leaves: other shard files, partly written
    (staging / "model-00001-of-00003.safetensors").write_bytes(b"\0" * 64)
    (staging / "model-00002-of-00003.safetensors").write_bytes(b"\0" * 64)
    (staging / "leftover").mkdir()
    result = cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", target)
    assert result.exit_code == 0, result.output
    manifest = json.loads((target / MANIFEST_FILE).read_text())
    assert listing(target) == expected_listing(manifest)
    assert "stray.txt" not in manifest["files"] and not (target / "model-00001-of-00003.safetensors").exists()
    index = json.loads((target / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(n for n in manifest["files"] if n.endswith(".safetensors"))
    assert not staging.exists()


def test_verification_reads_through_the_index(demo, tmp_path):
    ckpt, target = demo("fsdp2-w2"), tmp_path / "model"
    merge_checkpoint(str(ckpt.role_dir), target, max_shard_size="40KB")
    source = open_checkpoint(str(ckpt.role_dir))
    assert verify_round_trip(source, target, {})["ok"]
    shards = sorted(target.glob("model-*.safetensors"))
    assert len(shards) > 1
    # A weight file the index does not name, sorting after the real ones (a glob would let it win).
    shadow = target / "model-99999-of-99999.safetensors"
    shutil.copy(shards[0], shadow)
    with pytest.raises(CheckpointError, match="model-99999-of-99999.safetensors: a weight file that"):
        verify_round_trip(source, target, {})
    shadow.unlink()
    # A shard holding a tensor the index maps to another file.
    shutil.copy(shards[1], shards[0])
    with pytest.raises(CheckpointError, match=f"{shards[0].name}: holds other tensors than"):
        verify_round_trip(source, target, {})


def test_a_pushed_folder_still_verifies_and_publishes_its_card(cli, hub, demo_copy, tmp_path):
    ckpt = demo_copy("fsdp2-w2")
    (ckpt.role_dir / "huggingface" / "README.md").write_text("# the base model's card\n")
    target = tmp_path / "model"
    result = cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", target, "--hf_upload_path", "alice/run1")
    assert result.exit_code == 0, result.output
    manifest = json.loads((target / MANIFEST_FILE).read_text())
    assert "README.md" in manifest["files"] and "round-trip" in (target / "README.md").read_text()
    assert "base model's card" not in (target / "README.md").read_text()
    assert cli("verify", target).exit_code == 0
    assert verify_manifest(target)["ok"]
    remote = hub.files("alice/run1")
    assert {name: remote[name] for name in listing(target)} == {p.name: p.read_bytes() for p in target.iterdir()}
    assert hub.repo("alice/run1").private is True  # private unless --public

    public = cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", tmp_path / "public",
                 "--hf_upload_path", "alice/open", "--public")
    assert public.exit_code == 0, public.output
    assert hub.repo("alice/open").private is False
    verl_spelling = cli("merge", "--local_dir", ckpt.role_dir, "--target_dir", tmp_path / "private",
                        "--hf_upload_path", "alice/closed", "--private")
    assert verl_spelling.exit_code == 0 and hub.repo("alice/closed").private is True


def observe(target) -> str | None:
    """What a reader sees at `target` right now: None when it is a complete model (its listing is what its own
    manifest names), else what is wrong. Read through one descriptor of the folder, and kept only if the folder
    was still the target afterwards (a swap in between makes the observation moot, not wrong)."""
    try:
        descriptor = os.open(target, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return "missing"
    try:
        names = sorted(os.listdir(descriptor))
        try:
            manifest_fd = os.open(MANIFEST_FILE, os.O_RDONLY, dir_fd=descriptor)
            with os.fdopen(manifest_fd) as f:
                listed = expected_listing(json.load(f))
        except (FileNotFoundError, json.JSONDecodeError):
            listed = None
        try:
            still_target = os.stat(target).st_ino == os.fstat(descriptor).st_ino
        except FileNotFoundError:
            return "missing"
    finally:
        os.close(descriptor)
    if not still_target or names == listed:
        return None
    return f"incomplete: {names}"


RENAMES: list[tuple] | None = None  # os.rename calls seen while a test records them


def _record_renames(event: str, args: tuple) -> None:
    if RENAMES is not None and event == "os.rename":
        RENAMES.append(tuple(os.fsdecode(a) for a in args[:2]))


sys.addaudithook(_record_renames)  # audit hooks stay for the process; this one records only when asked


def test_overwrite_is_one_atomic_swap(demo, tmp_path):
    """A reader polling the target sees the complete old model or the complete new one, never less.

    The window of two renames is microseconds, too short for a poller to catch reliably, so the test also
    checks how the target is replaced: never by a plain rename of the target itself (one of a pair)."""
    global RENAMES
    ckpt, target = demo("fsdp2-w2"), tmp_path / "model"
    merge_checkpoint(str(ckpt.role_dir), target, dtype="fp32")
    bad, polls, done = [], [0], threading.Event()
    RENAMES = []

    def poll():
        while not done.is_set():
            polls[0] += 1
            if (seen := observe(target)) is not None:
                bad.append(seen)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        for dtype in ["bf16", "fp32", "bf16", "fp32"]:
            merge_checkpoint(str(ckpt.role_dir), target, dtype=dtype, overwrite=True)
    finally:
        done.set()
        poller.join()
        renames, RENAMES = RENAMES, None
    assert polls[0] > 100 and bad == []
    assert renames and not [r for r in renames if str(target) in r[:2]]  # staging -> retired after the exchange only
    assert listing(tmp_path) == ["model"]  # no retired or staging folder left beside it
    assert verify_manifest(target)["ok"]


def test_a_crash_after_the_swap_is_cleaned_by_the_next_run(demo, tmp_path):
    """The exchange put the old model at the staging name and the process died: it is never resumed from."""
    ckpt, target = demo("fsdp2-w2"), tmp_path / "model"
    merge_checkpoint(str(ckpt.role_dir), target, dtype="bf16")
    old = tmp_path / "old"
    merge_checkpoint(str(ckpt.role_dir), old, dtype="fp32")
    os.rename(old, open_target(target).staging)  # a finished (fp32) model under the staging name
    manifest = merge_checkpoint(str(ckpt.role_dir), target, dtype="bf16", overwrite=True)
    assert manifest["dtype"] == "bfloat16" and verify_manifest(target)["ok"]
    assert listing(tmp_path) == ["model"]


def test_without_renameat2_a_crash_between_the_renames_is_repaired(demo, tmp_path, monkeypatch):
    """The fallback for systems without an atomic exchange: target -> retired, staging -> target."""
    import mergecore.targets.publish

    ckpt, target = demo("fsdp2-w2"), tmp_path / "model"
    old_manifest = merge_checkpoint(str(ckpt.role_dir), target, dtype="bf16")
    monkeypatch.setattr(mergecore.targets.publish, "_renameat2", lambda *args: False)  # as on a system without it
    merge_checkpoint(str(ckpt.role_dir), target, dtype="fp32", overwrite=True)
    assert json.loads((target / MANIFEST_FILE).read_text())["dtype"] == "float32" and listing(tmp_path) == ["model"]

    # A crash right after the first rename: the target is missing, the old model is retired.
    os.rename(target, tmp_path / ".model.ckptflow-retired-deadbeef")
    with pytest.raises(CheckpointError, match="already exists"):  # repaired first: the old model is back
        merge_checkpoint(str(ckpt.role_dir), target, dtype="bf16")
    assert json.loads((target / MANIFEST_FILE).read_text())["dtype"] == "float32" and not retired_folders(target)
    assert verify_manifest(target)["ok"] and old_manifest["dtype"] == "bfloat16"


def test_publish_refuses_to_replace_without_overwrite(tmp_path):
    staging, target = tmp_path / "staging", tmp_path / "target"
    staging.mkdir()
    (staging / "a").write_text("new")
    target.mkdir()
    (target / "b").write_text("old")
    with pytest.raises(FileExistsError):
        publish(staging, target, overwrite=False)
    assert (target / "b").read_text() == "old" and (staging / "a").exists()
    publish(staging, target, overwrite=True)
    assert listing(target) == ["a"] and not staging.exists() and listing(tmp_path) == ["target"]
