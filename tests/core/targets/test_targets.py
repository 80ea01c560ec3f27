"""The output seam (`mergecore.targets`): one lock per target, no overlap with the checkpoint, exclusive staging,
links resolved, damaged models rebuilt, nothing left behind. Each case was reproduced on the code before the seam.

The race runs real `ckptflow merge` processes started together, as two schedulers would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mergecore import verify_manifest
from mergecore.model.manifest import MANIFEST_FILE

ROUNDS = 10


def ckptflow(*args, cwd=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ckptflow.flows.cli", *map(str, args)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "CKPTFLOW_LOCK_TIMEOUT": "120"})


def finished(process: subprocess.Popen) -> tuple[int, str]:
    _, stderr = process.communicate(timeout=300)
    return process.returncode, stderr


def one_line(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip() and not line.startswith("ckptflow: ")]  # the wait notice
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_racing_merges_with_overwrite_publish_one_complete_model(demo, tmp_path):
    """Two merges of one source to one target, started together (fp32 and fp16): the second waits for the first
    and replaces its model whole; the published folder always verifies and is one run's (the old code published
    a folder that `verify` rejected in ~3 of 20 trials)."""
    role_dir, target = demo("fsdp2-w2").role_dir, tmp_path / "model"
    for round_ in range(ROUNDS):
        runs = [ckptflow("merge", "--local_dir", role_dir, "--target_dir", target, "--overwrite", "--dtype", dtype)
                for dtype in ("fp32", "fp16")]
        results = [finished(run) for run in runs]
        assert [rc for rc, _ in results] == [0, 0], (round_, results)
        manifest = json.loads((target / MANIFEST_FILE).read_text())
        assert verify_manifest(target)["ok"] and manifest["dtype"] in ("float32", "float16")
        config = json.loads((target / "config.json").read_text())
        assert config["torch_dtype"] == manifest["dtype"], round_  # weights and metadata of the same run
        assert sorted(os.listdir(tmp_path)) == ["model"], round_  # no staging, lock or retired folder left


def test_racing_merges_without_overwrite_one_publishes_the_other_says_so(demo, tmp_path):
    role_dir, target = demo("fsdp2-w2").role_dir, tmp_path / "model"
    runs = [ckptflow("merge", "--local_dir", role_dir, "--target_dir", target, "--dtype", dtype) for dtype in ("fp32", "fp16")]
    results = sorted(finished(run) for run in runs)
    assert [rc for rc, _ in results] == [0, 2], results
    assert "already exists and is not empty; pass --overwrite" in one_line(results[1][1])
    assert verify_manifest(target)["ok"] and sorted(os.listdir(tmp_path)) == ["model"]


@pytest.mark.parametrize("where", ["is", "contains", "inside", "through a link"])
def test_a_target_overlapping_the_checkpoint_is_refused(cli, demo_copy, tmp_path, where):
    """`--target_dir X/actor --overwrite` deleted the rank files and huggingface/; `--local_dir run --target_dir run`
    the whole run root."""
    run = demo_copy("fsdp2-w2")
    before = sorted(p.relative_to(run.run_root) for p in run.run_root.rglob("*"))
    if where == "through a link":
        os.symlink(run.role_dir, tmp_path / "alias")
    target = {"is": run.role_dir, "contains": run.run_root, "inside": run.role_dir / "huggingface" / "merged",
              "through a link": tmp_path / "alias"}[where]
    result = cli("merge", "--local_dir", run.role_dir, "--target_dir", target, "--overwrite")
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "choose a --target_dir outside it" in line
    assert sorted(p.relative_to(run.run_root) for p in run.run_root.rglob("*")) == before  # not one file touched


def test_promote_refuses_a_target_inside_the_checkpoint(prefect_server, cli, demo_copy):
    run = demo_copy("fsdp2-w2")
    before = sorted(p.relative_to(run.run_root) for p in run.run_root.rglob("*"))
    result = cli("promote", run.run_root, "--target", run.run_root, "--overwrite")
    assert result.exit_code == 2 and "choose a --target_dir outside it" in result.stderr, result.output
    assert sorted(p.relative_to(run.run_root) for p in run.run_root.rglob("*")) == before


def test_a_link_at_the_staging_name_is_refused_and_its_target_untouched(cli, demo, tmp_path):
    """`ln -s victim .m6.ckptflow-partial`: the merge emptied victim/ and published m6 as a link to it."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    os.symlink(victim, tmp_path / ".m6.ckptflow-partial")
    result = cli("merge", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", tmp_path / "m6")
    assert result.exit_code == 2 and "not a staging folder ckptflow made" in result.stderr, result.output
    assert (victim / "thesis.tex").read_text() == "years of work" and os.listdir(victim) == ["thesis.tex"]
    assert not os.path.lexists(tmp_path / "m6")
    # an unmarked folder someone left at that name is refused the same way; one ckptflow marked is resumed
    os.unlink(tmp_path / ".m6.ckptflow-partial")
    (tmp_path / ".m6.ckptflow-partial").mkdir()
    (tmp_path / ".m6.ckptflow-partial" / "notes.txt").write_text("mine")
    assert cli("merge", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", tmp_path / "m6").exit_code == 2
    assert (tmp_path / ".m6.ckptflow-partial" / "notes.txt").read_text() == "mine"


def test_a_target_that_is_a_link_publishes_into_the_folder_it_names(cli, demo, tmp_path):
    """`link -> real`: the old code replaced the link by a folder, left real/ empty and a retired link behind."""
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    role_dir = demo("fsdp2-w2").role_dir
    for flags in ((), ("--overwrite", "--dtype", "fp16")):
        result = cli("merge", "--local_dir", role_dir, "--target_dir", tmp_path / "link", *flags)
        assert result.exit_code == 0, result.output
        assert os.path.islink(tmp_path / "link") and verify_manifest(tmp_path / "real")["ok"]
        assert sorted(os.listdir(tmp_path)) == ["link", "real"]
    assert json.loads((tmp_path / "real" / MANIFEST_FILE).read_text())["dtype"] == "float16"


def test_a_relative_target_with_dots_leaves_no_folder_behind(demo, tmp_path):
    """`--target_dir ../rel/../model` left an empty rel/; a refused merge into new/deep/model leaves no new/."""
    (tmp_path / "work").mkdir()
    rc, stderr = finished(ckptflow("merge", "--local_dir", demo("fsdp2-w2").role_dir, "--target_dir", "../rel/../model",
                                   cwd=tmp_path / "work"))
    assert rc == 0, stderr
    assert sorted(os.listdir(tmp_path)) == ["model", "work"] and verify_manifest(tmp_path / "model")["ok"]
    rc, stderr = finished(ckptflow("merge", "--local_dir", tmp_path / "work", "--target_dir", tmp_path / "new" / "deep" / "m"))
    assert rc == 2 and sorted(os.listdir(tmp_path)) == ["model", "work"], stderr


def flip_a_weight_byte(folder: Path) -> None:
    weights = sorted(folder.glob("*.safetensors"))[0]
    with open(weights, "r+b") as f:
        f.seek(weights.stat().st_size - 3)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_overwrite_rebuilds_a_damaged_published_model(cli, demo, tmp_path):
    role_dir, target = demo("fsdp2-w2").role_dir, tmp_path / "model"
    assert cli("merge", "--local_dir", role_dir, "--target_dir", target).exit_code == 0
    flip_a_weight_byte(target)
    assert cli("verify", target, "--skip-source").exit_code == 3
    result = cli("merge", "--local_dir", role_dir, "--target_dir", target, "--overwrite")
    assert result.exit_code == 0, result.output
    assert verify_manifest(target)["ok"]


def test_promote_overwrite_repairs_a_damaged_published_model(prefect_server, cli, demo, tmp_path):
    """A promote-on-upload deployment never recovered: promote --overwrite failed with "differs from
    ckptflow_manifest.json ... (merge again with overwrite)"."""
    role_dir, target = demo("fsdp2-w2").role_dir, tmp_path / "model"
    assert cli("promote", role_dir, "--target", target).exit_code == 0
    flip_a_weight_byte(target)
    assert cli("promote", role_dir, "--target", target).exit_code == 3  # without overwrite: refused, as before
    result = cli("promote", role_dir, "--target", target, "--overwrite")
    assert result.exit_code == 0, result.output
    assert verify_manifest(target)["ok"] and cli("verify", target).exit_code == 0
