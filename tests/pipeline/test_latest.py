"""promote-latest on a real Prefect server and the loopback Hub: the ledger is the target and the Hub branch,
so a second run promotes nothing; retention keeps the newest N and never touches the run root."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mergecore import CheckpointError


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def run_flow(**parameters):
    from ckptflow.flows.latest import promote_latest
    from ckptflow.flows.settings import in_process_settings

    with in_process_settings():
        return promote_latest(**parameters)


def add_step(run_root: Path, step: int) -> None:
    """Training saved another step: the same weights under global_step_<step>, then the tracker (verl's order)."""
    first = next(run_root.glob("global_step_*"))
    shutil.copytree(first, run_root / f"global_step_{step}")
    (run_root / "latest_checkpointed_iteration.txt").write_text(str(step))


def test_promotes_once_and_keeps_the_newest_n(prefect_server, demo, hub, tmp_path):
    run_root = tmp_path / "ckpts" / "run1"
    shutil.copytree(demo("fsdp2-w2").run_root, run_root, ignore=shutil.ignore_patterns("reference"))
    models = tmp_path / "models"
    flow_args = dict(run_roots=[str(run_root)], target_root=str(models), hub_org="alice", keep_last_n=2)

    first = run_flow(**flow_args)["run1"]
    assert first["promoted"] and first["target"] == str(models / "run1" / "step-1")
    assert (models / "run1" / "step-1" / "ckptflow_manifest.json").is_file()
    commits = len(hub.commits("alice/run1", branch="step-1"))
    published = snapshot(models / "run1" / "step-1")

    shutil.rmtree(models / "run1" / ".step-1.ckptflow-results", ignore_errors=True)  # local state gone: no matter
    second = run_flow(**flow_args)["run1"]
    assert not second["promoted"]
    assert len(hub.commits("alice/run1", branch="step-1")) == commits
    assert snapshot(models / "run1" / "step-1") == published

    hub.repo("alice/run1").branches.pop("step-1")  # the Hub half of the ledger missing: pushed again
    assert run_flow(**flow_args)["run1"]["promoted"]
    assert "step-1" in hub.repo("alice/run1").branches

    before = {}
    for step in (2, 3):
        add_step(run_root, step)
        before = snapshot(run_root)
        report = run_flow(**flow_args)["run1"]
        assert report["promoted"] and report["step"] == step
    assert report["removed"] == {"folders": [str(models / "run1" / "step-1")], "branches": ["step-1"]}
    assert sorted(p.name for p in (models / "run1").glob("step-*")) == ["step-2", "step-3"]
    assert {"step-2", "step-3", "main"} <= set(hub.repo("alice/run1").branches)
    assert "step-1" not in hub.repo("alice/run1").branches
    assert snapshot(run_root) == before  # training checkpoints untouched, every step still there
    assert sorted(p.name for p in run_root.glob("global_step_*")) == ["global_step_1", "global_step_2", "global_step_3"]


def test_retention_refuses_a_target_root_inside_a_run_root(prefect_server, cli, tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(CheckpointError, match="overlaps the run root"):
        run_flow(run_roots=[str(tmp_path)], target_root=str(tmp_path / "models"), keep_last_n=1)
    result = cli("promote-latest", tmp_path, "--target-root", tmp_path / "models", "--keep-last-n", "1")
    assert result.exit_code == 2 and "overlaps the run root" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "models").exists()
