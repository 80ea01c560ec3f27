"""The Prefect DAG on a real Prefect server: resume, caching, invalidation, artifacts, Hub push.

Flow runs cost about a second each on top of the server's start, so each test makes few of them.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from ckptflow.flows.promote import promote_checkpoint
from ckptflow.flows.requests import PromotionRequest
from helpers import GROUPS, merge_group_states
from mergecore import merge_checkpoint
from mergecore.engine.writer import TensorWriter


def promote(ckpt, target, return_state=False, **options):
    return promote_checkpoint(PromotionRequest.of(str(ckpt.run_root), str(target), **options), return_state=return_state)


def test_interrupted_promotion_resumes_and_reruns_are_free(prefect_server, hub, demo, tmp_path, monkeypatch):
    ckpt = demo("fsdp2-w2")
    target = tmp_path / "model"
    options = dict(reference=str(ckpt.reference_dir), hub={"repo": "alice/run1", "revision": "step-1", "tag": "v1"})

    write = TensorWriter.write_rows  # every merge writes through it, in row blocks

    flaky = {"embed"}  # a transient I/O error, once: merge_group retries it

    def pull_the_disk_during_layers_1(self, planned, start, tensor):
        if planned.group == "layers.1":
            raise RuntimeError("injected fault")
        if planned.group in flaky:
            flaky.discard(planned.group)
            raise OSError("injected transient I/O error")
        return write(self, planned, start, tensor)

    monkeypatch.setattr(TensorWriter, "write_rows", pull_the_disk_during_layers_1)
    failed = promote(ckpt, target, return_state=True, **options)
    assert failed.is_failed()
    assert not target.exists() and not any("/api/models/alice/run1/commit" in r.path for r in hub.requests)
    monkeypatch.setattr(TensorWriter, "write_rows", write)

    resumed = promote(ckpt, target, **options)
    first, second = merge_group_states()[-2:]
    finished_before = {g for g, state in first.items() if state == "Completed"}
    assert {"embed", "layers.0"} <= finished_before and first["layers.1"] == "Failed"  # embed: after a retry
    assert not flaky
    assert {g for g, state in second.items() if state == "Cached"} == finished_before
    assert second["layers.1"] == "Completed"
    assert [c["check"] for c in resumed["checks"]] == ["round-trip", "reference", "logits"]
    assert all(c["ok"] for c in resumed["checks"]) and resumed["hub"]["new_commit"]

    uninterrupted = tmp_path / "direct"
    merge_checkpoint(str(ckpt.role_dir), uninterrupted)
    for path in uninterrupted.iterdir():
        if path.name not in ("ckptflow_manifest.json", "README.md"):  # the card records the checks run
            assert (target / path.name).read_bytes() == path.read_bytes(), path.name
    assert hub.files("alice/run1", revision="step-1")["model-00001-of-00001.safetensors"] == \
        (target / "model-00001-of-00001.safetensors").read_bytes()

    commits = len(hub.commits("alice/run1", branch="step-1"))
    runs_before = len(merge_group_states())
    rerun = promote(ckpt, target, **options)
    assert len(merge_group_states()) == runs_before  # the target holds this merge: no group runs at all
    assert rerun["cached_groups"] == GROUPS
    assert [c["check"] for c in rerun["checks"]] == ["round-trip", "manifest (size, mtime)", "reference", "logits"]
    assert not rerun["hub"]["new_commit"] and len(hub.commits("alice/run1", branch="step-1")) == commits

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["merge-report", "equivalence", "hub-revision"])))
        kinds = {a.key: a.type for a in artifacts}
        assert kinds == {"merge-report": "markdown", "equivalence": "table", "hub-revision": "markdown"}  # links render as markdown
        assert "alice/run1/tree/step-1" in max((a for a in artifacts if a.key == "hub-revision"), key=lambda a: a.created).data
        report = max((a for a in artifacts if a.key == "merge-report"), key=lambda a: a.created).data
        assert "| world size | 2 |" in report and "(4 cached)" in report
        progress = client.read_artifacts(artifact_filter=ArtifactFilter(type={"any_": ["progress"]}))
        assert any(float(a.data) == 100.0 for a in progress)  # updated per group up to the last
    assert "hf_alice" not in json.dumps([a.data for a in artifacts], default=str)


def test_cache_follows_exactly_the_inputs(prefect_server, demo_copy, tmp_path):
    ckpt = demo_copy("fsdp2-w2")
    target = tmp_path / "model"
    assert promote(ckpt, target)["cached_groups"] == []

    # Files no group reads: groups stay cached; a changed chat template is republished. The results folder
    # is gone too (another machine, a cleaned cache): the published weights are reused, not rebuilt.
    later = os.stat(ckpt.role_dir / "model_world_size_2_rank_1.pt").st_mtime + 10
    os.utime(ckpt.role_dir / "optim_world_size_2_rank_1.pt", (later, later))
    (ckpt.role_dir / "huggingface" / "chat_template.jinja").write_text("{{ messages }}")
    shutil.rmtree(tmp_path / ".model.ckptflow-results")
    weights = target / "model-00001-of-00001.safetensors"
    inode = weights.stat().st_ino
    again = promote(ckpt, target)
    assert again["cached_groups"] == GROUPS
    assert (target / "chat_template.jinja").read_text() == "{{ messages }}"
    assert weights.stat().st_ino == inode  # hard-linked into the new folder, never rewritten
    from mergecore import verify_manifest

    assert verify_manifest(target)["ok"]

    # verl FSDP: every group reads every rank file, so touching one invalidates them all.
    os.utime(ckpt.role_dir / "model_world_size_2_rank_1.pt", (later, later))
    assert promote(ckpt, target, overwrite=True)["cached_groups"] == []  # a different merge: replacing needs overwrite

    as_fp32 = promote(ckpt, target, dtype="fp32", overwrite=True)
    assert as_fp32["cached_groups"] == []
    assert json.loads((target / "config.json").read_text())["dtype"] == "float32"
    assert merge_group_states()[-1] == {g: "Completed" for g in GROUPS}


def test_bad_input_fails_the_run_before_anything_is_written(prefect_server, demo_copy, tmp_path):
    ckpt = demo_copy("fsdp2-w2")
    (ckpt.role_dir / "model_world_size_2_rank_0.pt").unlink()
    state = promote(ckpt, tmp_path / "model", return_state=True)
    assert state.is_failed()
    from mergecore import CheckpointError

    with pytest.raises(CheckpointError, match="model_world_size_2_rank_0.pt: missing"):
        state.result()
    assert list(tmp_path.iterdir()) == [tmp_path / "fsdp2-w2"]


def test_concurrent_runs_compute_each_group_once(prefect_server, demo_copy, tmp_path):
    import threading

    ckpt = demo_copy("fsdp2-w2")
    target = tmp_path / "model"
    results = []
    earlier = len(merge_group_states())
    runs = [threading.Thread(target=lambda: results.append(promote(ckpt, target))) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join(timeout=300)
    assert len(results) == 2
    ours = merge_group_states()[earlier:]  # the later run may find the model published and run no group
    for group in GROUPS:
        assert sorted(states[group] for states in ours) in (["Completed"], ["Cached", "Completed"]), group
    from mergecore import verify_manifest

    assert verify_manifest(target)["ok"]


def test_hub_token_from_a_prefect_secret_block(prefect_server, hub, demo, tmp_path, monkeypatch):
    from prefect.blocks.system import Secret

    from mergecore import CheckpointError
    from ckptflow.tasks import push_to_hub

    Secret(value="hf_alice").save("ckptflow-hub-token", overwrite=True)
    monkeypatch.delenv("HF_TOKEN")
    merge_checkpoint(str(demo("fsdp2-w2").role_dir), tmp_path / "model")
    with pytest.raises(CheckpointError, match="HTTP 401"):
        push_to_hub.fn(str(tmp_path / "model"), "alice/secret")
    pushed = push_to_hub.fn(str(tmp_path / "model"), "alice/secret", token_secret="ckptflow-hub-token")
    assert pushed["new_commit"] and "README.md" in hub.files("alice/secret")


def test_promote_command(prefect_server, cli, demo, demo_copy, tmp_path):
    ckpt = demo("fsdp2-w4-llama-tied")
    result = cli("promote", ckpt.run_root, "--target", tmp_path / "model", "--reference", ckpt.reference_dir)
    assert result.exit_code == 0, result.output
    assert f"verified model: {tmp_path / 'model'}" in result.stdout and "logits" in result.stdout

    broken = demo_copy("fsdp2-w2")
    (broken.role_dir / "huggingface" / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 32}')
    result = cli("promote", broken.run_root, "--target", tmp_path / "broken")
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "but the config implies" in result.stderr
    assert not (tmp_path / "broken").exists()


KILLED_DURING = """
import os, signal, sys
from mergecore.engine.writer import TensorWriter
from ckptflow.flows.requests import PromotionRequest
from ckptflow.flows.run import run_promotion

write = TensorWriter.write_rows  # every merge writes through it, in row blocks
def die_in(self, planned, start, tensor):
    if planned.group == sys.argv[3]:
        os.kill(os.getpid(), signal.SIGKILL)  # no handler, no cleanup: an OOM kill or a lost node
    return write(self, planned, start, tensor)
TensorWriter.write_rows = die_in
run_promotion(PromotionRequest.of(sys.argv[1], sys.argv[2]))
"""


def test_a_killed_promotion_leaves_nothing_that_blocks_the_next(prefect_server, demo, tmp_path):
    """kill -9 while groups are being merged: the next run must not wait on the dead run's group locks."""
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    ckpt, target = demo("fsdp2-w2"), tmp_path / "model"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    run = lambda group: subprocess.run([sys.executable, "-c", KILLED_DURING, str(ckpt.run_root), str(target), group],  # noqa: E731
                                       env=env, capture_output=True, text=True, timeout=240)
    killed = run("layers.1")
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert not target.exists()

    resumed = run("none")  # a stale lock would make this wait until the timeout
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    states = merge_group_states()[-1]
    assert states["layers.1"] == "Completed"  # killed while it was being written
    assert "Cached" in states.values() and set(states.values()) <= {"Cached", "Completed"}
    uninterrupted = tmp_path / "direct"
    merge_checkpoint(str(ckpt.role_dir), uninterrupted)
    for path in uninterrupted.iterdir():
        if path.name not in ("ckptflow_manifest.json", "README.md"):  # the card records the checks run
            assert (target / path.name).read_bytes() == path.read_bytes(), path.name
