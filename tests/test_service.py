"""Promotion on events: what an event may ask for (unit level), then the whole service on a real Prefect server."""

from __future__ import annotations

import os

import pytest

from flows.service import event_place, inside_org, inside_root, promote_uploaded
from mergecore import CheckpointError

CKPT = "s3://ckpts/run1/global_step_1000/actor"


def test_an_event_with_only_the_checkpoint_lands_under_the_root_and_org(tmp_path):
    assert event_place(CKPT, str(tmp_path), "acme") == {
        "target": f"{tmp_path}/run1/step-1000", "hub_repo": "acme/run1", "revision": "step-1000"}


def test_no_org_means_no_hub_push(tmp_path):
    assert event_place(CKPT, str(tmp_path), None)["hub_repo"] is None


def test_the_event_may_choose_inside_the_boundary(tmp_path):
    place = event_place(CKPT, str(tmp_path), "acme", step=5, run="other", target="mine/x", hub_repo="acme/mine",
                        revision="rc-1")
    assert place == {"target": f"{tmp_path}/mine/x", "hub_repo": "acme/mine", "revision": "rc-1"}
    assert event_place(CKPT, str(tmp_path), "acme", run="other")["target"] == f"{tmp_path}/other/step-1000"
    assert event_place(CKPT, str(tmp_path), "acme", hub_repo="acme/x")["revision"] == "step-1000"


@pytest.mark.parametrize("target", ["/etc/passwd-dir", "{root}/../escape", "../escape", "{root}", "s3://bucket/x",
                                    "file:///tmp"])
def test_targets_outside_the_root_are_refused(tmp_path, target):
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(CheckpointError, match="outside this deployment's target root"):
        event_place(CKPT, str(root), "acme", target=target.format(root=root))


def test_a_symlink_inside_the_root_that_leads_out_is_refused(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    with pytest.raises(CheckpointError, match="outside"):
        inside_root(str(root / "link" / "model"), str(root))
    assert inside_root(str(root / "real" / "model"), str(root)) == str(root / "real" / "model")


def test_url_roots_compare_normalised_paths():
    assert inside_root("s3://b/models/r/x", "s3://b/models") == "s3://b/models/r/x"
    assert inside_root("r/x", "s3://b/models/") == "s3://b/models/r/x"
    for target in ["s3://b/models/../x", "s3://b/models-other/x", "s3://c/models/x", "/models/x", "s3://b/models"]:
        with pytest.raises(CheckpointError, match="outside"):
            inside_root(target, "s3://b/models")


@pytest.mark.parametrize("repo", ["evil/run1", "acme", "acme/../evil/x", "acme/a/b", "acmex/run1", "/acme/run1"])
def test_repos_outside_the_org_are_refused(repo):
    with pytest.raises(CheckpointError, match="outside this deployment's Hub organisation acme"):
        inside_org(repo, "acme")


def test_a_repo_without_an_org_is_refused():
    with pytest.raises(CheckpointError, match="no Hub organisation"):
        inside_org("acme/run1", None)


def test_a_deployment_without_a_root_refuses_every_event():
    with pytest.raises(CheckpointError, match="ckptflow deploy --target-root"):
        event_place(CKPT, None, "acme")


def test_a_bad_revision_or_run_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="not a branch name"):
        event_place(CKPT, str(tmp_path), "acme", revision="../main")
    with pytest.raises(CheckpointError, match="run name"):
        event_place(CKPT, str(tmp_path), "acme", run="../evil")


def test_the_flow_refuses_before_reading_or_writing_anything(tmp_path):
    root = tmp_path / "root"
    with pytest.raises(CheckpointError, match="outside"):
        promote_uploaded.fn(str(tmp_path / "no-such-checkpoint"), target=str(tmp_path / "elsewhere"),
                            target_root=str(root), hub_org="acme")
    with pytest.raises(CheckpointError, match="Hub organisation acme"):
        promote_uploaded.fn(str(tmp_path / "no-such-checkpoint"), hub_repo="evil/x", target_root=str(root),
                            hub_org="acme")
    assert os.listdir(tmp_path) == []
