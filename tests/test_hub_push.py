"""Pushing merged folders with the real huggingface_hub client to a loopback Hub."""

from __future__ import annotations

import pytest

from mergecore import CheckpointError, merge_checkpoint
from mergecore.hub import push_folder


@pytest.fixture(scope="module")
def merged(demo, tmp_path_factory):
    target = tmp_path_factory.mktemp("merged") / "model"
    manifest = merge_checkpoint(str(demo("fsdp2-w2").role_dir), target)
    return target, manifest


def test_push_creates_branch_and_tag_and_is_idempotent(hub, merged):
    folder, _ = merged
    first = push_folder(folder, "alice/model", revision="step-1", tag="v1")
    assert first["new_commit"] and first["revision"] == "step-1"
    files = hub.files("alice/model", revision="step-1")
    for path in folder.iterdir():
        assert files[path.name] == path.read_bytes()
    assert hub.files("alice/model", revision="v1") == files
    assert hub.repo("alice/model").private is True

    commits = len(hub.commits("alice/model", branch="step-1"))
    seen = len(hub.requests)
    again = push_folder(folder, "alice/model", revision="step-1", tag="v1")
    assert not again["new_commit"] and again["commit"] == first["commit"]
    assert len(hub.commits("alice/model", branch="step-1")) == commits
    assert not any(r.method == "PUT" for r in hub.requests[seen:])  # nothing re-uploaded


def test_stale_files_of_an_earlier_push_are_removed(hub, merged, tmp_path):
    folder, _ = merged
    import shutil

    other = tmp_path / "other"
    shutil.copytree(folder, other)
    (other / "stale.txt").write_text("old")
    push_folder(other, "alice/model")
    push_folder(folder, "alice/model")
    assert "stale.txt" not in hub.files("alice/model")


def test_transient_errors_are_retried(hub, merged):
    folder, _ = merged
    hub.fail_next("POST", r"/preupload/", 429)
    hub.fail_next("PUT", r"/_lfs/upload/", 503)
    pushed = push_folder(folder, "alice/retried")
    assert pushed["new_commit"]
    statuses = [r.status for r in hub.requests]
    assert 429 in statuses and 503 in statuses


def test_bad_token_is_a_clear_error(hub, merged, monkeypatch):
    folder, _ = merged
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    with pytest.raises(CheckpointError, match=r"HTTP 401 .*HF_TOKEN"):
        push_folder(folder, "alice/model")


def test_someone_elses_namespace_is_refused(hub, merged):
    folder, _ = merged
    push_folder(folder, "alice/private-model")
    with pytest.raises(CheckpointError, match="alice/private-model"):
        push_folder(folder, "alice/private-model", token="hf_bob")


def test_merge_cli_upload_flags(hub, cli, demo, tmp_path):
    result = cli("merge", "--backend", "fsdp", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", tmp_path / "out",
                 "--hf_upload_path", "alice/from-cli", "--private", "--revision", "step-1")
    assert result.exit_code == 0, result.output
    assert "pushed to" in result.stdout
    card = hub.files("alice/from-cli", revision="step-1")["README.md"].decode()
    assert card.startswith("---\nlibrary_name: transformers\n") and "| round-trip | passed |" in card
    assert "| world size | 2 |" in card
