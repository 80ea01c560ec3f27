"""Nothing private is published: the card and manifest a model carries (to the Hub, to object storage) name the
checkpoint by its run-relative name or its URL without credentials; the full local paths stay in this machine's
ledger (`mergecore/storage/ledger.py`), which `verify` reads to re-open the source."""

from __future__ import annotations

import json
import shutil

import pytest

from mergecore.storage.ledger import public_name


def test_public_names():
    assert public_name("/home/alice/ckpts/run1/global_step_100/actor") == "run1/global_step_100/actor"
    assert public_name("/global_step_100/actor") == "global_step_100/actor"  # no run folder above it
    assert public_name("/home/alice/models/Qwen2-7B") == "Qwen2-7B"
    assert public_name("s3://AKIA:secret@ckpts/run1/global_step_1/actor?X-Amz-Signature=abc#x") == \
        "s3://ckpts/run1/global_step_1/actor"
    assert public_name("s3://ckpts/run1/global_step_1/actor") == "s3://ckpts/run1/global_step_1/actor"


def test_the_hub_gets_no_local_path_and_verify_still_reopens_the_source(demo, cli, hub, tmp_path, monkeypatch):
    # was: README.md and ckptflow_manifest.json on the Hub held the absolute checkpoint path (user, layout)
    original = demo("fsdp2-w2")
    home = tmp_path / "home" / "alice" / "secret-project"
    shutil.copytree(original.run_root, home / "run7", ignore=shutil.ignore_patterns("reference"))
    role = home / "run7" / original.role_dir.relative_to(original.run_root)
    hf_dir = home / "hf-config"
    shutil.copytree(role / "huggingface", hf_dir)
    target = tmp_path / "out"
    result = cli("merge", "--local_dir", role, "--target_dir", target, "--hf_model_path", hf_dir,
                 "--hf_upload_path", "alice/run7")
    assert result.exit_code == 0, result.output

    pushed = hub.files("alice/run7")
    for name in ("README.md", "ckptflow_manifest.json"):
        text = pushed[name].decode()
        assert "secret-project" not in text and str(tmp_path) not in text and "/home/" not in text, name
    manifest = json.loads(pushed["ckptflow_manifest.json"])
    assert manifest["source"]["location"] == f"run7/{role.relative_to(home / 'run7')}"
    assert manifest["source"]["options"]["hf_dir"] == "hf-config"
    assert "run7/global_step_1/actor" in pushed["README.md"].decode().replace("\\", "")

    # this machine merged it: verify re-reads the source from the ledger, with no --source
    checks = cli("verify", target)
    assert checks.exit_code == 0 and "round-trip" in checks.stdout, checks.output

    # another machine (or a cleared ledger): the manifest's public name is never opened; --source is asked for
    monkeypatch.setenv("CKPTFLOW_CACHE", str(tmp_path / "another-cache"))
    refused = cli("verify", target)
    assert refused.exit_code == 2 and "--source" in refused.stderr, refused.output
    assert len(refused.stderr.strip().splitlines()) == 1
    given = cli("verify", target, "--source", role, "--hf_model_path", hf_dir)
    assert given.exit_code == 0 and "round-trip" in given.stdout, given.output


def test_the_ledger_holds_the_full_paths_under_the_models_weights_id(demo, cli, tmp_path):
    role = demo("fsdp2-w2").role_dir
    assert cli("merge", "--local_dir", role, "--target_dir", tmp_path / "out").exit_code == 0
    manifest = json.loads((tmp_path / "out" / "ckptflow_manifest.json").read_text())
    assert manifest["source"]["location"] == f"{role.parent.parent.name}/global_step_1/actor"
    ledger = tmp_path / "cache" / "sources" / f"{manifest['weights_id']}.json"
    assert json.loads(ledger.read_text()) == {"location": [manifest["source"]["location"], str(role)]}  # nothing else


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTFLOW_CACHE", str(tmp_path / "cache"))
